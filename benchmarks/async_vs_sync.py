"""Asynchronous vs synchronous RL training: end-to-end speedup at the same compute and samples.

Same model, data, algorithm (GRPO + token-level TIS), seeds and number of trained samples, and
the same compute split in both modes: the rollout engine in a Ray actor with 1 CPU, the trainer
with 1 thread in the driver. Sync: each step waits for its rollout, then trains while the
engine idles. Async (`async_training.enabled`, max_staleness 4, in-flight weight updates): the
engine generates the next batches while the trainer trains. Workload: benchmarks/_longtail.py (1 prompt
in 8 loops to `max_new_tokens`).

The step is shaped so that a sync step's rollout and training take comparable time: overlapping
two stages can save at most the shorter one, so the speedup at equal work is bounded by
sync_step / max(rollout, train) (printed as `bound`). 16 prompts x 4 samples gave 0.8-1.1 s of
rollout (the latency of the few looping responses) against 0.2-0.3 s of training, a bound near
1.2x. 32 prompts x 8 samples make the training (about linear in the batch) comparable to the
rollout (whose looping tail decodes many rows for little more than one; groups of 8 also leave
fewer groups without signal, which the update skips), but over 10 steps training fell to 0.60x
of the rollout (bound 1.60): RL makes more responses run to `max_new_tokens`, so the rollout
grows. The default is therefore 2 epochs (`algorithm.epochs`, PPO epochs: two passes over each
batch, as PPO runs and the verl/OpenRLHF/ROLL `ppo_epochs` allow; GRPO recipes mostly keep 1):
training then takes 1.34x the rollout, nearer the balanced step that overlapping needs than
1 epoch's 0.60x (bounds 1.74 and 1.60); `--epochs 1` gives the one-pass shape.

The headline mode is async at equal work: `async_training.order: start` hands the trainer the
groups in the order they were started, so each async step trains on the same prompts as sync's
step (`same_prompts`, checked), long responses included, and the trained tokens differ from
sync's only by the sampled lengths (`trained_tokens_ratio`, printed beside the speedup). With
`max_ahead` 3 the engine starts batches up to three versions ahead while the trainer waits for
its batch's slowest group (with 2 it idled a quarter of the loop during the long training
steps: 25.8 s of 98.3); `max_staleness` 8 leaves room for a long group to end, so none is
dropped. Plain async (`max_staleness` 4, groups taken as they finish) trains first on the short
responses and leaves many long ones untrained: fewer tokens, the secondary
`speedup_short_kept`.

Why async samples fewer tokens on the same prompts: not the seeds or the engine (the first
batch, which both modes sample from the starting weights, differs by ~1%:
`first_step_tokens_ratio`), but, as far as one 4-step probe shows, the policy's lag. Here RL
raises the share of responses that run to `max_new_tokens` step after step with 1 epoch
(`truncated`), and async samples each batch
from weights 1-2 versions older than sync's, so it trails that growth (0.89 of sync's tokens
over 10 steps); with 2 epochs the share did not grow and the tokens matched (1.03).

Threads: each phase of a sync step runs alone, so it could use both cores; the mode `sync 2
threads` gives sync's trainer and engine 2 threads each, sync at its best on 2 cores (the
secondary `speedup_vs_sync_2_threads`). The other modes use 1 thread per stage, the split async
needs (one core per stage).

Reports the training-loop wall time of each (the final evaluation excluded) and the final eval
reward (mean of 4 samples per eval prompt), which must agree within TOLERANCE, and where the time
goes: rollout s/step (sync: the rollout; async: the trainer waiting for its batch), train s/step
(the rest of the step: batch, pi_old forward, update, weight sync), the engine's idle seconds,
its tokens per busy second, and tokens generated against tokens trained. The modes alternate,
`--rounds` times each, and each keeps its fastest run.
Last line: JSON with `speedup` (async keeping the long responses, at equal work) beside
`trained_tokens_ratio` (async over sync), `speedup_short_kept` (plain async) and
`speedup_vs_sync_2_threads`.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps N] [--rounds R] [--prompts P]
        [--group G] [--epochs E] [--max-ahead A] [--modes "sync,async in order,async,sync 2 threads"]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _longtail import alternating_runs, build_workload, workload_dir  # noqa: E402

from reroll.config.schema import RLConfig  # noqa: E402
from reroll.distributed.ray_runtime import ensure_ray  # noqa: E402
from reroll.pipelines.rlvr import rlvr_pipeline  # noqa: E402
from reroll.tracking import read_metrics  # noqa: E402

STEPS, PROMPTS, GROUP, MAX_NEW, LR = 10, 32, 8, 384, 2e-4
"""32 prompts x 8 samples with max_new_tokens 384: a sync step's rollout (~5 s, mostly the decode
of the four or so looping groups) and its training (the pi_old forward and the update, in
micro-batches of one group, so short groups are not padded to the long ones). 10 steps = 320
prompts, 1.25 passes over the 256 (about 10 minutes for the four modes)."""
EPOCHS = 2
"""Two passes over each batch (PPO epochs). 10-step runs: training 0.60x the rollout with 1
epoch (bound 1.60), 1.34x with 2 (bound 1.74); the per-step costs swing with the looping
responses either way."""
IN_FLIGHT = True
"""New weights are loaded between two decoding steps, not by aborting and re-prefilling every
running request (which made the same 30 async steps take 90.7 s instead of 33.0 s)."""
STALENESS = 4
"""Lets the engine work up to four batches ahead, so a batch that happens to hold no long group
(or two) does not leave one side idle; TIS corrects for the off-policy samples. With 2, nearly
every 384-token response missed the bound and was generated for nothing."""
TOKENS_TOLERANCE = 0.10
"""The headline run must train on as many response tokens as sync, within this fraction."""
TOLERANCE = 0.08
"""Largest accepted |async - sync| difference of the final eval reward (64 prompts x 4 samples
at temperature 1): about 2.5 standard errors of the difference of two such means at a reward
near 0.15 (each has a standard error of about 0.022)."""


MODES = {"sync": None, "async in order": {"max_staleness": 8, "max_ahead": 3, "order": "start"},
         "async": {"max_staleness": STALENESS}, "sync 2 threads": None}
"""Each mode's `async_training` settings (None: synchronous), in the order the modes run."""
THREADS = {"sync 2 threads": 2}
"""Torch threads of the trainer and of the engine, where not 1."""


def train(workload: dict, shape: argparse.Namespace, mode: str) -> dict:
    asynchronous, threads = MODES[mode], THREADS.get(mode, 1)
    if asynchronous and "max_ahead" in asynchronous:
        asynchronous = asynchronous | {"max_ahead": shape.max_ahead}
    name = mode.replace(" ", "_")  # each mode's run directory is its own
    steps, prompts, group = shape.steps, shape.prompts, shape.group
    config = RLConfig.model_validate({
        "name": f"bench-{name}", "output_dir": str(workload_dir() / f"run_{name}"), "seed": 0, "overwrite": True,
        "steps": steps, "model": {"path": workload["model"]},
        "data": {"train": workload["train"], "eval": workload["eval"]},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": MAX_NEW},
        "algorithm": {"correction": {"tis": {"level": "token", "cap": 2.0}}, "epochs": shape.epochs},
        "optimizer": {"lr": LR}, "train": {"micro_batch_size": group, "num_threads": threads},
        "eval": {"every_steps": 0, "samples_per_prompt": 4, "temperature": 1.0},
        "scheduler": {"engine_process": True, "engine_threads": threads},
        "async_training": {"enabled": asynchronous is not None, "in_flight_updates": IN_FLIGHT,
                           **(asynchronous or {})},
        "tracking": {"tensorboard": False, "record_batch_every": 0, "record_rollouts": 0}})
    pipeline = rlvr_pipeline(config)
    evaluate, eval_s, samples, prompts_trained = pipeline.evaluate, [], [0], []

    def timed_evaluate(*args) -> dict:  # the last step evaluates: kept out of the loop's time
        t0 = time.perf_counter()
        result = evaluate(*args)
        eval_s.append(time.perf_counter() - t0)
        return result

    next_batch = pipeline.step.task.source.next_batch

    def counted_next_batch(*args):
        trajectories = next_batch(*args)
        samples[0] += len(trajectories)
        prompts_trained.append(list(dict.fromkeys(t.prompt_text for t in trajectories)))
        return trajectories

    pipeline.evaluate, pipeline.step.task.source.next_batch = timed_evaluate, counted_next_batch
    engine, close, generated = pipeline.step.task.source.engine, pipeline.close, [0, 0.0]

    def close_after_counting() -> None:  # every token the engine made, evaluations included
        stats = getattr(engine, "inner", engine).stats()
        generated[:] = stats["generated_tokens"], stats["generated_tokens"] / stats["busy_s"]
        close()

    pipeline.close = close_after_counting
    summary = pipeline.run()
    rows = [r for r in read_metrics(summary["run_dir"]) if "time/step_s" in r]
    loop_s = sum(r["time/step_s"] for r in rows) - eval_s[-1]
    waiting = sum(r["time/rollout_s"] for r in rows)  # sync: the rollout; async: the wait for it
    return {"train_loop_s": loop_s,
            "rollout_s": waiting / len(rows),
            # everything else in the step: batch, pi_old forward, update, weight sync
            "train_s": (loop_s - waiting) / len(rows),
            "update_s": sum(r["time/train_s"] for r in rows) / len(rows),
            "eval_start": summary["eval_reward_start"], "eval_end": summary["eval_reward_end"],
            "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
            "trainer_idle_s": waiting,
            # sync: the engine idles while the trainer trains; async: no request running
            "engine_idle_s": sum(r["time/engine_idle_s"] for r in rows) if asynchronous
            else loop_s - waiting,
            "trained_tokens": sum(r["rollout/tokens"] for r in rows),
            "step_tokens": [r["rollout/tokens"] for r in rows],
            # responses that ran to max_new_tokens: the share that sets the tokens
            "truncated_frac": sum(r["train/truncated_frac"] for r in rows) / len(rows),
            "generated_tokens": generated[0],
            "engine_tokens_per_s": generated[1],  # per second with a request in flight
            "samples": samples[0], "prompts": prompts_trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step")
    parser.add_argument("--group", type=int, default=GROUP, help="samples per prompt")
    parser.add_argument("--epochs", type=int, default=EPOCHS,
                        help=f"passes over each batch, algorithm.epochs (default {EPOCHS})")
    parser.add_argument("--max-ahead", type=int, default=MODES["async in order"]["max_ahead"],
                        help="async in order: versions the engine may start ahead (default 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each mode, alternating (default 1); the fastest counts")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of the modes (the headline needs all)")
    args = parser.parse_args()
    modes = {m: m for m in args.modes.split(",")}
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; the modes are {', '.join(MODES)}")
    workload = build_workload()
    ensure_ray(num_cpus=2)
    runs, best = alternating_runs(modes, functools.partial(train, workload, args),
                                  args.rounds, "train_loop_s")
    sync = best.get("sync")
    table = Table(title=f"{args.steps} steps x {args.prompts} prompts x {args.group} samples, "
                        f"max_new_tokens {MAX_NEW}, {args.epochs} epoch(s); engine actor 1 CPU; 1 "
                        f"thread per stage (sync 2 threads: 2); "
                        f"fastest of {args.rounds} runs each (load average "
                        f"{os.getloadavg()[0]:.1f} at the end)")
    for column in ("mode", "loop s", "every run s", "speedup", "rollout (wait) s/step",
                   "train s/step", "update s/step", "trainer waits s", "engine idle s", "engine tok/s busy",
                   "tokens trained", "tokens generated", "truncated", "eval end", "staleness"):
        table.add_column(column)
    for mode, r in best.items():
        table.add_row(mode, f"{r['train_loop_s']:.1f}",
                      ", ".join(f"{run['train_loop_s']:.1f}" for run in runs[mode]),
                      f"{sync['train_loop_s'] / r['train_loop_s']:.2f}x" if sync else "-",
                      f"{r['rollout_s']:.2f}", f"{r['train_s']:.2f}", f"{r['update_s']:.2f}",
                      f"{r['trainer_idle_s']:.1f}", f"{r['engine_idle_s']:.1f}",
                      f"{r['engine_tokens_per_s']:,.0f}",
                      f"{r['trained_tokens']:,.0f}", f"{r['generated_tokens']:,.0f}",
                      f"{r['truncated_frac']:.3f}", f"{r['eval_end']:.3f}", f"{r['staleness_mean']:.2f}")
    console = Console(width=190)  # the table's width, also when printed to a pipe
    console.print(table)
    if sync:
        console.print(f"sync step {sync['rollout_s'] + sync['train_s']:.2f} s = rollout "
                      f"{sync['rollout_s']:.2f} + train {sync['train_s']:.2f}: overlapping the "
                      f"two at sync's rollout speed can reach {bound(sync):.2f}x at most")
    if not {"sync", "async", "async in order"} <= set(best):
        print(json.dumps({mode: {k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in r.items() if k not in ("prompts", "step_tokens")}
                          for mode, r in best.items()}))
        return
    asyn, long_kept = best["async"], best["async in order"]
    report = headline(sync, asyn, long_kept) | sync_2_threads(best.get("sync 2 threads"), long_kept)
    console.print(f"speedup {report['speedup']:.2f}x at equal work (same prompts every step: "
                  f"{report['same_prompts']}; trained tokens async/sync "
                  f"{report['trained_tokens_ratio']:.2f}, within {TOKENS_TOLERANCE:.0%}: "
                  f"{report['same_tokens']}; eval reward within {TOLERANCE}: "
                  f"{report['same_eval_reward']}; bound {report['bound']:.2f}x; goal >= 1.8x). "
                  f"Plain async, which trains on {report['trained_tokens_ratio_short_kept']:.2f} "
                  f"of sync's tokens: {report['speedup_short_kept']:.2f}x" + (
                      f". Against sync on 2 threads: {report['speedup_vs_sync_2_threads']:.2f}x"
                      if "speedup_vs_sync_2_threads" in report else ""))
    print(json.dumps(report | {
        "steps": args.steps, "prompts": args.prompts, "group": args.group,
        "epochs": args.epochs, "max_ahead": args.max_ahead,
        "load_average": round(os.getloadavg()[0], 2),
        "sync_s": round(sync["train_loop_s"], 2), "async_s": round(long_kept["train_loop_s"], 2),
        "async_short_kept_s": round(asyn["train_loop_s"], 2), "samples": sync["samples"],
        "sync_trained_tokens": sync["trained_tokens"],
        "async_trained_tokens": long_kept["trained_tokens"],
        "async_short_kept_trained_tokens": asyn["trained_tokens"],
        "sync_rollout_s_per_step": round(sync["rollout_s"], 3),
        "sync_train_s_per_step": round(sync["train_s"], 3),
        "async_train_s_per_step": round(long_kept["train_s"], 3),
        "async_trainer_idle_s": round(long_kept["trainer_idle_s"], 2),
        "async_engine_idle_s": round(long_kept["engine_idle_s"], 2),
        "sync_engine_tokens_per_s": round(sync["engine_tokens_per_s"]),
        "async_engine_tokens_per_s": round(long_kept["engine_tokens_per_s"]),
        "sync_generated_tokens": sync["generated_tokens"],
        "async_generated_tokens": long_kept["generated_tokens"],
        "sync_eval_reward": round(sync["eval_end"], 4),
        "async_eval_reward": round(long_kept["eval_end"], 4),
        # the first batch: both modes sample it from the starting weights, so only the seeds differ
        "first_step_tokens_ratio": round(long_kept["step_tokens"][0] / sync["step_tokens"][0], 3),
        "sync_truncated_frac": round(sync["truncated_frac"], 4),
        "async_truncated_frac": round(long_kept["truncated_frac"], 4),
        "async_short_kept_eval_reward": round(asyn["eval_end"], 4),
        "every_run_s": {mode: [round(r["train_loop_s"], 2) for r in rs] for mode, rs in runs.items()},
        "tolerance": TOLERANCE}))


def bound(sync: dict) -> float:
    """The most overlapping rollout and training can gain when each keeps sync's speed: a sync
    step is rollout + train, an overlapped one the longer of the two."""
    return (sync["rollout_s"] + sync["train_s"]) / max(sync["rollout_s"], sync["train_s"])


def sync_2_threads(sync2: dict | None, long_kept: dict) -> dict:
    """Secondary: the headline async run against sync at its best on 2 cores (each phase, running
    alone, with 2 threads); empty without that mode."""
    if sync2 is None:
        return {}
    return {"speedup_vs_sync_2_threads": round(sync2["train_loop_s"] / long_kept["train_loop_s"], 3),
            "bound_sync_2_threads": round(bound(sync2), 3),
            "sync_2_threads_s": round(sync2["train_loop_s"], 2),
            "sync_2_threads_rollout_s_per_step": round(sync2["rollout_s"], 3),
            "sync_2_threads_train_s_per_step": round(sync2["train_s"], 3)}


def headline(sync: dict, asyn: dict, long_kept: dict) -> dict:
    """The headline `speedup` is the async run at equal work: the one that takes its groups in
    start order, so it trains on sync's prompts step by step (`same_prompts`) and on about as
    many tokens (`trained_tokens_ratio`, async over sync, within TOKENS_TOLERANCE), and must reach
    the same eval reward. Plain async, which leaves many long responses out, is the secondary
    `speedup_short_kept`."""
    ratio = long_kept["trained_tokens"] / sync["trained_tokens"]
    return {
        "speedup": round(sync["train_loop_s"] / long_kept["train_loop_s"], 3),
        "same_prompts": long_kept["prompts"] == sync["prompts"],
        "bound": round(bound(sync), 3),
        "trained_tokens_ratio": round(ratio, 3),
        "same_tokens": abs(ratio - 1) <= TOKENS_TOLERANCE,
        "same_eval_reward": abs(long_kept["eval_end"] - sync["eval_end"]) <= TOLERANCE,
        "speedup_short_kept": round(sync["train_loop_s"] / asyn["train_loop_s"], 3),
        "trained_tokens_ratio_short_kept": round(asyn["trained_tokens"] / sync["trained_tokens"], 3),
        "same_eval_reward_short_kept": abs(asyn["eval_end"] - sync["eval_end"]) <= TOLERANCE,
    }


if __name__ == "__main__":
    main()

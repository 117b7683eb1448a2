"""Asynchronous vs synchronous RL training: end-to-end speedup at the same compute and samples.

Same model, data, algorithm (GRPO + token-level TIS), seeds and number of trained samples, and
the same compute split in both modes: the rollout engine in a Ray actor with 1 CPU, the trainer
with 1 thread in the driver. Sync: each step waits for its rollout, then trains while the
engine idles. Async (`async_training.enabled`, max_staleness 4, in-flight weight updates): the
engine generates the next batches while the trainer trains. Workload: benchmarks/_longtail.py (1 prompt
in 8 loops to `max_new_tokens`).

The batch is shaped so that a sync step's rollout and training take comparable time, as in the
RLVR runs ROLL Flash measured: overlapping two stages can save at most the shorter one, so the
speedup at equal work is bounded by sync_step / max(rollout, train) (printed as `bound`). With
16 prompts x 4 samples a sync step was 0.8-1.1 s of rollout (the latency of the few looping
responses) against 0.2-0.3 s of training, a bound near 1.2x. 32 prompts x 8 samples make the
training (about linear in the batch) comparable to the rollout (whose looping tail decodes
several rows at once for little more than one); groups of 8 also leave fewer groups without
signal, which the update skips.

The headline mode is async at equal work: `async_training.order: start` hands the trainer the
groups in the order they were started, so each async step trains on the same prompts as sync's
step (`same_prompts`, checked), long responses included, and the trained tokens differ from
sync's only by the sampled lengths (`trained_tokens_ratio`, printed beside the speedup). With
`max_ahead` 2 the engine starts batches up to two versions ahead while the trainer waits for its
batch's slowest group; `max_staleness` 8 leaves room for a long group to end, so none is
dropped. Plain async (`max_staleness` 4, groups taken as they finish) trains first on the short
responses and leaves many long ones untrained: fewer tokens, the secondary
`speedup_short_kept`. The last session's headline (the same settings, taken as they finish)
trained on 0.86 of sync's tokens: the long groups ended after shorter ones started later and
were still buffered or running when the run stopped.

Threads: each phase of a sync step runs alone, so it could use both cores; `--sync-threads 2`
gives sync's trainer and engine 2 threads each, sync at its best on 2 cores. The default, 1
each, gives both modes the same split, the one async needs (one core per stage).

Reports the training-loop wall time of each (the final evaluation excluded) and the final eval
reward (mean of 4 samples per eval prompt), which must agree within TOLERANCE, and where the time
goes: rollout s/step (sync: the rollout; async: the trainer waiting for its batch), train s/step
(the rest of the step: batch, pi_old forward, update, weight sync), the engine's idle seconds,
its tokens per busy second, and tokens generated against tokens trained. The modes alternate,
`--rounds` times each, and each keeps its fastest run.
Last line: JSON with `speedup` (async keeping the long responses, at equal work) beside
`trained_tokens_ratio` (async over sync), and `speedup_short_kept` (plain async).

    .venv/bin/python benchmarks/async_vs_sync.py [--steps N] [--rounds R] [--prompts P]
        [--group G] [--modes sync,async,...] [--sync-threads T]
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
from reroll.pipelines.rlvr import RLVRPipeline  # noqa: E402
from reroll.tracking import read_metrics  # noqa: E402

STEPS, PROMPTS, GROUP, MAX_NEW, LR = 20, 32, 8, 384, 2e-4
"""32 prompts x 8 samples with max_new_tokens 384: a sync step's rollout (5.4 s, mostly the decode
of the four or so looping groups) and its training (4.1 s: the pi_old forward and the update, in
micro-batches of one group, so short groups are not padded to the long ones) are comparable, a
bound of 1.76x (4-step probe, load average 2). 20 steps = 640 prompts, 2.5 epochs of the 256."""
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


MODES = {"sync": None, "async": {"max_staleness": STALENESS},
         "async in order": {"max_staleness": 8, "max_ahead": 2, "order": "start"}}
"""Each mode's `async_training` settings (None: synchronous)."""


def train(workload: dict, shape: argparse.Namespace, asynchronous: dict | None) -> dict:
    name = ("async_in_order" if asynchronous.get("order") == "start" else "async") \
        if asynchronous else "sync"  # each mode's run directory is its own
    steps, prompts, group = shape.steps, shape.prompts, shape.group
    threads = 1 if asynchronous else shape.sync_threads
    config = RLConfig.model_validate({
        "name": f"bench-{name}", "output_dir": str(workload_dir() / f"run_{name}"), "seed": 0, "overwrite": True,
        "steps": steps, "model": {"path": workload["model"]},
        "data": {"train": workload["train"], "eval": workload["eval"]},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": MAX_NEW},
        "algorithm": {"correction": {"tis": {"level": "token", "cap": 2.0}}},
        "optimizer": {"lr": LR}, "train": {"micro_batch_size": group, "num_threads": threads},
        "eval": {"every_steps": 0, "samples_per_prompt": 4, "temperature": 1.0},
        "scheduler": {"engine_process": True, "engine_threads": threads},
        "async_training": {"enabled": asynchronous is not None, "in_flight_updates": IN_FLIGHT,
                           **(asynchronous or {})},
        "tracking": {"tensorboard": False, "record_batch_every": 0, "record_rollouts": 0}})
    pipeline = RLVRPipeline(config)
    evaluate, eval_s, samples, prompts_trained = pipeline.evaluate, [], [0], []

    def timed_evaluate(*args) -> dict:  # the last step evaluates: kept out of the loop's time
        t0 = time.perf_counter()
        result = evaluate(*args)
        eval_s.append(time.perf_counter() - t0)
        return result

    next_batch = pipeline.task.source.next_batch

    def counted_next_batch(*args):
        trajectories = next_batch(*args)
        samples[0] += len(trajectories)
        prompts_trained.append(list(dict.fromkeys(t.prompt_text for t in trajectories)))
        return trajectories

    pipeline.evaluate, pipeline.task.source.next_batch = timed_evaluate, counted_next_batch
    engine, close, generated = pipeline.task.source.engine, pipeline.close, [0, 0.0]

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
            "generated_tokens": generated[0],
            "engine_tokens_per_s": generated[1],  # per second with a request in flight
            "samples": samples[0], "prompts": prompts_trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step")
    parser.add_argument("--group", type=int, default=GROUP, help="samples per prompt")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each mode, alternating (default 2); the fastest counts")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of the modes (the headline needs all)")
    parser.add_argument("--sync-threads", type=int, default=1, choices=(1, 2),
                        help="torch threads of sync's trainer and engine (async: 1 each)")
    args = parser.parse_args()
    modes = {m: MODES[m] for m in args.modes.split(",")}
    workload = build_workload()
    ensure_ray(num_cpus=2)
    runs, best = alternating_runs(modes, functools.partial(train, workload, args),
                                  args.rounds, "train_loop_s")
    sync = best.get("sync")
    table = Table(title=f"{args.steps} steps x {args.prompts} prompts x {args.group} samples, "
                        f"max_new_tokens {MAX_NEW}; engine actor 1 CPU; async 1 thread per stage, sync "
                        f"{args.sync_threads}; "
                        f"fastest of {args.rounds} runs each (load average "
                        f"{os.getloadavg()[0]:.1f} at the end)")
    for column in ("mode", "loop s", "every run s", "speedup", "rollout (wait) s/step",
                   "train s/step", "update s/step", "trainer waits s", "engine idle s", "engine tok/s busy",
                   "tokens trained", "tokens generated", "eval end", "staleness"):
        table.add_column(column)
    for mode, r in best.items():
        table.add_row(mode, f"{r['train_loop_s']:.1f}",
                      ", ".join(f"{run['train_loop_s']:.1f}" for run in runs[mode]),
                      f"{sync['train_loop_s'] / r['train_loop_s']:.2f}x" if sync else "-",
                      f"{r['rollout_s']:.2f}", f"{r['train_s']:.2f}", f"{r['update_s']:.2f}",
                      f"{r['trainer_idle_s']:.1f}", f"{r['engine_idle_s']:.1f}",
                      f"{r['engine_tokens_per_s']:,.0f}",
                      f"{r['trained_tokens']:,.0f}", f"{r['generated_tokens']:,.0f}",
                      f"{r['eval_end']:.3f}", f"{r['staleness_mean']:.2f}")
    console = Console(width=190)  # the table's width, also when printed to a pipe
    console.print(table)
    if sync:
        console.print(f"sync step {sync['rollout_s'] + sync['train_s']:.2f} s = rollout "
                      f"{sync['rollout_s']:.2f} + train {sync['train_s']:.2f}: overlapping the "
                      f"two at sync's rollout speed can reach {bound(sync):.2f}x at most")
    if set(best) != set(MODES):
        print(json.dumps({mode: {k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in r.items() if k != "prompts"}
                          for mode, r in best.items()}))
        return
    asyn, long_kept = best["async"], best["async in order"]
    report = headline(sync, asyn, long_kept)
    console.print(f"speedup {report['speedup']:.2f}x at equal work (same prompts every step: "
                  f"{report['same_prompts']}; trained tokens async/sync "
                  f"{report['trained_tokens_ratio']:.2f}, within {TOKENS_TOLERANCE:.0%}: "
                  f"{report['same_tokens']}; eval reward within {TOLERANCE}: "
                  f"{report['same_eval_reward']}; bound {report['bound']:.2f}x; goal >= 1.8x). "
                  f"Plain async, which trains on {report['trained_tokens_ratio_short_kept']:.2f} "
                  f"of sync's tokens: {report['speedup_short_kept']:.2f}x")
    print(json.dumps(report | {
        "steps": args.steps, "prompts": args.prompts, "group": args.group,
        "sync_threads": args.sync_threads,
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
        "async_short_kept_eval_reward": round(asyn["eval_end"], 4),
        "every_run_s": {mode: [round(r["train_loop_s"], 2) for r in rs] for mode, rs in runs.items()},
        "tolerance": TOLERANCE}))


def bound(sync: dict) -> float:
    """The most overlapping rollout and training can gain when each keeps sync's speed: a sync
    step is rollout + train, an overlapped one the longer of the two."""
    return (sync["rollout_s"] + sync["train_s"]) / max(sync["rollout_s"], sync["train_s"])


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

"""Tail batching vs plain synchronous rounds: rollout time for the same number of samples.

Workload (benchmarks/_longtail.py): arithmetic prompts, 1 in 8 of which make the SFT'd tiny
model loop until `max_new_tokens`; the model also loops, now and then, on an ordinary prompt.
Most plain rounds hold one or two looping groups, so the round lasts `max_new_tokens` decode
steps, nearly all of them at a batch of 8-16 rows. Tail batching stops responses at a length
budget in regular rounds, defers those prompts (and, after the first epoch, prompts known to
run long) and runs them together in long rounds of 8 deferred prompts, so the long decodes share
one batch. Two tail batching configurations run:

- all responses (`response_oversample` 1, the default): a group with one straggler is deferred
  too, so long rounds are twice as many, half of their groups ordinary prompts;
- RollPacker's speculative responses (`response_oversample` 1.25): regular rounds start 10
  responses per prompt and keep the first 8 to end, so only prompts that really run long are
  deferred. Its cost: an ordinary prompt's occasional straggler is never trained on (the
  tokens column shows how many fewer tokens that is).

Same engine, model, seeds, rounds and number of samples; only the scheduling differs. The modes
alternate, `--repeats` times each, and each keeps its fastest run (this machine's noise only
ever slows a run down). Last line: JSON with `speedup` (speculative responses, as RollPacker
runs it) and `speedup_all_responses`.

    .venv/bin/python benchmarks/tail_batching.py [--rounds N] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _longtail import alternating_runs, build_workload  # noqa: E402

from reroll.config.schema import RLConfig  # noqa: E402
from reroll.data.datasets import PromptSampler, load_prompts  # noqa: E402
from reroll.engines.base import Request, SamplingParams  # noqa: E402
from reroll.engines.hf import HFEngine  # noqa: E402
from reroll.models.loading import load_model, load_tokenizer  # noqa: E402
from reroll.rewards import RewardRunner, build_reward  # noqa: E402
from reroll.rewards.base import RewardSample  # noqa: E402
from reroll.rollout.scheduler import SyncSource  # noqa: E402
from reroll.rollout.settings import SourceSettings  # noqa: E402
from reroll.rollout.stream import PromptStream  # noqa: E402
from reroll.tracking import ProgressBar  # noqa: E402

ROUNDS, PROMPTS, GROUP, MAX_NEW, BUDGET = 40, 8, 8, 256, 32
SPECULATIVE = 1.25
"""RollPacker's response over-sampling: 10 responses started per group of 8."""
TRAIN_PROMPTS, CHECK_PROMPTS = 64, 8
"""64 training prompts, 8 of them check prompts (1 in 8): most plain rounds hold one or two
looping groups; 40 rounds are 5 epochs, so tail batching's history (prompts that ran long on an
earlier epoch) is used as in a real run."""


MODES = {"plain sync rounds": None, "tail, all responses": 1.0,
         f"tail, speculative x{SPECULATIVE}": SPECULATIVE}
"""Each mode's `tail_batching.response_oversample` (None: tail batching off)."""


def rollout_time(workload: dict, rounds: int, response_oversample: float | None) -> dict:
    tail = response_oversample is not None
    config = RLConfig.model_validate({
        "seed": 0, "overwrite": True, "steps": rounds, "model": {"path": workload["model"]},
        "data": {"train": workload["train"]},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": MAX_NEW},
        "train": {"micro_batch_size": GROUP},
        "tail_batching": {"enabled": tail, "length_budget": BUDGET,
                          "response_oversample": response_oversample or 1.0}})
    tokenizer = load_tokenizer(workload["model"])
    engine = HFEngine(load_model(workload["model"]), 256, tokenizer.pad_token_id)
    rewards = RewardRunner(build_reward(config.reward), config.reward.timeout_s)
    rows = training_prompts(workload["train"])
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, engine, rewards, tokenizer,
                        PromptStream(PromptSampler(rows, config.seed)))
    params = SamplingParams(MAX_NEW, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    warm_up(engine, rewards, source.encode(rows[0]), params)
    label = f"tail batching x{response_oversample}" if tail else "plain rounds"
    bar = ProgressBar(rounds, label)
    totals = {"rollout_s": 0.0, "samples": 0, "tokens": 0, "reward": 0.0, "long_rounds": 0,
              "long_round_s": 0.0, "at_max": 0}
    for step in range(1, rounds + 1):
        t0 = time.perf_counter()
        trajectories = source.next_batch(step, 0, params)
        totals["rollout_s"] += time.perf_counter() - t0
        totals["tokens"] += sum(len(t.response_ids) for t in trajectories)
        totals["reward"] += sum(t.reward for t in trajectories)
        totals["samples"] += len(trajectories)
        totals["at_max"] += sum(len(t.response_ids) >= MAX_NEW for t in trajectories)
        long_round = int(source.metrics().get("tail/long_round", 0))
        totals["long_rounds"] += long_round
        totals["long_round_s"] += long_round * (time.perf_counter() - t0)
        bar.update(step, f"{totals['rollout_s']:.1f}s")
    bar.close()
    rewards.close()
    # Deferred prompts still waiting: long work tail batching has not paid for within the rounds.
    waiting = int(source.metrics().get("tail/deferred_waiting", 0))
    return totals | {"reward_mean": totals["reward"] / totals["samples"], "deferred_left": waiting}


def training_prompts(path: str) -> list:
    """The first CHECK_PROMPTS check prompts and the first ordinary ones, TRAIN_PROMPTS in all."""
    rows = load_prompts(path)
    check = [r for r in rows if r.metadata["check"]][:CHECK_PROMPTS]
    return check + [r for r in rows if not r.metadata["check"]][:TRAIN_PROMPTS - len(check)]


def warm_up(engine: HFEngine, rewards: RewardRunner, prompt_ids: list[int],
            params: SamplingParams) -> None:
    """Untimed: the first decode and the reward worker's start-up."""
    engine.generate_batch([Request(prompt_ids, replace(params, max_new_tokens=16))])
    asyncio.run(rewards.reward(RewardSample("", "\\boxed{1}", "1", "stop", {})))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each mode, alternating (default 2); the fastest counts")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the engine (default 2: the machine's cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = build_workload()
    runs, best = alternating_runs(MODES, functools.partial(rollout_time, workload, args.rounds),
                                  args.repeats, "rollout_s")
    plain, all_responses, speculative = best.values()
    table = Table(title=f"Rollout phase, {args.rounds} rounds x {PROMPTS} prompts x {GROUP} "
                        f"samples, max_new_tokens {MAX_NEW}, length budget {BUDGET}, "
                        f"{args.threads} threads, fastest of {args.repeats} runs each")
    for column in ("mode", "rollout s", "every run s", "speedup", "samples", "tokens",
                   "at max_new_tokens", "long rounds", "reward"):
        table.add_column(column)
    for mode, r in best.items():
        table.add_row(mode, f"{r['rollout_s']:.1f}",
                      ", ".join(f"{run['rollout_s']:.1f}" for run in runs[mode]),
                      f"{plain['rollout_s'] / r['rollout_s']:.2f}x", str(r["samples"]),
                      f"{r['tokens']:,}", str(r["at_max"]), str(r["long_rounds"]),
                      f"{r['reward_mean']:.3f}")
    console = Console(width=130)  # the table's width, also when printed to a pipe
    console.print(table)
    speedup = plain["rollout_s"] / speculative["rollout_s"]
    console.print(f"tail batching speedup {speedup:.2f}x with speculative responses, "
                    f"{plain['rollout_s'] / all_responses['rollout_s']:.2f}x with all responses "
                    f"(goal >= 1.5x); prompts still deferred at the end: "
                    f"{speculative['deferred_left']}")
    print(json.dumps({
        "speedup": round(speedup, 3),
        "speedup_all_responses": round(plain["rollout_s"] / all_responses["rollout_s"], 3),
        "plain_rollout_s": round(plain["rollout_s"], 2),
        "tail_rollout_s": round(speculative["rollout_s"], 2),
        "tail_all_responses_rollout_s": round(all_responses["rollout_s"], 2),
        "plain_samples": plain["samples"], "tail_samples": speculative["samples"],
        "plain_tokens": plain["tokens"], "tail_tokens": speculative["tokens"],
        "long_rounds": speculative["long_rounds"],
        "long_round_s": round(speculative["long_round_s"], 2),
        "deferred_left": speculative["deferred_left"]}))


if __name__ == "__main__":
    main()

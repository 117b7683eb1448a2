"""A synthetic run directory whose contents the viewer tests know exactly.

30 steps of an RL run with a rising reward, eval every 5 steps, non-finite values at step 17,
staleness metrics, one metric no chart group claims, and rollouts recorded at steps 2, 10 and 20
(numerically, not alphabetically, ordered), one of them an agentic trajectory with turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = 30
EVAL_EVERY = 5
NON_FINITE_STEP = 17
ZEBRA_ROWS = 3  # rollouts whose prompt mentions "zebra" (all at step 10)
ROLLOUT_STEPS = (2, 10, 20)
ROWS_PER_STEP = 8


def metrics_rows() -> list[dict]:
    rows = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "train/reward_mean": 0.1 + 0.7 * step / STEPS + 0.03 * (step % 3),
               "train/reward_std": 0.2, "train/response_len_mean": 30 - step / 3,
               "train/truncated_frac": 0.5 / step, "train/groups_all_equal": 0.25,
               "actor/entropy": 2.0 - step / 30, "actor/clip_frac": 0.01 * (step % 4),
               "actor/approx_kl": 1e-3 * step, "actor/kl_ref": 2e-3 * step,
               "train/loss": 0.1, "train/grad_norm": 1.0 + step / 10, "train/lr": 1e-4,
               "time/step_s": 2.0, "time/rollout_s": 1.2, "time/train_s": 0.7,
               "time/weight_sync_s": 0.1, "reward/errors": 0, "reward/timeouts": 0,
               "staleness/mean": step % 2, "custom/widgets": step * 2}
        if step % EVAL_EVERY == 0:
            row["eval/reward_mean"] = 0.2 + step / 50
        if step == NON_FINITE_STEP:
            row["train/grad_norm"] = "nan"
            row["actor/entropy"] = "inf"
        rows.append(row)
    return rows


def rollout_rows(step: int) -> list[dict]:
    rows = []
    for i in range(ROWS_PER_STEP):
        animal = "zebra" if step == 10 and i < ZEBRA_ROWS else "cat"
        reward = [0.0, 1.0, 0.5, -1.0][i % 4]
        rows.append({"prompt": f"Step {step}: how many legs has a {animal} number {i}?",
                     "response": f"A {animal} has \\boxed{{4}} legs.</script><b>x</b>",
                     "answer": "4", "reward": reward,
                     "reward_info": {"correct": float(reward > 0), "reason": "ok" if reward > 0 else "wrong"},
                     "finish_reason": "stop" if i % 2 else "length", "group_id": i // 4})
    if step == 20:
        rows[0]["turns"] = [
            {"role": "policy", "text": "I will look at the board. <move>e4</move>"},
            {"role": "env", "text": "Board updated. Your move again."},
            {"role": "policy", "text": "<move>Nf3</move> and the answer is \\boxed{4}"},
            {"role": "env", "text": "Game over: you won."},
        ]
        rows[0]["response"] = ""
    return rows


EVAL_STEPS = (0, 10, 20)
EVAL_PROMPTS = 4


def write_eval_rollouts(root: Path) -> None:
    """Held-out samples of evaluations before training and after steps 10 and 20: the same
    prompts each time (`Held-out k`), the reward of prompt k rising from one evaluation to the
    next; and an agentic episode at step 30 with a reward for each of its two turns."""
    for n, step in enumerate(EVAL_STEPS):
        rows = [{"prompt": f"Held-out {k}: what is 2 + {k}?", "response": f"eval {step} says {k}",
                 "answer": str(2 + k), "reward": float(n >= k), "finish_reason": "stop",
                 "group_id": k} for k in range(EVAL_PROMPTS)]
        (root / "rollouts" / f"eval_step_{step}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    segments = [{"text": "<guess>50</guess>", "policy": True, "turn": 0},
                {"text": "Too high.", "policy": False, "turn": 0},
                {"text": "<guess>25</guess>", "policy": True, "turn": 1},
                {"text": "Correct!", "policy": False, "turn": 1}]
    (root / "rollouts" / "step_30.jsonl").write_text(json.dumps(
        {"prompt": "Guess a number.", "response": "", "reward": 0.9, "segments": segments,
         "turn_rewards": [-0.1, 1.0], "finish_reason": "stop", "group_id": 0}) + "\n")


def write_run(root: Path, *, summary: bool = True, config: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows()))
    (root / "rollouts").mkdir()
    for step in ROLLOUT_STEPS:
        (root / "rollouts" / f"step_{step}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rollout_rows(step)))
    if config:
        (root / "config.yaml").write_text("pipeline: rlvr\nname: synthetic-run\nsteps: 30\n"
                                          "model:\n  path: models/tiny  # <not a tag>\n")
    if summary:
        (root / "summary.json").write_text(json.dumps(
            {"run_dir": str(root), "steps": STEPS, "eval_reward_start": 0.15,
             "eval_reward_end": 0.8, "wall_time_s": 61.5}))
    return root


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return write_run(tmp_path / "run")


@pytest.fixture
def spec() -> dict:
    """The synthetic run's shape, for the tests' expectations."""
    return {"steps": STEPS, "eval_every": EVAL_EVERY, "non_finite_step": NON_FINITE_STEP,
            "zebra_rows": ZEBRA_ROWS, "rollout_steps": ROLLOUT_STEPS, "rows_per_step": ROWS_PER_STEP}


@pytest.fixture
def held_out(run_dir) -> dict:
    """`run_dir` with held-out samples and an agentic episode with turn rewards
    (`write_eval_rollouts`); the shape of what was added."""
    write_eval_rollouts(run_dir)
    return {"eval_steps": EVAL_STEPS, "eval_prompts": EVAL_PROMPTS}


@pytest.fixture
def make_run():
    """`write_run` itself, for tests that need several synthetic runs."""
    return write_run

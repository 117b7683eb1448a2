"""Offline vs on-policy distillation, against the teacher's cost: held-out reward as a function of
the response tokens the teacher has scored (`distill/teacher_tokens`).

Teacher: the tiny model after 112 SFT steps on worked arithmetic solutions (single-digit sums).
Student: the tiny model after 25 of those steps (it writes the format, gets few sums right).
- offline (`reroll distill`): the student learns the teacher's top-8 distribution on the SFT
  data's own solutions, 32 rows a step;
- on-policy (`algorithm.distill`, pure): the student samples 8 prompts x 4 responses a step and
  the teacher scores those tokens; the advantage is log pi_T - log pi_S per token.
Both are evaluated greedily on the same 64 held-out prompts every few steps (checkpoints, then
`reroll eval`'s code). The target is closing 60% of the teacher-student gap; the headline is the
teacher tokens each needs to reach it. Equal work here means equal teacher tokens, so the curves
are drawn against them.
Last line: JSON with both curves, the target and `teacher_tokens_ratio` (offline over on-policy
at the target; > 1: on-policy is cheaper in teacher computations).

    .venv/bin/python benchmarks/distillation.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from rich.console import Console

from reroll.config import load_config
from reroll.data.tasks import write_arithmetic
from reroll.evaluation import EvalSpec, evaluate
from reroll.models.factory import make_model
from reroll.pipelines.distill import train_distill
from reroll.pipelines.rlvr import train
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

ROOT = Path("runs/bench_distill")
console = Console(stderr=True)
BASE = {"tracking": {"progress": False, "tensorboard": False}}


def run_config(name: str, data: dict) -> Path:
    path = ROOT / f"{name}.yaml"
    path.write_text(yaml.safe_dump(BASE | {"output_dir": str(ROOT / name), "overwrite": True}
                                   | data))
    return path


def sft(name: str, model: str, train_file: str, steps: int) -> str:
    config = run_config(name, {"pipeline": "sft", "model": {"path": model}, "steps": steps,
                               "data": {"train": train_file, "response_key": "solution"},
                               "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5}})
    return train_sft(load_config(config, expect="sft"))["final_model"]


def reward(model: str, held_out: str) -> float:
    return evaluate(EvalSpec(model=model, task=held_out, max_new_tokens=24))[0]["mean@1"]


def curve(run: Path, held_out: str, key: str) -> list[dict]:
    """(teacher tokens, held-out reward) at each checkpoint of `run`."""
    tokens = {r["step"]: r[key] for r in read_metrics(run) if key in r}
    points = []
    for checkpoint in sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name[5:])):
        step = int(checkpoint.name[5:])
        points.append({"step": step, "teacher_tokens": tokens[step],
                       "reward": reward(str(checkpoint), held_out)})
        console.log(run.name, points[-1])
    return points


def tokens_to_reach(points: list[dict], target: float) -> float | None:
    return next((p["teacher_tokens"] for p in points if p["reward"] >= target), None)


def main() -> None:
    torch.set_num_threads(2)
    ROOT.mkdir(parents=True, exist_ok=True)
    tiny = str(make_model(ROOT / "tiny", "tiny", seed=0)) if not (ROOT / "tiny").is_dir() \
        else str(ROOT / "tiny")
    data = write_arithmetic(ROOT / "data", train_size=1200, eval_size=16, seed=0, levels=(1,))
    held_out = str(write_arithmetic(ROOT / "held_out", train_size=1, eval_size=64, seed=7,
                                    levels=(1,))["eval"])
    teacher = sft("teacher", tiny, str(data["train"]), 112)
    student = sft("student", tiny, str(data["train"]), 25)
    scores = {"teacher": reward(teacher, held_out), "student": reward(student, held_out)}
    target = scores["student"] + 0.6 * (scores["teacher"] - scores["student"])
    console.log(scores, f"target {target:.3f}")

    offline = run_config("offline", {
        "pipeline": "distill", "model": {"path": student}, "teacher": {"path": teacher},
        "distill": {"top_k": 8}, "steps": 60, "batch_size": 32,
        "data": {"train": str(data["train"]), "response_key": "solution"},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"every_steps": 10, "keep_last": 6}})
    train_distill(load_config(offline, expect="distill"))
    on_policy = run_config("on_policy", {
        "steps": 30, "model": {"path": student},
        "data": {"train": str(data["train"]), "eval": held_out},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 24},
        "optimizer": {"lr": 1e-3}, "eval": {"every_steps": 0, "max_prompts": 8},
        "checkpoint": {"every_steps": 5, "keep_last": 6},
        "algorithm": {"distill": {"teacher": {"path": teacher}, "mode": "pure"}}})
    train(load_config(on_policy))
    curves = {"offline": curve(ROOT / "offline", held_out, "distill/teacher_tokens"),
              "on_policy": curve(ROOT / "on_policy", held_out, "distill/teacher_tokens")}
    reach = {mode: tokens_to_reach(points, target) for mode, points in curves.items()}
    ratio = reach["offline"] / reach["on_policy"] if all(reach.values()) else None
    print(json.dumps({"teacher_reward": scores["teacher"], "student_reward": scores["student"],
                      "target": target, "teacher_tokens_to_target": reach,
                      "teacher_tokens_ratio": ratio, "curves": curves}))


if __name__ == "__main__":
    main()

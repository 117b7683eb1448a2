"""Offline vs on-policy distillation, against the teacher's cost: held-out reward as a function of
the response tokens the teacher has scored (`distill/teacher_tokens`).

The pair (`--teacher`):
- `rl` (the default, the issue's and examples/distill/'s): the demo's (`make demo`). Student: the
  tiny model after the demo's 1,000 SFT steps on demonstrations of mixed quality (60% skip the
  working and are right a quarter of the time; levels 1-4). Teacher: the student after the
  demo's GRPO (`--teacher-rl-steps`, 40), which it learnt on its own samples.
- `sft` (the default until 2026-11-26): teacher the tiny model after 112 SFT steps on worked
  single-digit sums, student after 55 of those steps (`--student-steps`); the gap is more of
  the same SFT, on the very rows offline distillation reads.
Both sides start from the student.
- offline (`reroll distill`): the student learns the teacher's top-8 distribution on the SFT
  data's own responses, 32 rows a step;
- on-policy (`algorithm.distill`): the student samples 32 responses a step and the teacher
  scores those tokens. `--on-policy-mode dense` (the default; GKD): one response to each of 32
  prompts, and the loss is `--divergence` between the teacher's top-8 (as offline's) and the
  student's distribution at every position; `--on-policy-mode pure`: 8 prompts x 4 responses,
  and the advantage is log pi_T - log pi_S of each sampled token.
Both are evaluated greedily on the same held-out prompts (`--held-out`, 256 by default: a
64-prompt mean moves by 0.016 a prompt, and its curves crossed the target by chance) every 5
steps (checkpoints, then `reroll eval`'s code). `--seed` seeds both distillation runs (their data
order and the on-policy samples); the teacher and student stay the same. The target is closing
60% of the teacher-student gap; the headline is the teacher tokens each needs to reach it. Equal
work here means equal teacher tokens, so the curves are drawn against them.
Last line: JSON with the settings, both curves, the target and `teacher_tokens_ratio` (offline
over on-policy at the target; > 1: on-policy is cheaper in teacher computations), and the same
in `teacher_positions` (response tokens plus the templated prompt the teacher also reads, once a
sequence on both sides). The options (learning rates, on-policy mode, divergence, warmup,
baseline, prompts and samples per prompt, epochs, steps) are the knobs tried in
docs/benchmarks.md.

    .venv/bin/python benchmarks/distillation.py [--on-policy-mode pure] [--on-policy-lr 3e-4] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from rich.console import Console

from reroll.config import load_config
from reroll.data.datasets import load_prompts
from reroll.data.tasks import write_arithmetic
from reroll.evaluation import EvalSpec, evaluate
from reroll.models.factory import make_model
from reroll.models.loading import load_tokenizer
from reroll.pipelines.distill import train_distill
from reroll.pipelines.rlvr import train
from reroll.pipelines.sft import train_sft
from reroll.pipelines.validation import prompt_lengths
from reroll.tracking import read_metrics

ROOT = Path("runs/bench_distill")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
console = Console(stderr=True)
BASE = {"tracking": {"progress": False, "tensorboard": False}}


def run_config(name: str, data: dict) -> Path:
    path = ROOT / f"{name}.yaml"
    path.write_text(yaml.safe_dump(BASE | {"output_dir": str(ROOT / name), "overwrite": True}
                                   | data))
    return path


def finished(name: str, steps: int) -> dict | None:
    """The summary of run `name` if it finished `steps` steps (reused), else None."""
    done = ROOT / name / "summary.json"
    summary = json.loads(done.read_text()) if done.is_file() else None
    return summary if summary and summary["steps"] == steps else None


def sft(name: str, model: str, train_file: str, steps: int) -> str:
    """The SFT'd model `name` (a finished run of the same steps is reused)."""
    if summary := finished(name, steps):
        return summary["final_model"]
    config = run_config(name, {"pipeline": "sft", "model": {"path": model}, "steps": steps,
                               "data": {"train": train_file, "response_key": "solution"},
                               "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5}})
    return train_sft(load_config(config, expect="sft"))["final_model"]


def demo_run(example: str, name: str, model: str, data: dict, steps: int) -> dict:
    """The summary of the demo's run `example` (examples/arithmetic/) from `model` on `data`,
    `steps` steps, as `make demo` runs it; a finished run of the same steps is reused."""
    if summary := finished(name, steps):
        return summary
    config = load_config(EXAMPLES / "arithmetic" / example, [
        f"model.path={model}", f"data.train={data['train']}", f"data.eval={data['eval']}",
        f"steps={steps}", f"output_dir={ROOT / name}", "overwrite=true",
        "tracking.progress=false", "tracking.tensorboard=false"])
    return train_sft(config) if config.pipeline == "sft" else train(config)


MAX_NEW_TOKENS = {"sft": 24, "rl": 40}
"""Response budget of the evaluations and the on-policy samples: the single-digit sums of the
`sft` pairing fit 24 tokens; the demo's levels 1-4 take its GRPO's 40."""


def reward(model: str, held_out: str, max_new_tokens: int) -> float:
    return evaluate(EvalSpec(model=model, task=held_out,
                             max_new_tokens=max_new_tokens))[0]["mean@1"]


def sft_pairing(args: argparse.Namespace, tiny: str) -> dict:
    """Teacher: 112 SFT steps on worked single-digit sums; student: fewer of the same steps."""
    data = write_arithmetic(ROOT / "data", train_size=1200, eval_size=16, seed=0, levels=(1,))
    return {"teacher": sft("teacher", tiny, str(data["train"]), 112),
            "student": sft("student", tiny, str(data["train"]), args.student_steps),
            "train": str(data["train"]), "response_key": "solution",
            "held_out": str(write_arithmetic(ROOT / "held_out", train_size=1,
                                             eval_size=args.held_out, seed=7,
                                             levels=(1,))["eval"])}


def rl_pairing(args: argparse.Namespace, tiny: str) -> dict:
    """The demo's pair (`make demo`, examples/distill/): the student is its SFT warm start on
    demonstrations of mixed quality (60% skip the working, right a quarter of the time), the
    teacher that model after the demo's GRPO; what the teacher learnt, it learnt on its own
    samples, not from the demonstrations offline distillation reads."""
    data = {k: str(v) for k, v in write_arithmetic(ROOT / "demo_data", seed=0, direct_frac=0.6,
                                                    direct_accuracy=0.25).items()}
    # sft.yaml's 8 epochs of the 4,000 rows, 32 a step
    student = demo_run("sft.yaml", "demo_sft", tiny, data, 1000)["final_model"]
    teacher = demo_run("grpo.yaml", "demo_grpo", student, data, args.teacher_rl_steps)
    return {"teacher": teacher["final_checkpoint"], "student": student, "train": data["train"],
            "response_key": "response",
            "held_out": str(write_arithmetic(ROOT / "demo_held_out", train_size=1,
                                             eval_size=args.held_out, seed=7)["eval"])}


def curve(run: Path, held_out: str, key: str, prompt_cost: float, max_new_tokens: int
          ) -> list[dict]:
    """(teacher tokens, held-out reward) at each checkpoint of `run`. `teacher_positions` adds
    the prompt positions the teacher also reads (`prompt_cost` a step: 32 sequences a step on
    the offline side, prompts x samples on the on-policy side, each with its templated prompt)."""
    tokens = {r["step"]: r[key] for r in read_metrics(run) if key in r}
    points = []
    for checkpoint in sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name[5:])):
        step = int(checkpoint.name[5:])
        points.append({"step": step, "teacher_tokens": tokens[step],
                       "teacher_positions": round(tokens[step] + step * prompt_cost),
                       "reward": reward(str(checkpoint), held_out, max_new_tokens)})
        console.log(run.name, points[-1])
    return points


def checkpoints(args: argparse.Namespace, steps: int) -> dict:
    """Every 5 steps, and every step up to `--fine-steps` (the demo's pair closes most of its gap
    in the first few steps, on both sides)."""
    return {"every_steps": 5, "keep_last": steps // 5 + 1,
            "keep_steps": [s for s in range(1, args.fine_steps + 1) if s % 5]}


def tokens_to_reach(points: list[dict], target: float, key: str = "teacher_tokens"
                    ) -> float | None:
    return next((p[key] for p in points if p["reward"] >= target), None)


def offline_over_on_policy(reach: dict) -> float | None:
    """Offline's cost to the target over on-policy's (None unless both reached it)."""
    return reach["offline"] / reach["on_policy"] if all(reach.values()) else None


def mean_prompt_tokens(model: str, train_file: str) -> float:
    """The templated prompt's mean length in tokens, as the rollout encodes it."""
    rows = load_prompts(train_file)
    return sum(prompt_lengths(load_tokenizer(model), rows)) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", choices=("rl", "sft"), default="rl",
                        help="rl: the demo's GRPO'd model teaches its SFT warm start (the "
                             "issue's pairing, examples/distill/); sft: 112 SFT steps teach 55 "
                             "of the same steps (the pairing until 2026-11-26)")
    parser.add_argument("--teacher-rl-steps", type=int, default=40,
                        help="--teacher rl: the teacher's GRPO steps (the demo's 40)")
    parser.add_argument("--student-steps", type=int, default=55,
                        help="--teacher sft: SFT steps of the starting student (both sides "
                             "start from it)")
    parser.add_argument("--offline-lr", type=float,
                        help="default 1e-4 with --teacher rl (the demo's GRPO lr; at 1e-3 both "
                             "sides close the gap in one step), 1e-3 with sft")
    parser.add_argument("--on-policy-lr", type=float, help="default as --offline-lr")
    parser.add_argument("--on-policy-warmup", type=int, default=0,
                        help="on-policy: optimizer.warmup_steps")
    parser.add_argument("--group-size", type=int, default=None,
                        help="on-policy samples per prompt (default: 1 dense, 4 pure)")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="on-policy prompts a step (default: 32 dense, 8 pure; 32 samples "
                             "a step either way, as offline's 32 rows)")
    parser.add_argument("--baseline", choices=("none", "mean"), default="none",
                        help="on-policy: algorithm.distill.baseline")
    parser.add_argument("--on-policy-mode", choices=("pure", "dense"), default="dense",
                        help="on-policy: algorithm.distill.mode (dense: GKD's divergence to the "
                             "teacher's top-k at every position of the student's samples)")
    parser.add_argument("--divergence", choices=("forward_kl", "reverse_kl", "jsd"),
                        default="forward_kl",
                        help="on-policy dense: algorithm.distill.divergence (top-8 like offline)")
    parser.add_argument("--task-coef", type=float, default=0.0,
                        help="on-policy dense: algorithm.distill.task_coef (adds that times the "
                             "policy loss on the math reward's advantage; needs --group-size >= 2)")
    parser.add_argument("--on-policy-epochs", type=int, default=1,
                        help="on-policy: algorithm.epochs (optimizer passes over each step's "
                             "samples and teacher scores)")
    parser.add_argument("--reuse-offline", action="store_true",
                        help="keep the offline run of an earlier call with the same settings "
                             "(its curve is measured again)")
    parser.add_argument("--held-out", type=int, default=256,
                        help="held-out prompts of every greedy evaluation")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of both distillation runs (teacher and student unchanged)")
    parser.add_argument("--fine-steps", type=int, default=20,
                        help="evaluate every step up to this one (then every 5)")
    parser.add_argument("--offline-steps", type=int, default=60)
    parser.add_argument("--on-policy-steps", type=int, default=40)
    args = parser.parse_args()
    lr = 1e-4 if args.teacher == "rl" else 1e-3
    args.offline_lr = args.offline_lr or lr
    args.on_policy_lr = args.on_policy_lr or lr
    dense = args.on_policy_mode == "dense"
    args.group_size = args.group_size or (1 if dense else 4)
    args.prompts_per_step = args.prompts_per_step or (32 if dense else 8)
    torch.set_num_threads(2)
    ROOT.mkdir(parents=True, exist_ok=True)
    tiny = str(make_model(ROOT / "tiny", "tiny", seed=0)) if not (ROOT / "tiny").is_dir() \
        else str(ROOT / "tiny")
    pair = (rl_pairing if args.teacher == "rl" else sft_pairing)(args, tiny)
    teacher, student, held_out = pair["teacher"], pair["student"], pair["held_out"]
    budget = MAX_NEW_TOKENS[args.teacher]
    scores = {"teacher": reward(teacher, held_out, budget),
              "student": reward(student, held_out, budget)}
    target = scores["student"] + 0.6 * (scores["teacher"] - scores["student"])
    console.log(scores, f"target {target:.3f}")

    earlier = (ROOT / "offline.yaml").read_text() if (ROOT / "offline.yaml").is_file() else None
    offline = run_config("offline", {
        "pipeline": "distill", "seed": args.seed, "model": {"path": student},
        "teacher": {"path": teacher},
        "distill": {"top_k": 8}, "steps": args.offline_steps, "batch_size": 32,
        "data": {"train": pair["train"], "response_key": pair["response_key"]},
        "optimizer": {"lr": args.offline_lr}, "checkpoint": checkpoints(args, args.offline_steps)})
    if not (args.reuse_offline and earlier == offline.read_text()
            and (ROOT / "offline" / "summary.json").is_file()):
        train_distill(load_config(offline, expect="distill"))
    on_policy_distill = {"teacher": {"path": teacher}, "mode": args.on_policy_mode} | (
        {"divergence": args.divergence, "top_k": 8, "task_coef": args.task_coef} if dense
        else {"baseline": args.baseline})
    on_policy = run_config("on_policy", {
        "steps": args.on_policy_steps, "seed": args.seed, "model": {"path": student},
        "data": {"train": pair["train"], "eval": held_out},
        "rollout": {"prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                    "max_new_tokens": budget},
        "optimizer": {"lr": args.on_policy_lr, "warmup_steps": args.on_policy_warmup},
        "eval": {"every_steps": 0, "max_prompts": 8},
        "checkpoint": checkpoints(args, args.on_policy_steps),
        "algorithm": {"distill": on_policy_distill, "epochs": args.on_policy_epochs}})
    train(load_config(on_policy))
    prompt = mean_prompt_tokens(student, pair["train"])
    curves = {"offline": curve(ROOT / "offline", held_out, "distill/teacher_tokens", 32 * prompt,
                               budget),
              "on_policy": curve(ROOT / "on_policy", held_out, "distill/teacher_tokens",
                                 args.prompts_per_step * args.group_size * prompt, budget)}
    reach = {mode: tokens_to_reach(points, target) for mode, points in curves.items()}
    positions = {mode: tokens_to_reach(points, target, "teacher_positions")
                 for mode, points in curves.items()}
    print(json.dumps({"settings": vars(args), "teacher_reward": scores["teacher"],
                      "student_reward": scores["student"], "target": target,
                      "teacher_tokens_to_target": reach,
                      "teacher_tokens_ratio": offline_over_on_policy(reach),
                      "teacher_positions_to_target": positions,
                      "teacher_positions_ratio": offline_over_on_policy(positions),
                      "curves": curves}))


if __name__ == "__main__":
    main()

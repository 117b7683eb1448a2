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
- `agentic`: the agentic demo's (`make demo-agentic`), multi-turn guess-the-number (1..8, 3
  guesses). Student: its SFT warm start on a careless expert's episodes (one row per turn, 60%
  of the episodes scan upwards); teacher: the student after the demo's 30 GRPO steps. Offline
  reads the expert's rows (the teacher scores each row's last turn), on-policy the student's
  own episodes (every turn); the held-out score is the greedy success rate on `--held-out`
  episodes. Multi-turn is where the student's own states can differ from the demonstrations'.
Both sides start from the student.
- offline (`reroll distill`): the student learns the teacher's top-8 distribution on the SFT
  data's own responses, `--batch` (32) rows a step;
- on-policy (`algorithm.distill`): the student samples as many responses a step and the
  teacher scores those tokens. `--on-policy-mode dense` (the default; GKD): one response to
  each of 32 prompts, and the loss is `--divergence` between the teacher's top-8 (as
  offline's) and the student's distribution at every position; `--on-policy-mode pure`: 8
  prompts x 4 responses, and the advantage is log pi_T - log pi_S of each sampled token.
Both are evaluated greedily on the same held-out prompts (`--held-out`, 256 by default: a
64-prompt mean moves by 0.016 a prompt, and its curves crossed the target by chance) every
step up to `--fine-steps`, then every 5 (checkpoints, then `reroll eval`'s code). `--seed`
seeds both distillation runs (their data order and the on-policy samples); the teacher and
student stay the same. The target is closing 60% of the teacher-student gap; the headline is
the teacher tokens each needs to reach it. Equal work here means equal teacher tokens, so the
curves are drawn against them.
Last line: JSON with the settings, both curves, the target and `teacher_tokens_ratio` (offline
over on-policy at the target; > 1: on-policy is cheaper in teacher computations), the same in
`teacher_positions` (response tokens plus the templated prompt the teacher also reads, once a
sequence on both sides; not for `agentic`), and `teacher_sequences_to_target` (the teacher's
forward passes, one a sequence, `--batch` a step on both sides). The options (learning rates,
on-policy mode, divergence, warmup, baseline, batch, prompts and samples per prompt, epochs,
steps) are the knobs tried in docs/benchmarks.md.

    .venv/bin/python benchmarks/distillation.py [--on-policy-mode pure] [--on-policy-lr 3e-4] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from rich.console import Console

from reroll.cli import main as reroll_cli
from reroll.config import load_config
from reroll.data.datasets import load_prompts
from reroll.data.tasks import write_arithmetic
from reroll.evaluation import EvalSpec, evaluate
from reroll.models.factory import make_model
from reroll.models.loading import load_tokenizer
from reroll.pipelines.agentic import train_agentic
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


def demo_run(example: str, name: str, model: str, steps: int, overrides: list[str]) -> dict:
    """The summary of the demo's run `example` (under examples/) from `model`, `steps` steps,
    as `make demo` (or `make demo-agentic`) runs it; a finished run of the same steps is
    reused."""
    if summary := finished(name, steps):
        return summary
    config = load_config(EXAMPLES / example, [
        f"model.path={model}", *overrides, f"steps={steps}", f"output_dir={ROOT / name}",
        "overwrite=true", "tracking.progress=false", "tracking.tensorboard=false"])
    run = {"sft": train_sft, "agentic": train_agentic}.get(config.pipeline, train)
    return run(config)


MAX_NEW_TOKENS = {"sft": 24, "rl": 40, "agentic": 4}
"""Response budget (a turn's, for `agentic`) of the evaluations and the on-policy samples: the
single-digit sums of the `sft` pairing fit 24 tokens; the demo's levels 1-4 take its GRPO's
40; a guess, the agentic demo's 4."""

GUESS_NUMBER = {"high": 8}
"""The agentic demo's environment (examples/agentic/demo.yaml: 3 turns)."""


def reward(model: str, held_out: str | int, max_new_tokens: int) -> float:
    """Greedy mean reward on the held-out prompts (a file), or success rate on that many
    guess-the-number episodes (an int)."""
    task = {"env": "guess_number", "episodes": held_out, "env_kwargs": GUESS_NUMBER,
            "max_turns": 3} if isinstance(held_out, int) else {"task": held_out}
    return evaluate(EvalSpec(model=model, max_new_tokens=max_new_tokens, **task))[0]["mean@1"]


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
    on_data = [f"data.train={data['train']}", f"data.eval={data['eval']}"]
    # sft.yaml's 8 epochs of the 4,000 rows, 32 a step
    student = demo_run("arithmetic/sft.yaml", "demo_sft", tiny, 1000, on_data)["final_model"]
    teacher = demo_run("arithmetic/grpo.yaml", "demo_grpo", student, args.teacher_rl_steps,
                       on_data)
    return {"teacher": teacher["final_checkpoint"], "student": student, "train": data["train"],
            "response_key": "response",
            "held_out": str(write_arithmetic(ROOT / "demo_held_out", train_size=1,
                                             eval_size=args.held_out, seed=7)["eval"])}


def agentic_pairing(args: argparse.Namespace, tiny: str) -> dict:
    """The agentic demo's pair (`make demo-agentic`, built by its commands): the student is its
    SFT warm start on a careless expert's episodes, the teacher that model after its GRPO."""
    episodes, model = ROOT / "guess_number" / "sft.jsonl", ROOT / "guess_number_model"
    if not episodes.is_file():
        reroll_cli(["make-episodes", "--env", "guess_number", "--out", str(episodes),
                    "--episodes", "600", "--kwargs", json.dumps(
                        {"high": 8, "max_turns": 3, "noise": 0.6, "careless": "scan",
                         "noise_scope": "episode"})])
    if not (model / "config.json").is_file():
        reroll_cli(["make-model", "--out", str(model), "--preset", "tiny", "--corpus",
                    str(episodes)])
    # its 3 epochs of the 1,548 rows (a turn each), 32 a step
    student = demo_run("agentic/guess_number_sft.yaml", "guess_sft", str(model), 146,
                       [f"data.train={episodes}"])["final_model"]
    teacher = demo_run("agentic/demo.yaml", "guess_grpo", student, 30, [])
    return {"teacher": teacher["final_checkpoint"], "student": student, "train": str(episodes),
            "response_key": None, "held_out": args.held_out}


def teacher_samples(pair: dict, rows: int, budget: int, seed: int) -> str:
    """One sample of the teacher (temperature 1, `budget` tokens) for each of the first `rows`
    training prompts whose sample is not empty (an SFT row needs a target; a few in a thousand
    are the end of turn alone), as rows of prompt, answer and response: offline's data for
    `--offline-data teacher` (made once per rows, budget and seed)."""
    out = ROOT / f"teacher_samples_{rows}_{budget}_{seed}.jsonl"
    if not out.is_file():
        _, samples = evaluate(EvalSpec(model=pair["teacher"], task=pair["train"], n=1,
                                       temperature=1.0, max_new_tokens=budget,
                                       max_prompts=rows + rows // 16, seed=seed))
        kept = [s for s in samples if s["response"]][:rows]
        out.write_text("".join(json.dumps({k: s[k] for k in ("prompt", "answer", "response")})
                               + "\n" for s in kept))
    return str(out)


def on_policy_run(args: argparse.Namespace, pair: dict, distill: dict, budget: int) -> dict:
    """The on-policy run's config: the pair's RL run from the student with `distill` as its
    objective (agentic: the demo's config, its environment and turns)."""
    common = {"steps": args.on_policy_steps, "seed": args.seed,
              "model": {"path": pair["student"]},
              "optimizer": {"lr": args.on_policy_lr, "warmup_steps": args.on_policy_warmup},
              "checkpoint": checkpoints(args, args.on_policy_steps),
              "rollout": {"prompts_per_step": args.prompts_per_step,
                          "group_size": args.group_size, "max_new_tokens": budget}}
    if args.teacher != "agentic":
        return common | {"data": {"train": pair["train"], "eval": pair["held_out"]},
                         "eval": {"every_steps": 0, "max_prompts": 8},
                         "algorithm": {"distill": distill, "epochs": args.on_policy_epochs}}
    demo = yaml.safe_load((EXAMPLES / "agentic" / "demo.yaml").read_text())
    demo.pop("name")
    return demo | common | {
        "rollout": demo["rollout"] | common["rollout"],
        "train": demo["train"] | {"micro_batch_size": args.prompts_per_step * args.group_size},
        "eval": {"every_steps": 0}, "tracking": demo["tracking"] | BASE["tracking"],
        "algorithm": demo["algorithm"] | {"distill": distill, "epochs": args.on_policy_epochs}}


def curve(run: Path, held_out: str | int, key: str, sequences: int, prompt_cost: float | None,
          max_new_tokens: int) -> list[dict]:
    """(teacher tokens, held-out reward) at each checkpoint of `run`. `teacher_sequences`: the
    teacher's forward passes, one a sequence, `sequences` a step (32 rows offline, prompts x
    samples on-policy). `teacher_positions` adds the prompt positions the teacher also reads
    (`prompt_cost` a step: each sequence's templated prompt; None for the agentic pair, whose
    rows and episodes carry their earlier turns)."""
    tokens = {r["step"]: r[key] for r in read_metrics(run) if key in r}
    points = []
    for checkpoint in sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name[5:])):
        step = int(checkpoint.name[5:])
        points.append({"step": step, "teacher_tokens": tokens[step],
                       "teacher_sequences": step * sequences}
                      | ({"teacher_positions": round(tokens[step] + step * prompt_cost)}
                         if prompt_cost is not None else {})
                      | {"reward": reward(str(checkpoint), held_out, max_new_tokens)})
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
    parser.add_argument("--teacher", choices=("rl", "sft", "agentic"), default="rl",
                        help="rl: the demo's GRPO'd model teaches its SFT warm start (the "
                             "issue's pairing, examples/distill/); sft: 112 SFT steps teach 55 "
                             "of the same steps (the pairing until 2026-11-26); agentic: the "
                             "agentic demo's pair, guess-the-number")
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
    parser.add_argument("--batch", type=int, default=32,
                        help="sequences a step on both sides: offline's rows, on-policy's "
                             "prompts x samples")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="on-policy prompts a step (default: --batch / --group-size, as "
                             "many samples a step as offline's rows)")
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
    parser.add_argument("--offline-data", choices=("demonstrations", "teacher"),
                        default="demonstrations",
                        help="offline's rows: the pair's SFT data (demonstrations), or the "
                             "teacher's own samples of its prompts (not with --teacher agentic)")
    parser.add_argument("--reuse-offline", action="store_true",
                        help="keep the offline run of an earlier call with the same settings "
                             "(its curve is measured again)")
    parser.add_argument("--held-out", type=int, default=256,
                        help="held-out prompts (agentic: episodes) of every greedy evaluation")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of both distillation runs (teacher and student unchanged)")
    parser.add_argument("--fine-steps", type=int, default=20,
                        help="evaluate every step up to this one (then every 5)")
    parser.add_argument("--offline-steps", type=int, default=60)
    parser.add_argument("--on-policy-steps", type=int, default=40)
    args = parser.parse_args()
    if args.offline_data == "teacher" and args.teacher == "agentic":
        parser.error("--offline-data teacher: not with --teacher agentic (its rows are turns of "
                     "the expert's episodes)")
    lr = {"rl": 1e-4, "sft": 1e-3, "agentic": 2e-4}[args.teacher]
    args.offline_lr = args.offline_lr or lr
    args.on_policy_lr = args.on_policy_lr or lr
    dense = args.on_policy_mode == "dense"
    args.group_size = args.group_size or (1 if dense else 4)
    args.prompts_per_step = args.prompts_per_step or max(1, args.batch // args.group_size)
    torch.set_num_threads(2)
    ROOT.mkdir(parents=True, exist_ok=True)
    tiny = str(make_model(ROOT / "tiny", "tiny", seed=0)) if not (ROOT / "tiny").is_dir() \
        else str(ROOT / "tiny")
    pair = {"rl": rl_pairing, "sft": sft_pairing, "agentic": agentic_pairing}[args.teacher](
        args, tiny)
    teacher, student, held_out = pair["teacher"], pair["student"], pair["held_out"]
    budget = MAX_NEW_TOKENS[args.teacher]
    scores = {"teacher": reward(teacher, held_out, budget),
              "student": reward(student, held_out, budget)}
    target = scores["student"] + 0.6 * (scores["teacher"] - scores["student"])
    console.log(scores, f"target {target:.3f}")

    offline_rows = {"train": pair["train"]} | (
        {"response_key": pair["response_key"]} if pair["response_key"] else {})
    if args.offline_data == "teacher":
        offline_rows = {"train": teacher_samples(pair, args.offline_steps * args.batch, budget,
                                                 args.seed), "response_key": "response"}
    earlier = (ROOT / "offline.yaml").read_text() if (ROOT / "offline.yaml").is_file() else None
    offline = run_config("offline", {
        "pipeline": "distill", "seed": args.seed, "model": {"path": student},
        "teacher": {"path": teacher},
        "distill": {"top_k": 8}, "steps": args.offline_steps, "batch_size": args.batch,
        "data": offline_rows,
        "optimizer": {"lr": args.offline_lr}, "checkpoint": checkpoints(args, args.offline_steps)})
    if not (args.reuse_offline and earlier == offline.read_text()
            and (ROOT / "offline" / "summary.json").is_file()):
        train_distill(load_config(offline, expect="distill"))
    on_policy_distill = {"teacher": {"path": teacher}, "mode": args.on_policy_mode} | (
        {"divergence": args.divergence, "top_k": 8, "task_coef": args.task_coef} if dense
        else {"baseline": args.baseline})
    on_policy = load_config(run_config("on_policy", on_policy_run(args, pair, on_policy_distill,
                                                                  budget)))
    (train_agentic if on_policy.pipeline == "agentic" else train)(on_policy)
    prompt = None if args.teacher == "agentic" else mean_prompt_tokens(student, pair["train"])
    sequences = {"offline": args.batch, "on_policy": args.prompts_per_step * args.group_size}
    curves = {mode: curve(ROOT / mode, held_out, "distill/teacher_tokens", sequences[mode],
                          None if prompt is None else sequences[mode] * prompt, budget)
              for mode in ("offline", "on_policy")}
    reach = {mode: tokens_to_reach(points, target) for mode, points in curves.items()}
    positions = {mode: tokens_to_reach(points, target, "teacher_positions")
                 if prompt is not None else None for mode, points in curves.items()}
    generated = {"offline_generation_tokens": reach["offline"]} \
        if args.offline_data == "teacher" else {}
    print(json.dumps({"settings": vars(args), "teacher_reward": scores["teacher"],
                      "student_reward": scores["student"], "target": target,
                      "teacher_tokens_to_target": reach,
                      "teacher_tokens_ratio": offline_over_on_policy(reach), **generated,
                      "teacher_positions_to_target": positions,
                      "teacher_positions_ratio": offline_over_on_policy(positions),
                      "teacher_sequences_to_target": {
                          mode: tokens_to_reach(points, target, "teacher_sequences")
                          for mode, points in curves.items()},
                      "curves": curves}))


if __name__ == "__main__":
    main()

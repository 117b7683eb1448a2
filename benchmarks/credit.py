"""Multi-turn credit assignment (issue 46 item 6): `grpo`, `gigpo` and `ipa_chunk` on sokoban
from one shared SFT warm start, over several seeds (tiny model, CPU).

Sokoban on a 5x5 grid (3x3 floor, shortest solution at most 6 moves, 8 moves allowed), reward 1
when the box reaches the target. The warm start is one SFT on the BFS expert's episodes (a
tokenizer trained on their text; 800 episodes, 3 epochs): on the tiny model it solves about a
quarter of the held-out levels greedily, so RL starts from a policy that already succeeds and
has room. Then each method trains from that same model with the same seeds, steps, batch (env
seeds x episodes), learning rate, reply budget, `loss_agg: token_mean` and held-out set: equal
work across arms; only `algorithm.advantage` (and `ipa_chunk`'s own policy loss, which it
needs) differ. Held-out success is greedy, over `--eval-episodes` env seeds the training never
draws (the layouts are not new: this level distribution has only 112), evaluated every
`--eval-every` steps. Runs go seed by seed (every method on a seed before the next seed) and
the figures are rewritten after each run, so a run stopped early still compares like with like.
A rerun into the same --out reuses the warm start and every run already finished with the same
settings (so `--seeds` can grow).

    .venv/bin/python benchmarks/credit.py [--steps N] [--seeds S] [--groups G] [--group-size K]
        [--lr LR] [--sft-episodes E] [--sft-epochs X] [--out DIR] [--warm-only]

Writes DIR/credit.json (curves: held-out success by step, per method and seed, and the mean;
training success and truncated-reply share by step) and DIR/credit.png (mean curves, seeds
faint). Last line: JSON with each method's per-seed held-out success before and after, its
mean, and the mean curves. `--warm-only` builds (or reuses) the warm start, prints its greedy
and sampled held-out success and stops.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

METHODS = {
    "grpo": {"advantage": {"name": "grpo"}, "policy_loss": {"name": "ppo"}},
    "gigpo": {"advantage": {"name": "gigpo", "gamma": 0.95}, "policy_loss": {"name": "ppo"}},
    "ipa_chunk": {"advantage": {"name": "ipa_chunk", "gamma": 0.95},
                  "policy_loss": {"name": "ipa_chunk"}},
}
ENV_KWARGS = {"size": 5, "max_solution": 6}
MAX_TURNS = 8
TRACKING = {"tensorboard": False, "progress": False, "record_rollouts": 0}


def warm_start(args: argparse.Namespace, out: Path) -> str:
    """The shared SFT model: expert episodes, a tokenizer trained on them, a short SFT."""
    from reroll.api import sft
    from reroll.envs.episodes import expert_rows, write_expert_rows
    from reroll.models.factory import make_model

    final = out / "sft" / "final"
    if (final / "config.json").is_file():  # a rerun into the same --out reuses its warm start
        return str(final)
    data = write_expert_rows(out / "sft.jsonl", expert_rows(
        "sokoban", args.sft_episodes, seed=10_000, kwargs={**ENV_KWARGS, "max_turns": MAX_TURNS},
        max_turns=MAX_TURNS))
    model = make_model(out / "model", "tiny", corpus=data.read_text().splitlines())
    summary = sft({
        "pipeline": "sft", "name": "credit-sft", "output_dir": str(out / "sft"),
        "overwrite": True, "seed": 0, "model": {"path": str(model)},
        "data": {"train": str(data)}, "epochs": args.sft_epochs, "batch_size": 32,
        "optimizer": {"lr": 3e-3, "warmup_steps": 5, "schedule": "cosine"},
        "train": {"micro_batch_size": 32, "num_threads": 1},
        "checkpoint": {"every_steps": 0}, "tracking": TRACKING})
    return str(summary.final_checkpoint)


def warm_eval(model: str, args: argparse.Namespace) -> dict:
    """The warm start alone on the held-out levels (training's eval seeds): greedy success, and
    the success of `--warm-samples` sampled episodes a level at temperature 1 (RL's signal)."""
    from reroll.evaluation import EvalSpec, evaluate

    common = {"model": model, "env": "sokoban", "episodes": args.eval_episodes,
              "env_kwargs": ENV_KWARGS, "max_turns": MAX_TURNS, "max_new_tokens": args.max_new_tokens,
              "max_prompt_tokens": 512, "threads": 1}
    greedy, _ = evaluate(EvalSpec(**common))
    sampled, _ = evaluate(EvalSpec(**common, n=args.warm_samples, temperature=1.0))
    return {"greedy_success": greedy["success_rate"], "sampled_success": sampled["success_rate"],
            "greedy_truncated_frac": greedy["truncated_frac"]}


def train(model: str, method: str, seed: int, args: argparse.Namespace,
          out: Path) -> tuple[dict, dict]:
    """One RL run: its held-out success by step (step 0: the warm start), and by step its
    training success and share of replies cut at `max_new_tokens` (the stop-token collapse)."""
    from reroll.api import train as run
    from reroll.tracking import read_metrics

    config = {
        "pipeline": "agentic", "name": f"credit-{method}-{seed}",
        "output_dir": str(out / f"{method}-{seed}"), "overwrite": True, "seed": seed,
        "steps": args.steps, "model": {"path": model},
        "env": {"id": "sokoban", "kwargs": ENV_KWARGS, "max_turns": MAX_TURNS,
                "max_context_tokens": 512, "eval_episodes": args.eval_episodes},
        "rollout": {"prompts_per_step": args.groups, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        # token_mean in every arm: ipa_chunk's loss normalises per chunk and requires it
        "algorithm": {**METHODS[method], "loss_agg": "token_mean"},
        "optimizer": {"lr": args.lr},
        "train": {"micro_batch_size": args.groups * args.group_size, "num_threads": 1},
        "eval": {"every_steps": args.eval_every}, "checkpoint": {"every_steps": 0},
        "tracking": TRACKING}
    run_dir = Path(config["output_dir"])
    done = finished(run_dir, config)
    if done is None:
        done = run(config).summary
    # reward 1 exactly when solved: the start's reward mean is its success rate
    curve = {0: done["eval_reward_start"]}
    training: dict[int, dict[str, float]] = {}
    for row in read_metrics(run_dir):
        if "eval/success_rate" in row:
            curve[int(row["step"])] = row["eval/success_rate"]
        if "train/success_rate" in row:
            training[int(row["step"])] = {"success": round(row["train/success_rate"], 4),
                                          "truncated": round(row["env/truncated_replies_frac"], 4)}
    return curve, training


def finished(run_dir: Path, config: dict) -> dict | None:
    """The summary of a run already finished in `run_dir` with every setting of `config` (a
    rerun into the same --out with more seeds trains only the new ones), else None."""
    import yaml

    if not (run_dir / "summary.json").is_file() or not (run_dir / "config.yaml").is_file():
        return None
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())

    def within(want, have) -> bool:
        if isinstance(want, dict):
            return isinstance(have, dict) and all(within(v, have.get(k)) for k, v in want.items())
        return want == have

    return json.loads((run_dir / "summary.json").read_text()) if within(config, stored) else None


def summarize(curves: dict[str, dict[int, dict[int, float]]]) -> dict:
    """Per method: each seed's held-out success before (step 0) and after (last step), their
    means, and the mean curve over seeds (steps every seed evaluated)."""
    result = {}
    for method, by_seed in curves.items():
        steps = sorted(set.intersection(*(set(c) for c in by_seed.values())))
        mean_curve = {s: round(sum(c[s] for c in by_seed.values()) / len(by_seed), 4)
                      for s in steps}
        before = {seed: c[min(c)] for seed, c in by_seed.items()}
        after = {seed: c[max(c)] for seed, c in by_seed.items()}
        result[method] = {"before": before, "after": after,
                          "mean_before": round(sum(before.values()) / len(before), 4),
                          "mean_after": round(sum(after.values()) / len(after), 4),
                          "mean_curve": mean_curve}
    return result


def plot(curves: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (method, by_seed) in enumerate(curves.items()):
        color = f"C{k}"
        for c in by_seed.values():
            ax.plot(sorted(c), [c[s] for s in sorted(c)], color=color, alpha=0.25, lw=1)
        mean = summary[method]["mean_curve"]
        ax.plot(list(mean), list(mean.values()), color=color, lw=2.2, marker="o", label=method)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out success (greedy)")
    ax.set_title(f"sokoban 5x5, {len(next(iter(curves.values())))} seeds (faint: each seed)")
    top = max(v for by_seed in curves.values() for c in by_seed.values() for v in c.values())
    ax.set_ylim(0, min(1.0, top + 0.1))  # room to tell the curves apart
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=9)
    parser.add_argument("--groups", type=int, default=4, help="env seeds (levels) a step")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per level")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=2,
                        help="reply budget a turn (a move is one token, then the stop token)")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--sft-episodes", type=int, default=800)
    parser.add_argument("--sft-epochs", type=float, default=3.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--warm-only", action="store_true",
                        help="build (or reuse) the warm start, evaluate it alone and stop")
    parser.add_argument("--warm-samples", type=int, default=4,
                        help="--warm-only: sampled episodes a held-out level")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_credit_"))
    out.mkdir(parents=True, exist_ok=True)
    model = warm_start(args, out)
    if args.warm_only:
        print(json.dumps({"warm_start": model, **warm_eval(model, args)}))
        return
    curves: dict[str, dict[int, dict[int, float]]] = {}
    training: dict[str, dict[int, dict]] = {}
    # seed by seed, every method on a seed before the next seed, the figures written after each
    # run: a run stopped early still compares the methods on the same seeds
    for seed in range(args.seeds):
        for method in args.methods.split(","):
            curve, training.setdefault(method, {})[seed] = train(model, method, seed, args, out)
            curves.setdefault(method, {})[seed] = curve
            print(f"{method} seed {seed}: {curve}", file=sys.stderr)
            summary = summarize(curves)
            (out / "credit.json").write_text(json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "curves": curves,
                 "training": training, "summary": summary}, indent=1))
            plot(curves, summary, out / "credit.png")
    print(f"wrote {out / 'credit.json'} and {out / 'credit.png'}", file=sys.stderr)
    print(json.dumps({m: {k: s[k] for k in ("before", "after", "mean_before", "mean_after",
                                             "mean_curve")} for m, s in summary.items()}))


if __name__ == "__main__":
    main()

"""`reroll eval` on the command line: its flags, and the table and files of the results."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.evaluation import BUILTIN_TASKS, EvalSpec, evaluate
from reroll.evaluation_settings import default_threads, spec_from_args


def configure_eval(p: argparse.ArgumentParser) -> None:
    """`reroll eval`'s arguments."""
    p.description = (f"{p.description}. Writes JSON, shows a table. A model inside a run "
                     "directory (runs/X/checkpoints/step_N, runs/X/final) is evaluated on the "
                     "run's task with its settings (eval set or environment, reward, turns, "
                     "token limits, system prompt, eval temperature) unless a flag says "
                     "otherwise; the settings taken are printed. A multi-domain run's model is "
                     "evaluated on each domain's held-out set with its own reward "
                     "(eval/<domain>/reward_mean and pass_rate, as in training).")
    p.add_argument("--model", required=True, help="model folder (Hugging Face format) or checkpoint")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--task", help="prompts: a .jsonl/.parquet file with prompt and answer, or "
                                      f"a built-in task ({', '.join(BUILTIN_TASKS)}); default: "
                                      "the run's data.eval")
    where.add_argument("--env", help="environment ids, comma-separated (a suite), played as "
                                     "multi-turn episodes; `reroll envs` lists them; default: "
                                     "the run's env.id")
    p.add_argument("--ignore-run-config", action="store_true",
                   help="use the built-in defaults below, not the settings of the model's run")
    p.add_argument("--episodes", type=int, help="env seeds per environment (default 32, or the "
                                                "run's env.eval_episodes)")
    p.add_argument("--env-kwargs", help="JSON keyword arguments of the environments (default {}, "
                                        "or the run's env.kwargs)")
    p.add_argument("--max-turns", type=int, help="turn cap per episode (default 8, or the run's "
                                                 "env.max_turns)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--k", default="", help="extra k values for pass@k, e.g. 2,4 (1 and n always)")
    p.add_argument("--reward", choices=["math", "code", "custom"],
                   help="default math, or the run's reward.type")
    p.add_argument("--reward-function", help="for --reward custom: package.module:function")
    p.add_argument("--engine", default="hf", help="inference engine (default hf)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature (default: the run's eval.temperature; else 0, "
                        "greedy, for --n 1 and 1.0 for more)")
    p.add_argument("--top-p", type=float, help="default 1.0, or the run's rollout.top_p")
    p.add_argument("--max-new-tokens", type=int,
                   help="default 256, or the run's rollout.max_new_tokens (per turn for envs)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="longest prompt (for envs: the whole episode's context); default 1024, "
                        "or the run's data.max_prompt_tokens / env.max_context_tokens")
    p.add_argument("--max-prompts", type=int, help="evaluate the first N prompts only (of each "
                                                   "domain; default: a multi-domain run's "
                                                   "eval.max_prompts)")
    p.add_argument("--domain", help="a multi-domain run's model: evaluate only these domains "
                                    "(comma-separated names; default: every domain with a "
                                    "held-out set)")
    p.add_argument("--system-prompt", help="default none, or the run's system prompt")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="a sample is correct when its reward is at least this (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256, help="most sequences decoded together")
    p.add_argument("--threads", type=int, help="torch threads (default: every core, or the cores "
                                               "left idle when the machine is already busy)")
    p.add_argument("--out", help="results JSON (default runs/eval/<model>-<task>.json); the "
                                 "samples go next to it as .samples.jsonl")
    p.set_defaults(fn=cmd_eval)


def check_out(out: Path) -> None:
    """The results file can be written: checked before the evaluation, which would otherwise
    run to the end and be lost."""
    import tempfile

    if out.is_dir():
        raise ConfigError(f"--out {out}: is a directory (give a .json file name)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(f"--out {out}: its folder {out.parent} cannot be created or written "
                          f"({e.strerror or e})") from None


def _shown(spec: EvalSpec, key: str) -> Any:
    """A setting as printed: the domains by name."""
    value = getattr(spec, key)
    return [d.name for d in value] if key == "domains" else value


def cmd_eval(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from reroll.tracking.jsonsafe import dumps

    spec = spec_from_args(args)
    if spec.taken:
        Console(stderr=True).print(
            f"settings from {spec.run_config} (a flag overrides each; --ignore-run-config drops "
            f"them): " + ", ".join(f"{k}={_shown(spec, k)!r} ({key})"
                                   for k, key in spec.taken.items()), highlight=False)
    threads_line = default_threads(args.threads)[1]
    if threads_line:
        Console(stderr=True).print(threads_line, highlight=False)
    what = spec.task or spec.env or "domains"
    out = Path(args.out) if args.out else Path("runs") / "eval" / (
        f"{Path(spec.model).name or 'model'}-{Path(what).stem}.json")
    check_out(out)
    results, samples = evaluate(spec)
    out.write_text(dumps(results, indent=2) + "\n")
    samples_path = out.with_suffix(".samples.jsonl")
    samples_path.write_text("".join(dumps(s) + "\n" for s in samples))
    if spec.domains:
        what = "domains " + ", ".join(d.name for d in spec.domains)
    table = Table(title=f"{spec.model} on {what} ({results['prompts']} "
                        f"{'episodes' if spec.env else 'prompts'}, n={spec.n})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results.items():
        if key.startswith(("pass@", "mean@", "env/", "eval/")) or key in (
                "truncated_frac", "response_len_mean", "tokens_per_s", "seconds"):
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    console.print(f"results: {out}  samples: {samples_path}")
    print(dumps(results | {"out": str(out)}))

"""`envs`, `make-episodes` and `make-terminal-tasks`: the environments, their experts' episodes
and a generated suite of terminal tasks."""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from reroll.commands.common import console, json_arg
from reroll.config.errors import ConfigError
from reroll.envs.describe import env_report, kwarg_docs
from reroll.envs.episodes import expert_rows, write_expert_rows
from reroll.envs.gem_adapter import gem_env_ids
from reroll.envs.registry import env_specs
from reroll.envs.task_folder import load_suite
from reroll.envs.terminal_gen import write_suite
from reroll.envs.terminal_tasks import check
from reroll.sandbox import Sandbox


def cmd_envs(args: argparse.Namespace) -> None:
    if args.describe:
        show_env(args.describe, json_arg("--kwargs", args.kwargs))
        return
    table = Table(title="environments (env.id)")
    for column in ("id", "description", "env.kwargs (default: doc)"):
        table.add_column(column)
    for spec in env_specs().values():
        table.add_row(spec.id, spec.description, "\n".join(
            f"{k.name}={k.default}: {k.doc}" for k in kwarg_docs(spec.factory)))
    gem_ids = gem_env_ids()
    table.add_row("gem:<id>", f"any gem-llm environment ({len(gem_ids)} installed"
                  + (f", e.g. gem:{gem_ids[0]})" if gem_ids else "; pip install gem-llm)"), "")
    table.add_row("module:Class", "your own: a class or factory importable from the working "
                  "directory or an installed package, or path/to/file.py:Class "
                  "(docs/agentic.md, `Write your own environment`)",
                  "its own; `reroll envs --describe module:Class` lists them")
    Console(emoji=False).print(table)
    if args.gem:
        for env_id in gem_ids:
            print(f"gem:{env_id}")


def show_env(env_id: str, kwargs: dict) -> None:
    """`reroll envs --describe ID`: where it lives, what it takes, and a real build and reset."""
    report = env_report(env_id, kwargs)
    out = Console(emoji=False)  # `my_envs:RepeatCode[/]:` would read as an emoji code
    out.print(f"[bold]{env_id}[/]: {report['description']}", highlight=False, soft_wrap=True)
    out.print(f"factory: {report['factory']}", highlight=False, soft_wrap=True)
    table = Table(title="env.kwargs")
    for column in ("name", "type", "default", "doc"):
        table.add_column(column)
    for k in report["kwargs"]:
        table.add_row(k.name, k.type, k.default, k.doc)
    out.print(table)
    extras = [f"async {', '.join(report['async'])}" if report["async"] else "sync (runs in a "
              "thread)", "scripted expert (make-episodes)" if report["expert"] else "no expert"]
    out.print(f"check: built {report['class']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
              f", reset({report['seed']}) ok; {'; '.join(extras)}", highlight=False, soft_wrap=True)
    out.print(f"first observation:\n{report['observation']}", highlight=False, markup=False,
              soft_wrap=True)


def cmd_make_episodes(args: argparse.Namespace) -> None:
    kwargs = json_arg("--kwargs", args.kwargs)
    rows = expert_rows(args.env, args.episodes, args.seed, kwargs, args.system_prompt)
    path = write_expert_rows(args.out, rows)
    console.print(f"wrote {len(rows)} expert rows of {args.episodes} episodes to {path}")


def cmd_make_terminal_tasks(args: argparse.Namespace) -> None:
    splits = [Path(args.out) / split for split in ("train", "heldout")]
    if any(p.exists() and any(p.iterdir()) for p in splits) and not args.overwrite:
        raise ConfigError(f"--out {args.out}: holds a suite already; pass --overwrite to replace "
                          "it")
    for path in splits:
        if path.exists():
            shutil.rmtree(path)
    counts = write_suite(args.out, args.train, args.heldout, args.seed)
    console.print(f"wrote {args.train} train and {args.heldout} held-out tasks to {args.out} "
                  f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    if args.check:
        tasks = load_suite(Path(args.out) / "train") + load_suite(Path(args.out) / "heldout")

        async def check_all():
            sandbox = Sandbox()
            return await asyncio.gather(*(check(task, sandbox) for task in tasks))

        broken = [why for why in asyncio.run(check_all()) if why]
        if broken:
            raise ConfigError(f"{len(broken)} of {len(tasks)} tasks are broken: " + "; ".join(
                broken[:3]))
        console.print(f"checked {len(tasks)} tasks in the sandbox: each fails before its "
                      "solution and passes after it")


def configure_make_terminal_tasks(p: argparse.ArgumentParser) -> None:
    """`reroll make-terminal-tasks`'s arguments."""
    p.add_argument("--out", required=True, help="suite folder (gets train/ and heldout/)")
    p.add_argument("--train", type=int, default=64, help="train tasks")
    p.add_argument("--heldout", type=int, default=24, help="held-out tasks")
    p.add_argument("--seed", type=int, default=0, help="first generator seed of the train tasks")
    p.add_argument("--check", action="store_true",
                   help="run every task in the sandbox: its tests must fail after its set-up "
                        "and pass after its solution")
    p.add_argument("--overwrite", action="store_true", help="replace a suite --out holds")
    p.set_defaults(fn=cmd_make_terminal_tasks)


def configure_envs(p: argparse.ArgumentParser) -> None:
    """`reroll envs`'s arguments."""
    p.add_argument("--gem", action="store_true", help="also print every installed gem-llm id")
    p.add_argument("--describe", metavar="ID", help="one environment (built-in, or your own "
                   "module:Class): its kwargs and docs, built and reset for a check")
    p.add_argument("--kwargs", default="{}", help="with --describe: env kwargs as JSON")
    p.set_defaults(fn=cmd_envs)


def configure_make_episodes(p: argparse.ArgumentParser) -> None:
    """`reroll make-episodes`'s arguments."""
    p.add_argument("--env", required=True,
                   help="environment id (see `reroll envs`), or your own module:Class")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--episodes", type=int, default=500)
    p.add_argument("--seed", type=int, default=0, help="env seeds are seed, seed+1, ...")
    p.add_argument("--kwargs", default="{}", help='env arguments as JSON, e.g. \'{"noise": 0.5}\'')
    p.add_argument("--system-prompt", default=None)
    p.set_defaults(fn=cmd_make_episodes)

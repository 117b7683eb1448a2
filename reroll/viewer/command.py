"""The `reroll view` subcommand: `reroll view RUN_DIR [RUN_DIR ...] [--out FILE]`.

`reroll/cli.py` registers it with `add_view_parser(sub)`; `cmd_view` writes the report and prints
the run's headline figures. A bad run directory raises ConfigError (exit code 2 in the CLI).
"""

from __future__ import annotations

import argparse

from reroll.config.errors import ConfigError


def add_view_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `view` on the CLI's subparsers."""
    text = ("write a self-contained HTML report of a run directory (curves, rollouts, config); "
            "given several, one report with their curves overlaid")
    p = subparsers.add_parser("view", help=text, description=text)
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="a run directory written by `reroll train` or `reroll sft`; several to compare")
    p.add_argument("--out", metavar="FILE", help="where to write the report (default: "
                   "RUN_DIR/report.html; for several runs, compare.html beside the first)")
    p.add_argument("--max-rollouts-per-step", type=int, default=500, metavar="N",
                   help="embed at most N recorded trajectories of each step (default: 500)")
    p.set_defaults(fn=cmd_view)
    return p


def cmd_view(args: argparse.Namespace) -> None:
    from reroll.viewer.report import write_report
    from reroll.viewer.summary import print_summary

    limit = getattr(args, "max_rollouts_per_step", 500)
    if limit < 1:
        raise ConfigError(f"--max-rollouts-per-step {limit}: must be at least 1")
    run_dirs = args.run_dir if isinstance(args.run_dir, list) else [args.run_dir]
    if len(run_dirs) > 1:
        from reroll.viewer.compare import write_comparison

        runs, path = write_comparison(run_dirs, getattr(args, "out", None), limit)
        for run in runs:
            print_summary(run, path)
        return
    run, path = write_report(run_dirs[0], getattr(args, "out", None), limit)
    print_summary(run, path)

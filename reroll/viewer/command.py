"""The `reroll view` subcommand: `reroll view RUN_DIR [RUN_DIR ...] [--out FILE]`.

`--watch N` rewrites the report every N seconds while the run goes.
`reroll/cli.py` names `configure_view` in its table of commands; `cmd_view` writes the report and prints
the run's headline figures. A bad run directory raises ConfigError (exit code 2 in the CLI).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from reroll.config.errors import ConfigError


def configure_view(p: argparse.ArgumentParser) -> None:
    """`reroll view`'s arguments."""
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="a run directory written by `reroll train` or `reroll sft`; several to compare")
    p.add_argument("--out", metavar="FILE", help="where to write the report (default: "
                   "RUN_DIR/report.html; for several runs, compare.html beside the first)")
    p.add_argument("--max-rollouts-per-step", type=int, default=500, metavar="N",
                   help="embed at most N recorded trajectories of each step (default: 500)")
    p.add_argument("--watch", type=float, metavar="N",
                   help="rewrite the report every N seconds until the run finishes (its "
                        "summary.json appears), the page reloading itself as often; Ctrl-C "
                        "stops. For a live view of every metric, `tensorboard --logdir RUN_DIR` "
                        "with `tracking.tensorboard: true` (docs/viewer.md)")
    p.set_defaults(fn=cmd_view)


def cmd_view(args: argparse.Namespace) -> None:
    from reroll.viewer.report import write_report
    from reroll.viewer.summary import print_summary

    limit = getattr(args, "max_rollouts_per_step", 500)
    if limit < 1:
        raise ConfigError(f"--max-rollouts-per-step {limit}: must be at least 1")
    run_dirs = args.run_dir if isinstance(args.run_dir, list) else [args.run_dir]
    every = getattr(args, "watch", None)
    if every is not None and (every <= 0 or len(run_dirs) > 1):
        raise ConfigError(f"--watch {every}: give one run directory and a number of seconds "
                          f"above 0")
    if len(run_dirs) > 1:
        from reroll.viewer.compare import write_comparison

        runs, path = write_comparison(run_dirs, getattr(args, "out", None), limit)
        for run in runs:
            print_summary(run, path)
        return
    if every is not None:
        run, path = watch(run_dirs[0], getattr(args, "out", None), limit, every)
    else:
        run, path = write_report(run_dirs[0], getattr(args, "out", None), limit)
    print_summary(run, path)


def watch(run_dir: str, out: str | None, limit: int, every: float):
    """Rewrite the report every `every` seconds while the run goes; once its summary.json is
    written, once more (a page that no longer reloads itself) and return."""
    from reroll.viewer.report import write_report

    try:
        while True:
            metrics = Path(run_dir) / "metrics.jsonl"
            # a run starting has no metrics file yet, or an empty one (created before its row)
            if Path(run_dir).is_dir() and (not metrics.exists() or not metrics.read_text().strip()):
                print(f"{run_dir}: no steps in metrics.jsonl yet (the run is starting); waiting",
                      flush=True)
                time.sleep(every)
                continue
            finished = (Path(run_dir) / "summary.json").is_file()
            run, path = write_report(run_dir, out, limit, None if finished else every)
            if finished:
                return run, path
            steps = run.metrics[-1]["step"] if run.metrics else 0
            print(f"{time.strftime('%H:%M:%S')} {path}: {steps} steps so far; rewritten every "
                  f"{every:g} s until the run finishes (Ctrl-C stops)", flush=True)
            time.sleep(every)
    except KeyboardInterrupt:
        print("stopped watching; the report shows the run as it was last read")
        return write_report(run_dir, out, limit)

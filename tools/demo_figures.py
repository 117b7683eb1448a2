"""README's demo figures come from the files `make demo` writes, never typed by hand.

    python tools/demo_figures.py --started EPOCH    (the last step of `make demo`)
        reads runs/arithmetic-sft/summary.json and runs/arithmetic-grpo/summary.json, writes
        runs/demo-figures.json (the figures, the date, the command, the machine) and prints the
        paragraph README would show.
    python tools/demo_figures.py --docs             (`make demo-figures`, after a demo)
        copies runs/demo-figures.json to docs/demo-figures.json and rewrites README's paragraph
        between the `demo-figures` markers from it.

tests/test_docs_commands.py checks that README's paragraph is the one rendered from
docs/demo-figures.json, so a figure changes only by rerunning the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def files_of(demo: str) -> tuple[Path, Path, str, str]:
    """A demo's figures: the file it writes (runs/<demo>-figures.json), the copy kept in docs/,
    and README's markers around its paragraph."""
    name = f"{demo}-figures"
    return (Path(f"runs/{name}.json"), REPO / "docs" / f"{name}.json",
            f"<!-- {name}: written by `make {name}` from docs/{name}.json -->", f"<!-- /{name} -->")


RECORD, KEPT, BEGIN, END = files_of("demo")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def collect(started: float, now: float) -> dict:
    """The demo's figures from its two runs' summaries."""
    sft = json.loads(Path("runs/arithmetic-sft/summary.json").read_text())
    grpo = json.loads(Path("runs/arithmetic-grpo/summary.json").read_text())
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": "make demo",
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "demo_s": round(now - started),
        "sft_steps": sft["steps"],
        "sft_s": round(sft["wall_time_s"]),
        "grpo_steps": grpo["steps"],
        "grpo_s": round(grpo["wall_time_s"]),
        "eval_reward_start": grpo["eval_reward_start"],
        "eval_reward_end": grpo["eval_reward_end"],
    }


def _duration(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _reward(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def measured(f: dict) -> str:
    """The opening of a shared-machine demo's paragraph: the command, date, machine, load and
    the whole demo's time (the tool and VLM demos)."""
    commit = f" at commit {f['commit']}" if f.get("commit") else ""
    return (f"Measured by `{f['command']}` on {f['date']} ({f['cpus']} CPU cores shared with "
            f"other work, load average {f['load_average']} at the end; set-up done{commit}): it "
            f"took {_duration(f['demo_s'])}")


def written_by(demo: str) -> str:
    """The closing of a demo's paragraph: where its figures come from."""
    return (f"The demo writes these figures to `runs/{demo}-figures.json`; "
            f"`make {demo}-figures` copies them here.")


def render(f: dict) -> str:
    """README's paragraph for the figures `f`."""
    commit = f" at commit {f['commit']}" if f.get("commit") else ""
    return (
        f"Measured by `{f['command']}` on {f['date']} ({f['cpus']} CPU cores, set-up already "
        f"done{commit}): it took {_duration(f['demo_s'])} (SFT {f['sft_steps']} steps in "
        f"{f['sft_s']} s, GRPO {f['grpo_steps']} steps in {f['grpo_s']} s), and the held-out eval "
        f"reward rose from **{_reward(f['eval_reward_start'])} to "
        f"{_reward(f['eval_reward_end'])}**. The demo writes these figures to "
        f"`runs/demo-figures.json`; `make demo-figures` copies them here."
    )


def readme_with(readme: str, paragraph: str, begin: str = BEGIN, end: str = END) -> str:
    """`readme` with the text between the markers `begin` and `end` replaced by `paragraph`."""
    head, found, rest = readme.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise SystemExit(f"README.md has no `{begin}` ... `{end}` block")
    return f"{head}{begin}\n{paragraph}\n{end}{tail}"


def figures_main(argv: list[str] | None, doc: str, demo: str, record: Path, kept: Path,
                 collect, render, begin: str = BEGIN, end: str = END) -> int:
    """A demo's figures script (`make demo`, `make demo-tools`, `make demo-vlm`):
    `--started EPOCH` writes `record` from `collect(started, now)` and prints README's paragraph
    (`render(figures)`); `--docs` copies `record` to `kept` and README's block between `begin`
    and `end`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--started", type=float, help="the demo's start (seconds since the epoch)")
    parser.add_argument("--docs", action="store_true",
                        help=f"copy {record} into docs/ and README")
    args = parser.parse_args(argv)
    if args.docs:
        if not record.is_file():
            raise SystemExit(f"{record} is missing: run `make {demo}` first")
        figures = json.loads(record.read_text())
        kept.write_text(json.dumps(figures, indent=1) + "\n")
        README.write_text(readme_with(README.read_text(), render(figures), begin, end))
        print(f"README.md and {kept.relative_to(REPO)}: figures of {figures['date']}")
        return 0
    figures = collect(args.started or time.time(), time.time())
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(figures, indent=1) + "\n")
    print(render(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return figures_main(argv, __doc__, "demo", RECORD, KEPT, collect, render)


if __name__ == "__main__":
    sys.exit(main())

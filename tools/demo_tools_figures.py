"""README's tool-use demo figures come from the files `make demo-tools` writes, never typed by
hand (as tools/demo_figures.py does for `make demo`).

    python tools/demo_tools_figures.py --started EPOCH   (the last step of `make demo-tools`)
        reads runs/tools-eval/base.json (held-out success before SFT), runs/tools-sft/summary.json
        and runs/tools-grpo/summary.json (held-out success before its first step, after SFT, and
        after its last), writes runs/demo-tools-figures.json and prints README's paragraph.
    python tools/demo_tools_figures.py --docs            (`make demo-tools-figures`)
        copies runs/demo-tools-figures.json to docs/demo-tools-figures.json and rewrites README's
        paragraph between the `demo-tools-figures` markers from it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from demo_figures import _commit, _reward, figures_main, files_of, measured, written_by

RECORD, KEPT, BEGIN, END = files_of("demo-tools")


def collect(started: float, now: float) -> dict:
    """The demo's figures from its evaluation of the base model and its two runs' summaries."""
    base = json.loads(Path("runs/tools-eval/base.json").read_text())
    sft = json.loads(Path("runs/tools-sft/summary.json").read_text())
    grpo = json.loads(Path("runs/tools-grpo/summary.json").read_text())
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": "make demo-tools",
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),
        "demo_s": round(now - started),
        "eval_episodes": base["episodes"],
        "sft_steps": sft["steps"],
        "sft_s": round(sft["wall_time_s"]),
        "grpo_steps": grpo["steps"],
        "grpo_s": round(grpo["wall_time_s"]),
        "success_before_sft": base["eval/success_rate"],
        "success_after_sft": grpo["eval_start"].get("eval/success_rate"),
        "success_after_rl": grpo["eval_end"].get("eval/success_rate"),
    }


def render(f: dict) -> str:
    """README's paragraph for the figures `f`."""
    return (
        f"{measured(f)} (SFT {f['sft_steps']} steps in {f['sft_s']} s, GRPO "
        f"{f['grpo_steps']} steps through the gateway in {f['grpo_s']} s). Held-out success on "
        f"{f['eval_episodes']} questions, greedy: **{_reward(f['success_before_sft'])} before SFT, "
        f"{_reward(f['success_after_sft'])} after SFT, {_reward(f['success_after_rl'])} after RL**. "
        f"{written_by('demo-tools')}"
    )


def main(argv: list[str] | None = None) -> int:
    return figures_main(argv, __doc__, "demo-tools", RECORD, KEPT, collect, render, BEGIN, END)


if __name__ == "__main__":
    sys.exit(main())

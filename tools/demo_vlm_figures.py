"""README's vision-language demo figures come from the files `make demo-vlm` writes, never typed
by hand (as tools/demo_figures.py does for `make demo`).

    python tools/demo_vlm_figures.py --started EPOCH   (the last step of `make demo-vlm`)
        reads the summaries of runs/vlm-sft, runs/vlm-grpo and the blank-image ablation's
        runs/vlm-blank-sft and runs/vlm-blank-grpo (held-out accuracy before GRPO's first step,
        i.e. after SFT, and after its last), writes runs/demo-vlm-figures.json and prints README's
        paragraph.
    python tools/demo_vlm_figures.py --docs            (`make demo-vlm-figures`)
        copies runs/demo-vlm-figures.json to docs/demo-vlm-figures.json and rewrites README's
        paragraph between the `demo-vlm-figures` markers from it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from demo_figures import _commit, _reward, figures_main, files_of, measured, written_by

RECORD, KEPT, BEGIN, END = files_of("demo-vlm")


def _summary(run: str) -> dict:
    return json.loads(Path(f"runs/{run}/summary.json").read_text())


def collect(started: float, now: float) -> dict:
    """The demo's figures from its four runs' summaries."""
    sft, grpo = _summary("vlm-sft"), _summary("vlm-grpo")
    blank_sft, blank = _summary("vlm-blank-sft"), _summary("vlm-blank-grpo")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": "make demo-vlm",
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),
        "demo_s": round(now - started),
        "sft_steps": sft["steps"],
        "sft_s": round(sft["wall_time_s"]),
        "grpo_steps": grpo["steps"],
        "grpo_s": round(grpo["wall_time_s"]),
        "ablation_s": round(blank_sft["wall_time_s"] + blank["wall_time_s"]),
        "reward_after_sft": grpo["eval_reward_start"],
        "reward_after_rl": grpo["eval_reward_end"],
        "blank_after_sft": blank["eval_reward_start"],
        "blank_after_rl": blank["eval_reward_end"],
    }


def render(f: dict) -> str:
    """README's paragraph for the figures `f`."""
    return (
        f"{measured(f)} (SFT {f['sft_steps']} steps in {f['sft_s']} s, GRPO {f['grpo_steps']} "
        f"steps in {f['grpo_s']} s, the ablation's two runs in {f['ablation_s']} s). Held-out "
        f"accuracy, greedy (chance 0.25): **{_reward(f['reward_after_sft'])} after SFT, "
        f"{_reward(f['reward_after_rl'])} after GRPO**; with blank images, "
        f"{_reward(f['blank_after_sft'])} after SFT and {_reward(f['blank_after_rl'])} after "
        f"GRPO. {written_by('demo-vlm')}"
    )


def main(argv: list[str] | None = None) -> int:
    return figures_main(argv, __doc__, "demo-vlm", RECORD, KEPT, collect, render, BEGIN, END)


if __name__ == "__main__":
    sys.exit(main())

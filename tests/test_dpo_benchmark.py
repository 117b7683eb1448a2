"""`benchmarks/dpo_vs_trl.py` runs as documented, here from a model of one's own (`--model`) on a
few pairs: both sides train on the same pairs and the last line is the JSON the docs quote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).parents[1] / "benchmarks" / "dpo_vs_trl.py"


def test_the_benchmark_compares_both_sides_on_a_given_model(tiny_model):
    pytest.importorskip("trl")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--model", tiny_model, "--steps", "2", "--pairs", "32",
         "--eval-pairs", "8", "--rounds", "1", "--threads", "1", "--lr", "1e-4"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split(" round ")[0] for line in lines[:-1]] == ["trl", "reroll"]
    result = json.loads(lines[-1])
    assert result["model"] == tiny_model and result["pairs"] == 32 and result["lr"] == 1e-4
    assert result["steps"] == 2 and result["rounds"] == 1
    # the ratio is of the two sides' medians, each over the same 2 x 16 pairs
    speed = {s: 2 * 16 / result["seconds"][s][0] for s in ("trl", "reroll")}
    assert result["throughput_ratio"] == pytest.approx(speed["reroll"] / speed["trl"], rel=0.05)  # times rounded to 0.01 s
    # reroll's checkpoint and final model are written, and left out of its times as TRL's are
    assert len(result["reroll_save_seconds"]) == 1 and result["reroll_save_seconds"][0] > 0
    for side in ("trl", "reroll"):
        assert 0.0 <= result[f"{side}_accuracy"] <= 1.0

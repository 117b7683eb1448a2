"""`benchmarks/lora.py`'s update worker on the tiny model: its RSS breakdown adds up to the
update's peak and each part is the size it should be (so a regression shows where it is)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).parents[1] / "benchmarks" / "lora.py"
PARTS = ("runtime", "weights", "gradients", "optimizer", "activations")


@pytest.mark.parametrize("lora", [False, True])
def test_the_rss_breakdown_adds_up(tiny_model, lora):
    spec = {"lora": lora, "kl": False, "model": tiny_model, "threads": 1, "repeats": 1}
    done = subprocess.run([sys.executable, str(BENCH), "--train-worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    parts = [run[f"{part}_gb"] for part in PARTS]
    assert sum(parts) == pytest.approx(run["update_peak_gb"], abs=1e-6)
    assert run["peak_rss_gb"] >= run["update_peak_gb"] > 0.1
    trained_gb = run["trained_params"] * 4 / 2**30
    assert run["gradients_gb"] == pytest.approx(trained_gb)
    assert run["optimizer_gb"] == pytest.approx(2 * trained_gb, rel=0.01)  # AdamW's two moments
    assert all(part >= 0 for part in parts[:4]) and run["weights_gb"] >= trained_gb

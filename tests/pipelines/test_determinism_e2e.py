"""Deterministic mode on CPU: two runs with the same seed and config log identical metrics (all
but wall-clock times) and end with identical weights, also when the rollout runs many requests
concurrently (small engine batches, a cap on running requests, over-sampling, dynamic sampling
with refills, a pool of reward workers) and groups have several samples."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.pipelines.rlvr import train

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent

CONCURRENT = {
    "rollout": {"max_batch_size": 3},
    "scheduler": {"max_running_per_engine": 5, "oversample": 1.5},
    "algorithm": {"dynamic_sampling": {"drop_all_equal": True}, "kl": {"coef": 0.01}},
    "reward": {"type": "custom", "function": "parity_reward:odd_length", "num_workers": 2},
}


def run_once(root: Path, tiny_model: str, arithmetic: dict, name: str, extra: dict) -> Path:
    data = {
        "output_dir": str(root / name), "seed": 7, "steps": 3, "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "reward": {"type": "custom", "function": "parity_reward:odd_length"},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 2, "max_prompts": 4, "samples_per_prompt": 2, "temperature": 1.0},
        "tracking": {"progress": False, "tensorboard": False},
    }
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    (root / f"{name}.yaml").write_text(yaml.safe_dump(data))
    sys.path.insert(0, str(HERE))
    try:
        train(load_config(root / f"{name}.yaml"))
    finally:
        sys.path.remove(str(HERE))
    return root / name


def without_timings(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time/") and "_per_s" not in k}
            for row in rows]


@pytest.mark.parametrize("extra", [{}, CONCURRENT], ids=["default", "concurrent"])
def test_same_seed_same_metrics_and_weights(tmp_path, tiny_model, arithmetic, extra):
    first = run_once(tmp_path, tiny_model, arithmetic, "a", extra)
    second = run_once(tmp_path, tiny_model, arithmetic, "b", extra)

    metrics_a, metrics_b = without_timings(first), without_timings(second)
    assert [r["step"] for r in metrics_a] == [1, 2, 3]
    assert metrics_a == metrics_b
    assert metrics_a[-1]["train/loss"] != 0.0  # the runs did learn something, identically

    weights_a = load_file(first / "checkpoints" / "step_3" / "model.safetensors")
    weights_b = load_file(second / "checkpoints" / "step_3" / "model.safetensors")
    initial = load_file(Path(tiny_model) / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert any(not torch.equal(weights_a[k], initial[k]) for k in weights_a)


def test_skipping_zero_advantage_samples_keeps_the_update(tmp_path, tiny_model, arithmetic):
    """The same first step with and without `skip_zero_advantage` (pi_old then computed on the
    trained samples only, TIS on): same loss and gradient norm, less work."""
    tis = {"correction": {"tis": {"level": "token", "cap": 2.0}}, "updates_per_batch": 2}
    rows = {}
    for skip in (False, True):
        extra = {"algorithm": {**tis, "skip_zero_advantage": skip}, "eval": {"every_steps": 0},
                 "rollout": {"group_size": 2, "prompts_per_step": 8}}  # pairs: often equal
        run = run_once(tmp_path, tiny_model, arithmetic, f"skip_{skip}", extra | {"steps": 1})
        rows[skip] = without_timings(run)[0]
    assert rows[True]["train/zero_advantage_skipped"] > 0
    assert rows[False]["train/zero_advantage_skipped"] == 0
    assert rows[True]["train/reward_mean"] == rows[False]["train/reward_mean"]
    for key in ("train/loss", "train/grad_norm"):
        assert rows[True][key] == pytest.approx(rows[False][key], rel=1e-4, abs=1e-7)

"""The cached reference log-probabilities of a DPO run (`reference_logprobs.pt`): a resumed run
whose file was cut short (a kill while it was written) computes them again, the same values,
instead of a traceback (issue 49)."""

import pytest
import torch
import yaml

from reroll.cli import main
from reroll.data.preferences import write_arithmetic_preferences

pytestmark = pytest.mark.unit


def test_a_truncated_reference_cache_is_computed_again_on_resume(tmp_path, tiny_model, caplog):
    paths = write_arithmetic_preferences(tmp_path / "pairs", train_size=8, eval_size=4)
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "dpo", "output_dir": str(tmp_path / "run"), "model": {"path": tiny_model},
        "data": {"train": str(paths["train"]), "eval": str(paths["eval"])}, "steps": 1,
        "batch_size": 2, "train": {"micro_batch_size": 4}, "checkpoint": {"every_steps": 1},
        "tracking": {"progress": False, "tensorboard": False}}))
    assert main(["dpo", str(config)]) == 0
    cache = tmp_path / "run" / "reference_logprobs.pt"
    before = torch.load(cache)
    cache.write_bytes(cache.read_bytes()[:200])
    assert main(["dpo", str(config), "resume=true", "steps=2"]) == 0
    assert f"{cache} cannot be read" in caplog.text
    after = torch.load(cache)
    assert sorted(after) == sorted(before)
    for name, sums in before.items():
        torch.testing.assert_close(after[name], sums)

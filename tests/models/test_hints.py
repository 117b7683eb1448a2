"""A missing model's error says what really builds it: the SFT run that writes `final/` (and
its Makefile target), the Makefile recipe of a tiny model, or `reroll make-model`."""

import shutil
from pathlib import Path

from reroll.cli import main
from reroll.models.hints import missing_model_hint

ROOT = Path(__file__).resolve().parents[2]


def checkout_without_outputs(tmp_path: Path) -> Path:
    """The examples and the Makefile as a fresh clone has them, before any run."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    return tmp_path


def test_the_agentic_demo_points_at_its_sft_run_not_make_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(checkout_without_outputs(tmp_path))
    assert main(["train", "examples/agentic/demo.yaml"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "`reroll sft examples/agentic/guess_number_sft.yaml`" in err
    assert "`make demo-agentic`" in err
    assert "make-model" not in err and "hub id" not in err


def test_each_kind_of_model_folder_gets_its_own_command(tmp_path):
    root = checkout_without_outputs(tmp_path)
    assert "`reroll sft examples/arithmetic/sft.yaml`" in missing_model_hint(
        "runs/arithmetic-sft/final", root)
    assert "`make models/guess_number/config.json`" in missing_model_hint("models/guess_number",
                                                                          root)
    assert "`reroll train examples/arithmetic/grpo.yaml`" in missing_model_hint(
        "runs/arithmetic-grpo/checkpoints/step_40", root)
    assert "`reroll make-model --out elsewhere/m`" in missing_model_hint("elsewhere/m", root)
    assert "run it first" in missing_model_hint("runs/unknown/final", root)
    assert "`reroll dpo examples/preferences/dpo.yaml`" in missing_model_hint(
        "runs/arithmetic-dpo/final", root)


def test_the_final_folder_of_an_rl_run_points_at_its_checkpoints_not_at_reroll_sft(tmp_path):
    hint = missing_model_hint("runs/arithmetic-grpo/final", checkout_without_outputs(tmp_path))
    assert "`reroll train examples/arithmetic/grpo.yaml` writes no final/" in hint
    assert "runs/arithmetic-grpo/checkpoints/step_N" in hint and "reroll sft" not in hint

"""`reroll dpo` and `reroll rm` on preference pairs of the arithmetic task (chosen: the worked,
right answer; rejected: a wrong one): they learn to rank held-out pairs, resume exactly, and
write the standard run directory that `reroll view` shows."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.cli import main
from reroll.config import load_config
from reroll.data.preferences import write_arithmetic_preferences
from reroll.data.tasks import write_arithmetic
from reroll.pipelines.dpo import REFERENCE_FILE, train_dpo
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    paths = write_arithmetic_preferences(tmp_path_factory.mktemp("pairs"), train_size=1000,
                                         eval_size=200, seed=0)
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def few_pairs(tmp_path_factory) -> dict:
    """`pairs` cut to its first 256 train pairs (the same 200 held out), for the short runs
    below (at most 15 steps of 16 pairs): a DPO run scores every train pair with its reference
    before the first step, so the 1,000 of `pairs` cost them 4 times that work."""
    paths = write_arithmetic_preferences(tmp_path_factory.mktemp("few_pairs"), train_size=256,
                                         eval_size=200, seed=0)
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory, tiny_model) -> str:
    """The tiny model after SFT on worked solutions (the demo's warm start): it can do the sums,
    so a preference for the right answer is learnable from a few hundred pairs. One torch
    thread here and below: `make test` runs two xdist workers on 2 cores, and 2 threads each
    oversubscribed them (an SFT step took ~6 s with 2 threads, ~1.5 s with 1, on one loaded
    machine)."""
    out = tmp_path_factory.mktemp("sft")
    arithmetic = write_arithmetic(out / "data", train_size=4000, eval_size=20, seed=0)
    path = out / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(out / "run"), "model": {"path": tiny_model},
        "data": {"train": str(arithmetic["train"]), "response_key": "solution"},
        "steps": 150, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 10,
                                                      "schedule": "cosine"},
        "train": {"micro_batch_size": 32, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False}}))
    return train_sft(load_config(path, expect="sft"))["final_model"]


def config(tmp_path: Path, model: str, pairs: dict, pipeline: str = "dpo", **extra) -> Path:
    path = tmp_path / f"{pipeline}.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": pipeline, "output_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"path": model}, "data": {"train": pairs["train"], "eval": pairs["eval"]},
        "steps": 60, "batch_size": 16, "eval_every_steps": 20,
        "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"micro_batch_size": 16, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False}, **extra}))
    return path


def untimed(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_metrics(run_dir)]


def test_dpo_learns_to_prefer_the_right_answer(tmp_path, sft_model, pairs, capsys):
    assert main(["dpo", str(config(tmp_path, sft_model, pairs))]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_accuracy_start"] == pytest.approx(0.5)  # policy == reference: ties
    assert summary["eval_accuracy_end"] >= 0.85
    rows = read_metrics(summary["run_dir"])
    evals = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 20, 40, 60]
    assert evals[-1]["eval/reward_margin"] > 1.0
    assert all("pref/accuracy" in row and "train/loss" in row for row in rows if row["step"])
    run = Path(summary["run_dir"])
    assert (run / REFERENCE_FILE).is_file() and (run / "final" / "model.safetensors").is_file()

    assert main(["view", str(run), "--out", str(tmp_path / "report.html")]) == 0
    assert "eval preference accuracy" in capsys.readouterr().out
    assert '"id":"preference"' in (tmp_path / "report.html").read_text()


def test_dpo_resume_is_exact_and_reuses_the_reference(tmp_path, tiny_model, few_pairs, capsys):
    path = config(tmp_path, tiny_model, few_pairs, steps=5, eval_every_steps=0,
                  checkpoint={"every_steps": 2, "keep_last": 5})
    assert main(["dpo", str(path)]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = Path(whole["run_dir"])
    full_metrics = untimed(run)
    full = load_file(str(run / "final" / "model.safetensors"))
    reference_mtime = (run / REFERENCE_FILE).stat().st_mtime_ns

    for step in (4, 5):  # the run died during step 4
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    shutil.rmtree(run / "final")
    lines = (run / "metrics.jsonl").read_text().splitlines()[:4]  # steps 0..3
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    assert main(["dpo", str(path), "resume=true"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["resumed_from_step"] == 2
    assert resumed["eval_accuracy_start"] == whole["eval_accuracy_start"]
    assert untimed(run) == full_metrics
    again = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(again[k], full[k]) for k in full)
    assert (run / REFERENCE_FILE).stat().st_mtime_ns == reference_mtime  # not recomputed


@pytest.mark.parametrize("loss", [{"name": "sigmoid", "label_smoothing": 0.1},
                                  {"name": "ipo", "beta": 0.5},
                                  {"name": "simpo"}, {"name": "orpo"}],
                         ids=lambda loss: loss["name"] + ("_cdpo" if "label_smoothing" in loss else ""))
def test_every_loss_trains_and_ranks_better(tmp_path, tiny_model, few_pairs, loss):
    path = config(tmp_path, tiny_model, few_pairs, loss=loss, steps=15, eval_every_steps=0,
                  optimizer={"lr": 3e-3})
    summary = train_dpo(load_config(path, expect="dpo"))
    assert summary["eval_accuracy_end"] > summary["eval_accuracy_start"] + 0.1
    reference_free = loss["name"] in ("simpo", "orpo")
    assert (Path(summary["run_dir"]) / REFERENCE_FILE).exists() is not reference_free


def test_dpo_with_a_lora_adapter_ranks_better_and_writes_the_merged_model(tmp_path, tiny_model,
                                                                          few_pairs):
    path = config(tmp_path, tiny_model, few_pairs, steps=15, eval_every_steps=0,
                  optimizer={"lr": 1e-2})
    data = yaml.safe_load(path.read_text())
    data["model"]["lora"] = {"rank": 8, "alpha": 16}
    path.write_text(yaml.safe_dump(data))
    summary = train_dpo(load_config(path, expect="dpo"))
    assert summary["eval_accuracy_end"] > summary["eval_accuracy_start"] + 0.1
    run = Path(summary["run_dir"])
    assert (run / "checkpoints" / "step_15" / "adapter_model.safetensors").is_file()
    merged = load_file(str(run / "final" / "model.safetensors"))  # a plain transformers model
    assert not any("lora" in name for name in merged)


def test_reward_model_ranks_held_out_pairs_and_loads_in_transformers(tmp_path, sft_model, pairs,
                                                                     capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from reroll.rewards.model import sequence_scores

    # held-out accuracy by step (seed 0): 0.56, 0.85 (20), 0.845 (40), 0.86 (60), 0.875 (100),
    # 0.89 (120): fewer steps, or a higher lr, leave no clear margin over 0.85. Evaluated only
    # before the first and after the last step (evaluation changes no weight).
    path = config(tmp_path, sft_model, pairs, pipeline="rm", steps=120, eval_every_steps=0)
    assert main(["rm", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_accuracy_end"] >= 0.85

    model = AutoModelForSequenceClassification.from_pretrained(summary["final_model"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(summary["final_model"])
    ids = tokenizer("Sam has 2 apples. 2 + 3 = 5. The answer is \\boxed{5}.")["input_ids"]
    ids = torch.tensor([ids])
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0, 0]
        ours = sequence_scores(model, ids, torch.ones_like(ids))[0]
    assert float(theirs) == pytest.approx(float(ours), abs=1e-5)

"""RLVR on a learned reward, measured by the true verifier: a reward model trained on the
policy's own verified samples (`reroll eval` -> `make-data --preferences-from` -> `reroll rm`)
is the training reward of a GRPO run whose held-out evaluation is math-verify (`eval.reward`):
the true reward rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from reroll.cli import main
from reroll.config import load_config
from reroll.data.tasks import write_arithmetic
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
QUIET = {"progress": False, "tensorboard": False}


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny_model) -> dict:
    """The tiny model after SFT on demonstrations of mixed quality, as in the demo: most state
    an answer without the working (often a number copied from the question), the rest work
    it out; single-digit additions."""
    from reroll.pipelines.sft import train_sft

    root = tmp_path_factory.mktemp("warm")
    data = write_arithmetic(root / "data", train_size=1200, eval_size=16, seed=0, levels=(1,),
                            direct_frac=0.6, direct_accuracy=0.25)
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(root / "sft"), "model": {"path": tiny_model},
        "data": {"train": str(data["train"]), "response_key": "response"},
        "epochs": 3.0, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "train": {"micro_batch_size": 32}, "tracking": QUIET}))
    return {"model": train_sft(load_config(config, expect="sft"))["final_model"],
            "train": str(data["train"])}


@pytest.fixture(scope="module")
def samples(tmp_path_factory, warm) -> dict:
    """8 samples (temperature 1) of the warm model on 600 training prompts, verified by math;
    and a held-out eval set of other prompts."""
    root = tmp_path_factory.mktemp("samples")
    out = root / "warm-train.json"
    assert main(["eval", "--model", warm["model"], "--task", warm["train"], "--max-prompts",
                 "600", "--n", "8", "--temperature", "1.0", "--max-new-tokens", "24",
                 "--out", str(out)]) == 0
    held_out = write_arithmetic(root / "held_out", train_size=1, eval_size=48, seed=11,
                                levels=(1,))["eval"]
    return {"samples": str(out.with_suffix(".samples.jsonl")), "eval": str(held_out),
            "root": root}


def rl_config(tmp_path: Path, warm: dict, samples: dict, reward: dict) -> Path:
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "seed": 1, "steps": 16,
        "model": {"path": warm["model"]},
        "data": {"train": warm["train"], "eval": samples["eval"]},
        "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 24},
        "reward": reward, "optimizer": {"lr": 3e-4}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": 8, "temperature": 1.0, "samples_per_prompt": 4,
                 "reward": {"type": "math"}},
        "tracking": QUIET}))
    return path


def test_rlvr_on_a_reward_model_raises_the_verified_reward(tmp_path, warm, samples, capsys):
    pairs = tmp_path / "pairs"
    assert main(["make-data", "--preferences-from", samples["samples"], "--out", str(pairs),
                 "--eval-size", "100"]) == 0
    rm = tmp_path / "rm.yaml"
    rm.write_text(yaml.safe_dump({
        "pipeline": "rm", "output_dir": str(tmp_path / "rm"), "model": {"path": warm["model"]},
        "data": {"train": str(pairs / "train.jsonl"), "eval": str(pairs / "eval.jsonl")},
        "steps": 120, "batch_size": 16, "eval_every_steps": 0,
        "optimizer": {"lr": 1e-3, "warmup_steps": 2}, "train": {"micro_batch_size": 16},
        "tracking": QUIET}))
    capsys.readouterr()
    assert main(["rm", str(rm)]) == 0
    rm_summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rm_summary["eval_accuracy_end"] >= 0.7, rm_summary

    reward = {"type": "model", "path": rm_summary["final_model"], "batch_size": 64}
    summary = train(load_config(rl_config(tmp_path, warm, samples, reward)))
    rows = read_metrics(tmp_path / "run")
    print({"rm_accuracy": rm_summary["eval_accuracy_end"],
           "true_eval": [summary["eval_reward_start"]] + [r["eval/reward_mean"] for r in rows
                                                          if "eval/reward_mean" in r]})
    assert summary["eval_reward_end"] >= summary["eval_reward_start"] + 0.05
    assert rows[-1]["reward/model_batches"] > 0 and rows[-1]["eval_reward/errors"] == 0

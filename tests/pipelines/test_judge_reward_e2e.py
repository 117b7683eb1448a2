"""GRPO with an LLM judge as the reward (`reward: {type: judge}`) on the tiny model: the judge's
engine runs beside the policy's, every training sample is judged, the verdicts train the policy,
the held-out evaluation uses its own reward (`eval.reward`), and the judge's counters add up.

That a judge raises the true task reward is measured at full size in docs/preferences.md
("RLVR on an LLM judge"): a small version (a judge SFT'd in seconds) judged at 0.55, too close to
chance for a test to rely on."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
STEPS, PROMPTS, GROUP = 3, 8, 4


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory, tiny_model):
    """The tiny model after a short SFT on worked single-digit additions (seconds)."""
    from reroll.data.tasks import write_arithmetic
    from reroll.pipelines.sft import train_sft

    root = tmp_path_factory.mktemp("warm")
    data = write_arithmetic(root / "data", train_size=800, eval_size=16, seed=0, levels=(1,))
    config = write_config(root / "sft.yaml", {
        "pipeline": "sft", "output_dir": str(root / "sft"), "model": {"path": tiny_model},
        "data": {"train": str(data["train"]), "response_key": "solution"},
        "epochs": 3.0, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "train": {"micro_batch_size": 32}, "tracking": {"progress": False, "tensorboard": False}})
    summary = train_sft(load_config(config, expect="sft"))
    return {"model": summary["final_model"], "train": str(data["train"]),
            "eval": str(data["eval"])}


def test_grpo_on_a_judge_trains_and_counts_the_judges_verdicts(tmp_path, warm_model):
    """The warm model judges its own responses (the response alone is its prompt; the first
    digit of its reply is a score on 0-5): its replies follow the response, so the scores differ
    within a group and train the policy, and a first digit over 5 is an unparseable verdict, so
    parse failures, retries and failed calls happen. The counters must agree: each call asks
    until a reply parses or its retries are spent, so the generations less the unparseable
    replies are the calls less the failed ones (the cache is off: every call generates)."""
    config = write_config(tmp_path / "rl.yaml", {
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": STEPS,
        "model": {"path": warm_model["model"]},
        "data": {"train": warm_model["train"], "eval": warm_model["eval"]},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 24},
        "reward": {"type": "judge", "model": warm_model["model"], "template": "{response}",
                   "verdict": "score", "score_pattern": r"(\d)", "score_min": 0, "score_max": 5,
                   "max_new_tokens": 16, "temperature": 1.0, "retries": 1, "cache": False,
                   "max_failure_rate_step": 1.0, "max_failure_rate_run": 1.0},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": STEPS, "max_prompts": 8, "reward": {"type": "math"}},
        "checkpoint": {"every_steps": STEPS},
        "tracking": {"progress": False, "tensorboard": False}})
    summary = train(load_config(config))
    rows = read_metrics(tmp_path / "run")
    assert summary["steps"] == STEPS and summary["eval_reward_start"] is not None
    assert "eval/reward_mean" in rows[-1]  # the held-out set, scored by the math reward
    for step, row in enumerate(rows, 1):
        calls = step * PROMPTS * GROUP  # the counters are cumulative
        requests, failures = row["reward/judge_requests"], row["reward/judge_parse_failures"]
        assert requests - failures == calls - row["reward/errors"], row
        assert row["reward/judge_cache_hits"] == 0 and row["reward/timeouts"] == 0
    last = rows[-1]
    assert last["reward/judge_parse_failures"] > 0  # some replies held no verdict ...
    assert last["reward/judge_requests"] > last["reward/judge_parse_failures"]  # ... some did
    assert last["reward/errors"] < STEPS * PROMPTS * GROUP
    before = load_file(Path(warm_model["model"]) / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / f"step_{STEPS}" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the verdicts trained it

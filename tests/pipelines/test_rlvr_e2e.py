"""End-to-end runs of the SFT and GRPO pipelines on the tiny model: the behaviour a user cares
about (reward goes up, weights change, resume reproduces the run, broken rewards don't stop it)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.engines.base import WeightSyncError
from reroll.pipelines.rlvr import rlvr_pipeline, train
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory, tiny_model):
    """The tiny model after a short SFT on single-digit additions (a few seconds)."""
    from reroll.data.tasks import write_arithmetic

    root = tmp_path_factory.mktemp("warm")
    data = write_arithmetic(root / "data", train_size=1200, eval_size=16, seed=0, levels=(1,))
    config = write_config(root / "sft.yaml", {
        "pipeline": "sft", "output_dir": str(root / "sft"), "model": {"path": tiny_model},
        "data": {"train": str(data["train"]), "response_key": "solution"},
        "epochs": 3.0, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "train": {"micro_batch_size": 32}, "tracking": {"progress": False, "tensorboard": False}})
    summary = train_sft(load_config(config, expect="sft"))
    return {"model": summary["final_model"], "train": str(data["train"]), "eval": str(data["eval"])}


def rl_config(tmp_path, warm_model, **sections) -> dict:
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 1, "steps": 12,
        "model": {"path": warm_model["model"]},
        "data": {"train": warm_model["eval"], "eval": warm_model["eval"]},
        "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 24},
        "optimizer": {"lr": 3e-4}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": 6, "temperature": 1.0, "samples_per_prompt": 4},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        "tracking": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def test_grpo_raises_reward_and_changes_weights(tmp_path, warm_model):
    config = load_config(write_config(tmp_path / "rl.yaml", rl_config(tmp_path, warm_model)))
    summary = train(config)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 13))
    early = sum(r["train/reward_mean"] for r in rows[:3]) / 3
    late = sum(r["train/reward_mean"] for r in rows[-3:]) / 3
    assert late > early + 0.08, (early, late)
    assert summary["eval_reward_end"] > summary["eval_reward_start"]
    before = load_file(Path(warm_model["model"]) / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / "step_12" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in ("train/reward_mean", "time/step_s", "time/weight_sync_s", "actor/entropy"):
        assert key in rows[-1]
    assert "eval/reward_mean" in rows[5] and "eval/reward_mean" not in rows[4]
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "rollouts" / "step_1.jsonl").is_file()
    assert json.loads((run / "summary.json").read_text())["steps"] == 12


def test_resume_reproduces_the_uninterrupted_run(tmp_path, warm_model):
    data = rl_config(tmp_path, warm_model, steps=6, checkpoint={"every_steps": 3},
                     algorithm={"kl": {"coef": 0.01}, "updates_per_batch": 2})
    train(load_config(write_config(tmp_path / "rl.yaml", data)))
    full = read_metrics(tmp_path / "run")

    # Pretend the run died after step 4: only the step-3 checkpoint and metrics up to step 4 exist.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(tmp_path / "run", interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_6")
    lines = (interrupted / "metrics.jsonl").read_text().splitlines()[:4]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data["output_dir"] = str(interrupted)
    summary = train(load_config(write_config(tmp_path / "resume.yaml", data), ["resume=true"]))
    resumed = read_metrics(interrupted)

    assert summary["resumed_from_step"] == 3
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if not k.startswith("time/")}, a["step"]


def test_weight_sync_mismatch_stops_the_run(tmp_path, warm_model):
    pipeline = rlvr_pipeline(load_config(write_config(
        tmp_path / "rl.yaml", rl_config(tmp_path, warm_model, steps=2))))
    pipeline.step.engine.load_weights = lambda named, version: None  # an engine that drops updates
    with pytest.raises(WeightSyncError, match="fingerprint"):
        pipeline.run()


def test_hanging_and_crashing_rewards_are_counted_and_the_run_finishes(tmp_path, warm_model):
    sys.path.insert(0, str(HERE))
    data = rl_config(tmp_path, warm_model, steps=2, eval={"every_steps": 0},
                     reward={"type": "custom", "function": "rewards_for_tests:hangs_or_crashes",
                             "timeout_s": 0.5, "num_workers": 2, "max_failure_rate_run": 1.0},
                     rollout={"prompts_per_step": 2, "group_size": 4}, train={"micro_batch_size": 8})
    data["data"]["eval"] = None
    try:
        train(load_config(write_config(tmp_path / "rl.yaml", data)))
    finally:
        sys.path.remove(str(HERE))
    last = read_metrics(tmp_path / "run")[-1]
    assert last["step"] == 2
    assert last["reward/timeouts"] >= 1 and last["reward/errors"] >= 1


def test_cli_train_runs_and_prints_the_summary(tmp_path, warm_model):
    data = rl_config(tmp_path, warm_model, steps=1, eval={"every_steps": 0},
                     tracking={"tensorboard": True})
    path = write_config(tmp_path / "rl.yaml", data)
    result = subprocess.run([sys.executable, "-m", "reroll.cli", "train", str(path),
                             "rollout.prompts_per_step=2", "train.micro_batch_size=16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["eval_reward_start"] is not None
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_code_reward_runs_inside_training(tmp_path, warm_model):
    tests = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    rows = [{"prompt": "Read two integers and print their sum in python.", "answer": tests}] * 2
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = rl_config(tmp_path, warm_model, steps=1, eval={"every_steps": 0},
                     reward={"type": "code", "time_limit_s": 2.0},
                     rollout={"prompts_per_step": 2, "group_size": 2}, train={"micro_batch_size": 4})
    data["data"] = {"train": str(tmp_path / "code.jsonl")}
    train(load_config(write_config(tmp_path / "rl.yaml", data)))
    last = read_metrics(tmp_path / "run")[-1]
    # The tiny model writes no valid program: every sample scores 0, but none is an error.
    assert last["train/reward_mean"] == 0.0 and last["reward/errors"] == 0.0
    recorded = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").open()]
    assert all("passed" in r["reward_info"] for r in recorded)


JUDGE_STEPS, JUDGE_PROMPTS, JUDGE_GROUP = 3, 8, 4
"""GRPO with an LLM judge as the reward (`reward: {type: judge}`): the judge's engine runs beside
the policy's, every training sample is judged, the verdicts train the policy, the held-out
evaluation uses its own reward (`eval.reward`), and the judge's counters add up. That a judge
raises the true task reward is measured at full size in docs/preferences.md ("RLVR on an LLM
judge"): a small version (a judge SFT'd in seconds) judged at 0.55, too close to chance for a
test to rely on."""


def test_grpo_on_a_judge_trains_and_counts_the_judges_verdicts(tmp_path, warm_model):
    """The warm model judges its own responses (the response alone is its prompt; the first
    digit of its reply is a score on 0-5): its replies follow the response, so the scores differ
    within a group and train the policy, and a first digit over 5 is an unparseable verdict, so
    parse failures, retries and failed calls happen. The counters must agree: each call asks
    until a reply parses or its retries are spent, so the generations less the unparseable
    replies are the calls less the failed ones (the cache is off: every call generates)."""
    config = write_config(tmp_path / "rl.yaml", {
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": JUDGE_STEPS,
        "model": {"path": warm_model["model"]},
        "data": {"train": warm_model["train"], "eval": warm_model["eval"]},
        "rollout": {"prompts_per_step": JUDGE_PROMPTS, "group_size": JUDGE_GROUP, "max_new_tokens": 24},
        "reward": {"type": "judge", "model": warm_model["model"], "template": "{response}",
                   "verdict": "score", "score_pattern": r"(\d)", "score_min": 0, "score_max": 5,
                   "max_new_tokens": 16, "temperature": 1.0, "retries": 1, "cache": False,
                   "max_failure_rate_step": 1.0, "max_failure_rate_run": 1.0},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": JUDGE_STEPS, "max_prompts": 8, "reward": {"type": "math"}},
        "checkpoint": {"every_steps": JUDGE_STEPS},
        "tracking": {"progress": False, "tensorboard": False}})
    summary = train(load_config(config))
    rows = read_metrics(tmp_path / "run")
    assert summary["steps"] == JUDGE_STEPS and summary["eval_reward_start"] is not None
    assert "eval/reward_mean" in rows[-1]  # the held-out set, scored by the math reward
    for step, row in enumerate(rows, 1):
        calls = step * JUDGE_PROMPTS * JUDGE_GROUP  # the counters are cumulative
        requests, failures = row["reward/judge_requests"], row["reward/judge_parse_failures"]
        assert requests - failures == calls - row["reward/errors"], row
        assert row["reward/judge_cache_hits"] == 0 and row["reward/timeouts"] == 0
    last = rows[-1]
    assert last["reward/judge_parse_failures"] > 0  # some replies held no verdict ...
    assert last["reward/judge_requests"] > last["reward/judge_parse_failures"]  # ... some did
    assert last["reward/errors"] < JUDGE_STEPS * JUDGE_PROMPTS * JUDGE_GROUP
    before = load_file(Path(warm_model["model"]) / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / f"step_{JUDGE_STEPS}" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the verdicts trained it

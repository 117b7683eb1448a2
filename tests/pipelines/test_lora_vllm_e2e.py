"""A LoRA run with `rollout.engine: vllm`: with `model.lora.sync: auto` vLLM receives the adapter
alone through its LoRA support, and every sync's fingerprint check passes without a fallback; the
greedy eval before training equals the hf engine's (the adapter starts at zero)."""

from pathlib import Path

import pytest
from test_recipes_e2e import recipe_config, shared_warm_model

from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def test_lora_grpo_with_vllm_syncs_the_adapter_alone(tmp_path, warm_model):
    summaries = {}
    for engine in ("hf", "vllm"):
        config = recipe_config(
            "grpo", tmp_path / engine, warm_model, steps=2,
            model={"path": warm_model["model"], "lora": {"rank": 8, "alpha": 16}},
            data={"train": warm_model["train"], "eval": warm_model["eval"]},
            rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24,
                     "engine": engine},
            optimizer={"lr": 3e-3}, train={"micro_batch_size": 8})
        summaries[engine] = train(config)
    assert summaries["vllm"]["eval_reward_start"] == summaries["hf"]["eval_reward_start"]
    rows = read_metrics(tmp_path / "vllm")
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert all(r["time/weight_sync_s"] > 0 for r in steps)
    assert all(r["weight_sync/adapter_fallbacks"] == 0 for r in steps)
    full_bytes = (Path(warm_model["model"]) / "model.safetensors").stat().st_size
    assert all(0 < r["weight_sync/bytes"] < full_bytes / 5 for r in steps)

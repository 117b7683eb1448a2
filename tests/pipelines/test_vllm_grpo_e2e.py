"""A GRPO run with `rollout.engine: vllm` matches one with `engine: hf`: identical greedy eval
before training (same weights, same greedy tokens) and an eval reward after training within
the tolerance below (the engines draw different random samples, so the runs diverge)."""

import pytest
from test_recipes_e2e import recipe_config, shared_warm_model

from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

# 16 greedy eval prompts: a difference of 4 prompts is within the run-to-run spread of 3 steps.
TOLERANCE = 0.25
SMALL = {"rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24},
         "train": {"micro_batch_size": 8}}


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def test_grpo_with_vllm_reaches_the_eval_reward_of_hf(tmp_path, warm_model):
    summaries = {}
    for engine in ("hf", "vllm"):
        sections = {**SMALL, "rollout": {**SMALL["rollout"], "engine": engine}}
        config = recipe_config("grpo", tmp_path / engine, warm_model, steps=3,
                               data={"train": warm_model["train"], "eval": warm_model["eval"]},
                               **sections)
        summaries[engine] = train(config)
    hf, vllm = summaries["hf"], summaries["vllm"]
    assert vllm["eval_reward_start"] == hf["eval_reward_start"]
    assert abs(vllm["eval_reward_end"] - hf["eval_reward_end"]) <= TOLERANCE
    rows = read_metrics(tmp_path / "vllm")
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    print({k: (s["eval_reward_start"], s["eval_reward_end"]) for k, s in summaries.items()})

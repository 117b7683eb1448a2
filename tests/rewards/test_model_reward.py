"""`reward: {type: model}`: batched scoring in the model's own thread, the same scores as
transformers' forward, and the runner's time limit and failure counting."""

import asyncio
import json
import shutil
import time

import pytest
import torch

from reroll.config.errors import ConfigError
from reroll.config.schema import RLConfig
from reroll.rewards import build_reward, build_runner
from reroll.rewards.base import RewardSample
from reroll.rewards.model import ModelRewardFn

pytestmark = pytest.mark.unit

SAMPLES = [RewardSample("Sam has 2 apples. How many?", f"The answer is \\boxed{{{n}}}.")
           for n in range(5)]


def config(reward: dict) -> RLConfig:
    return RLConfig.model_validate({"steps": 1, "model": {"path": "m"},
                                    "data": {"train": "t.jsonl"}, "reward": reward})


def test_batched_scores_are_transformers_scores(reward_model):
    from transformers import AutoModelForSequenceClassification

    fn = ModelRewardFn(reward_model, batch_size=4, max_wait_s=0.05)

    async def score_all():
        return await asyncio.gather(*(fn(s) for s in SAMPLES))

    try:
        results = asyncio.run(score_all())
    finally:
        fn.close()
    assert fn.batches == 2  # 4 together, then the fifth after max_wait_s
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    for sample, result in zip(SAMPLES, results, strict=True):
        ids = torch.tensor([fn.encode(sample)])  # unpadded: transformers pools its last token
        with torch.no_grad():
            assert result.score == pytest.approx(float(model(input_ids=ids).logits[0, 0]),
                                                 abs=1e-5)
    assert len({r.score for r in results}) == len(SAMPLES)
    assert fn.encode(SAMPLES[0])[-1] == fn.tokenizer.eos_token_id
    cut = RewardSample(SAMPLES[0].prompt, SAMPLES[0].response, finish_reason="length")
    assert fn.encode(cut) == fn.encode(SAMPLES[0])[:-1]


def test_a_call_past_the_time_limit_is_a_counted_timeout(reward_model):
    runner = build_runner(config({"type": "model", "path": reward_model, "timeout_s": 0.2,
                                  "max_wait_s": 3.0, "batch_size": 8}).reward)
    try:
        result = asyncio.run(runner.reward(SAMPLES[0]))
    finally:
        runner.close()
    assert result.score == 0.0 and "timeout" in result.info["error"]
    assert runner.metrics()["reward/timeouts"] == 1.0


def test_the_time_limit_includes_the_wait_for_the_batch(reward_model):
    """Issue 49: the limit was timeout_s + 2 s, so a call waiting 1 s for its batch under a
    0.2 s limit was scored, not counted as a time-out."""
    runner = build_runner(config({"type": "model", "path": reward_model, "timeout_s": 0.2,
                                  "max_wait_s": 1.0, "batch_size": 8}).reward)
    try:
        start = time.perf_counter()
        result = asyncio.run(runner.reward(SAMPLES[0]))
        elapsed = time.perf_counter() - start
    finally:
        runner.close()
    assert "timeout" in result.info.get("error", ""), result
    assert elapsed < 0.9, elapsed


def test_a_folder_without_the_scalar_head_or_weights_is_refused(reward_model, tiny_model,
                                                                 tmp_path):
    """Issue 49: a causal LM's folder saying num_labels: 1 loaded with a random `score` head and
    scored a whole run; a folder without weights was a traceback."""
    lm = tmp_path / "lm"
    shutil.copytree(tiny_model, lm)
    data = json.loads((lm / "config.json").read_text())
    (lm / "config.json").write_text(json.dumps({**data, "num_labels": 1}))
    with pytest.raises(ConfigError, match=r"its scalar head \(score.weight\) is not in the weights"):
        ModelRewardFn(str(lm))
    bare = tmp_path / "bare"
    shutil.copytree(reward_model, bare)
    (bare / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"reward.path {bare}: no weights there"):
        ModelRewardFn(str(bare))


def test_the_config_builds_it_and_bad_paths_are_config_errors(reward_model, tiny_model, tmp_path):
    fn = build_reward(config({"type": "model", "path": reward_model}).reward)
    assert isinstance(fn, ModelRewardFn) and fn.batch_size == 16
    fn.close()
    with pytest.raises(ConfigError, match="config.json missing"):
        ModelRewardFn(str(tmp_path))
    with pytest.raises(ConfigError, match="not a reward model"):
        ModelRewardFn(tiny_model)
    with pytest.raises(ValueError, match="path"):
        config({"type": "model"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_reward_device_is_resolved_where_the_reward_is_built(reward_model):
    """`reward.device`: `auto` and `cpu` are this CPU here; `cuda` without a GPU is a config
    error naming the field (in a reward actor, the actor's own GPUs decide)."""
    from reroll.pipelines.judge import reward_factory

    for device in ("auto", "cpu"):
        fn = reward_factory(config({"type": "model", "path": reward_model,
                                            "device": device}).reward)()
        assert fn.device == "cpu" and not next(fn.model.parameters()).is_cuda
        fn.close()
    with pytest.raises(ConfigError, match="reward.device: cuda"):
        reward_factory(config({"type": "model", "path": reward_model,
                                       "device": "cuda"}).reward)()
    with pytest.raises(ConfigError, match="reward.device: cuda"):
        reward_factory(config({"type": "judge", "model": reward_model,
                                       "device": "cuda"}).reward)()
    math = reward_factory(config({"type": "math"}).reward)()  # the others: rewards.build_reward
    assert type(math).__name__ == "MathRewardFn"
    math.close()

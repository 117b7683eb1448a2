"""The critic: value alignment, learning the returns, AsyPPO's shards, and exact save/load."""

import pytest
import torch
from tensordict import TensorDict

from reroll.config.algorithm import CriticConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.models.loading import load_model
from reroll.training.critic import LocalCritic, is_saved_critic, load_value_model

pytestmark = pytest.mark.unit


def make_critic(path, **config) -> LocalCritic:
    return LocalCritic(CriticConfig(**config), path, "float32", OptimizerConfig(lr=1e-3),
                  TrainConfig(micro_batch_size=4), total_steps=10)


def value_batch(size: int = 8, width: int = 9, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (size, width), generator=g)
    lengths = torch.randint(5, width + 1, (size,), generator=g)
    attention = (torch.arange(width) < lengths[:, None]).long()
    response = ((torch.arange(width) >= 3) & (attention > 0)).float()
    returns = torch.where(torch.arange(size)[:, None] % 2 == 0, 1.0, -1.0) * response
    return TensorDict({"input_ids": ids, "attention_mask": attention, "response_mask": response,
                       "returns": returns, "index_in_group": torch.arange(size) % 4},
                      batch_size=[size])


def test_a_fresh_critic_shares_the_policy_backbone_and_predicts_zero(tiny_model):
    model = load_value_model(tiny_model)
    policy = load_model(tiny_model)
    assert torch.equal(model.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    batch = value_batch()
    assert torch.all(model(batch["input_ids"], batch["attention_mask"]) == 0)


def test_a_vision_language_model_is_refused_as_the_critic_s_model(tiny_vlm):
    """Its config has no text backbone that AutoModel would give a value head (it used to end
    in an AttributeError on `hidden_size` while the roles were built)."""
    from reroll.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.critic: the critic's model .*tiny-vlm is a "
                                          r"vision-language model"):
        load_value_model(tiny_vlm)


def test_value_at_t_sees_only_the_tokens_before_t(tiny_model):
    model = load_value_model(tiny_model)
    torch.nn.init.normal_(model.value_head.weight)
    ids = torch.randint(3, 500, (1, 8))
    mask = torch.ones_like(ids)
    before = model(ids, mask)
    changed = ids.clone()
    changed[0, 4] = (ids[0, 4] + 1) % 500 + 3
    after = model(changed, mask)
    assert before[0, 0] == 0
    assert torch.allclose(before[:, :5], after[:, :5], atol=1e-6)  # V(s_t) for t <= 4
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_the_critic_learns_the_returns_and_values_are_zero_on_padding(tiny_model):
    critic = make_critic(tiny_model, value_clip=None)
    batch = value_batch()
    mask = batch["response_mask"]

    def mse() -> float:
        values = critic.values(batch)[0]
        return float((((values - batch["returns"]) * mask) ** 2).sum() / mask.sum())

    start = mse()
    for _ in range(8):
        batch["old_values_0"] = critic.values(batch)[0]
        metrics = critic.update(batch, updates_per_batch=2)
    assert mse() < 0.5 * start
    assert {"critic/loss", "critic/grad_norm", "critic/mse", "critic/lr"} <= set(metrics)
    assert torch.all(critic.values(batch)[0][batch["attention_mask"] == 0] == 0)


def test_value_clipping_bounds_the_move_from_the_old_values(tiny_model):
    critic = make_critic(tiny_model, value_clip=0.01)
    batch = value_batch()
    batch["old_values_0"] = critic.values(batch)[0]
    for _ in range(3):  # the clipped loss has no gradient once V is past old +- 0.01
        metrics = critic.update(batch, 1)
    assert metrics["critic/clip_frac"] > 0.5


def test_mini_critics_train_on_disjoint_shares_of_each_group(tiny_model):
    critic = make_critic(tiny_model, num_critics=2)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for m, member in enumerate(critic.members):
        original = member.train_step

        def record(batch, loss_fn, m=m, original=original):
            seen[m] += batch["index_in_group"].tolist()
            return original(batch, loss_fn)

        member.train_step = record
    batch = value_batch()
    values = critic.values(batch)
    batch["old_values_0"], batch["old_values_1"] = values[0], values[1]
    critic.update(batch, updates_per_batch=1)
    assert sorted(seen[0]) == [0, 0, 2, 2] and sorted(seen[1]) == [1, 1, 3, 3]
    after = critic.values(batch)
    assert not torch.allclose(after[0], after[1])  # different data, different critics


def test_save_and_load_restore_the_critic_exactly(tiny_model, tmp_path):
    critic = make_critic(tiny_model, num_critics=2)
    batch = value_batch()
    values = critic.values(batch)
    batch["old_values_0"], batch["old_values_1"] = values[0], values[1]
    critic.update(batch, 1)
    critic.save(tmp_path / "step_1")
    saved = critic.values(batch)
    assert is_saved_critic(tmp_path / "step_1" / "critic_1")
    restored = make_critic(tiny_model, num_critics=2)
    restored.load(tmp_path / "step_1")
    assert torch.equal(restored.values(batch), critic.values(batch))
    a, b = critic.update(batch, 1), restored.update(batch, 1)  # optimizer state came back too
    assert a["critic/loss"] == b["critic/loss"]
    # a saved critic is also a starting point of its own (critic.model_path)
    again = make_critic(tiny_model, model_path=str(tmp_path / "step_1" / "critic_1"))
    assert torch.equal(again.values(batch)[0], saved[1])

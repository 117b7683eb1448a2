"""The critic: value alignment, learning the returns, AsyPPO's shards, and exact save/load."""

import math

import pytest
import torch
from tensordict import TensorDict

from reroll.config.algorithm import CriticConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate
from reroll.data.datasets import load_prompts
from reroll.data.images import write_count_task
from reroll.models.loading import load_model, load_tokenizer
from reroll.rollout.stream import encode_prompt
from reroll.training.critic import LocalCritic, is_saved_critic, load_value_model

pytestmark = pytest.mark.unit


def make_critic(path, micro_batch_size: int = 4, **config) -> LocalCritic:
    return LocalCritic(CriticConfig(**config), path, "float32", OptimizerConfig(lr=1e-3),
                  TrainConfig(micro_batch_size=micro_batch_size), total_steps=10)


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


def image_value_batch(model_path: str, data_dir, blank: bool = False) -> TensorDict:
    """4 counting-task prompts as a run collates them, the first 2 the question alone (a
    text-only micro-batch of 2 from a batch with images), each with a 4-token response and
    returns of +-1; `blank`: every image's pixels white, all else equal."""
    tokenizer = load_tokenizer(model_path)
    rows = load_prompts(write_count_task(data_dir, 4, 1, seed=0)["train"])
    question = [{"role": "user", "content": "How many red squares are there?"}]
    text_ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    trajectories = []
    for i, row in enumerate(rows):
        prompt = encode_prompt(tokenizer, row, 1024)
        ids, inputs = prompt.ids, dict(prompt.model_inputs)
        if i < 2:
            ids, inputs = list(getattr(text_ids, "input_ids", text_ids)), None
        elif blank:
            inputs["pixel_values"] = torch.ones_like(inputs["pixel_values"])
        trajectories.append(Trajectory(ids, [20 + i, 30, 40, 50], [0.0] * 4, "stop",
                                       group_id=0, model_inputs=inputs))
    batch, _ = collate(trajectories, pad_token_id=tokenizer.pad_token_id)
    response = batch["response_mask"].float()
    batch["returns"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * response
    batch["index_in_group"] = torch.arange(4)
    return batch


def test_a_vlm_critic_reads_the_images_and_saves_and_loads_exactly(tiny_vlm, tmp_path):
    """The silent failure: a value head fed the text alone. Same weights and tokens, other
    pixels: other values on the image rows (not on the text rows); micro-batches of 2 put the
    text rows alone in one (no empty pixel values)."""
    critic = make_critic(tiny_vlm, micro_batch_size=2)
    member = critic.members[0]
    torch.nn.init.normal_(member.model.value_head.weight, std=0.1)
    batch = image_value_batch(tiny_vlm, tmp_path / "data")
    blank = image_value_batch(tiny_vlm, tmp_path / "data", blank=True)
    assert torch.equal(batch["input_ids"], blank["input_ids"])
    values, blank_values = critic.values(batch)[0], critic.values(blank)[0]
    mask = batch["response_mask"].bool()
    assert torch.allclose(values[:2][mask[:2]], blank_values[:2][mask[:2]])
    assert (values[2:][mask[2:]] - blank_values[2:][mask[2:]]).abs().max() > 1e-3

    member.model.save_pretrained(tmp_path / "critic")
    assert is_saved_critic(tmp_path / "critic")
    loaded = make_critic(str(tmp_path / "critic"), micro_batch_size=2)
    assert torch.equal(loaded.values(batch), critic.values(batch))


def test_a_vlm_critic_learns_the_returns_of_image_rows(tiny_vlm, tmp_path):
    """Its update passes each micro-batch's images (micro-batches of 2: text rows, image rows):
    the vision tower's weights move, which they would not were the loss fed the text alone."""
    critic = make_critic(tiny_vlm, micro_batch_size=2, value_clip=None)
    vision = critic.members[0].model.backbone.vision_model
    before = [p.detach().clone() for p in vision.parameters()]
    batch = image_value_batch(tiny_vlm, tmp_path / "data")
    losses = []
    for _ in range(3):
        batch["old_values_0"] = critic.values(batch)[0]
        losses.append(critic.update(batch, updates_per_batch=1)["critic/loss"])
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, vision.parameters(), strict=True))


def test_a_text_only_critic_given_images_raises_rather_than_drop_them(tiny_model):
    """A run refuses it at start (tests/data/test_images.py); a direct caller is told too."""
    model = load_value_model(tiny_model)
    batch = value_batch()
    with pytest.raises(ValueError, match="the critic's model is text-only"):
        model(batch["input_ids"], batch["attention_mask"],
              {"pixel_values": torch.zeros(8, 1, 3, 4, 4)})


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

"""Model inputs beyond tokens (an image's pixel values) from the trajectory to the loss: the
batch keeps each sample's inputs with its row, and every forward of the RL step passes them on,
so the loss depends on them (the silent failure this guards against: pixels that never reach
the training forward while the loss looks normal)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reroll.config.algorithm import AlgorithmConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate, model_kwargs, split_micro_batches
from reroll.models.logprobs import forward_logprobs
from reroll.pipelines import objective, rl
from reroll.pipelines.common import UpdateGuard
from reroll.training.local import LocalStrategy

pytestmark = pytest.mark.unit

IMAGE, VOCAB, HIDDEN, PATCH = 3, 16, 8, 4


class PatchLM(torch.nn.Module):
    """A tiny causal LM that, like Qwen2-VL, needs `pixel_values` [all patches of the batch,
    PATCH]: each patch's projection replaces the embedding of one IMAGE token, in row-major
    order (the batch's k-th IMAGE token gets the k-th patch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.vision = torch.nn.Linear(PATCH, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False,
                logits_to_keep=0, pixel_values=None):
        hidden = self.embed(input_ids)
        slots = input_ids == IMAGE
        if int(slots.sum()) != (0 if pixel_values is None else pixel_values.shape[0]):
            raise ValueError(f"{int(slots.sum())} image tokens, pixel_values "
                             f"{None if pixel_values is None else tuple(pixel_values.shape)}")
        if pixel_values is not None:
            hidden = hidden.masked_scatter(slots[..., None], self.vision(pixel_values))
        causal = hidden.cumsum(1) / torch.arange(1, hidden.shape[1] + 1)[None, :, None]
        logits = self.head(torch.tanh(self.mix(causal)))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def trajectories(pixels: list[torch.Tensor | None]) -> list[Trajectory]:
    """One sample per entry: a prompt with one IMAGE token per patch row (none: text only)."""
    out = []
    for i, p in enumerate(pixels):
        prompt = [1] + [IMAGE] * (0 if p is None else p.shape[0]) + [2]
        response = [5 + i % 4, 6, 7 + i % 3]
        out.append(Trajectory(prompt, response, [-1.0] * 3, "stop", group_id=i // 2,
                              reward=float(i % 2),
                              model_inputs=None if p is None else {"pixel_values": p}))
    return out


def patches(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, PATCH, generator=torch.Generator().manual_seed(seed))


def test_collate_keeps_each_sample_s_inputs_and_the_forward_gets_them_concatenated():
    pixels = [patches(2, 0), None, patches(3, 1), patches(1, 2)]
    tensors, _ = collate(trajectories(pixels), pad_token_id=0)
    field = tensors["model_inputs", "pixel_values"]
    assert field["values"].shape == (4, 3, PATCH) and field["sizes"].tolist() == [2, 0, 3, 1]
    # The rule: rows' tensors concatenated along the first dimension, in row order.
    whole = model_kwargs(tensors)["pixel_values"]
    assert torch.equal(whole, torch.cat([pixels[0], pixels[2], pixels[3]]))
    # A micro-batch carries its own rows' inputs, whatever its token width is trimmed to.
    first, second = split_micro_batches(tensors, 2)
    assert torch.equal(model_kwargs(first)["pixel_values"], pixels[0])
    assert torch.equal(model_kwargs(second)["pixel_values"], torch.cat(pixels[2:]))
    assert model_kwargs(collate(trajectories([None]), 0)[0]) == {}


def test_a_micro_batch_of_text_only_rows_from_a_mixed_batch_passes_no_inputs():
    """Not an empty `pixel_values`, which the model's vision tower fails on."""
    pixels = [None, None, patches(2, 0), patches(1, 1)]
    text_only, images = split_micro_batches(collate(trajectories(pixels), 0)[0], 2)
    assert model_kwargs(text_only) == {}
    assert torch.equal(model_kwargs(images)["pixel_values"], torch.cat(pixels[2:]))


def test_inputs_of_mismatched_trailing_shape_are_refused_by_name():
    bad = trajectories([patches(2, 0), None])
    bad[1].model_inputs = {"pixel_values": torch.zeros(2, PATCH + 1)}
    with pytest.raises(ValueError, match="pixel_values"):
        collate(bad, pad_token_id=0)


def learner() -> rl.Learner:
    algorithm = AlgorithmConfig(correction={"tis": {"level": "token"}})
    built = objective.build(algorithm, group_size=2, max_new_tokens=3)
    policy = LocalStrategy(PatchLM(), OptimizerConfig(lr=1e-2),
                           TrainConfig(micro_batch_size=2, num_threads=1), total_steps=2)
    return rl.Learner(built, policy, None, None, built.new_kl_controller(), UpdateGuard(3))


def test_the_rl_step_passes_model_inputs_to_every_forward_and_the_loss_depends_on_them():
    pixels = [patches(2, 0), patches(3, 1), None, patches(1, 2)]
    learn = learner()
    batch, _ = rl.make_batch(trajectories(pixels), learn, pad_token_id=0)
    # pi_old (no-grad, micro-batched) and the loss's forward see the same inputs: ratio 1.
    loss_fn = objective.make_rl_loss(learn.objective, batch)
    loss, _ = loss_fn(learn.policy.model, batch)
    logprobs, _ = forward_logprobs(
        learn.policy.model, batch["input_ids"], batch["attention_mask"],
        response_mask=batch["response_mask"], model_inputs=model_kwargs(batch))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logprobs[mask], batch["old_logprobs"][mask])

    other = trajectories([p if p is None else p + 1.0 for p in pixels])
    changed, _ = rl.make_batch(other, learner(), pad_token_id=0)
    assert not torch.allclose(changed["old_logprobs"][mask], batch["old_logprobs"][mask])
    changed_loss, _ = objective.make_rl_loss(learn.objective, changed)(learn.policy.model, changed)
    assert float(changed_loss.detach()) != pytest.approx(float(loss.detach()), abs=1e-6)

    vision = learn.policy.model.vision.weight.detach().clone()
    metrics = rl.update(batch, learn, step=1)
    assert "train/policy_skipped" not in metrics
    assert not torch.equal(vision, learn.policy.model.vision.weight)  # the gradient reached it

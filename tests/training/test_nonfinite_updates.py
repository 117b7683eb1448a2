"""A non-finite loss or gradient norm skips the optimizer update: weights, optimizer moments and
schedule stay as they were, the skip is reported, the pipeline's guard stops the run after
`train.max_skipped_updates` in a row, and no checkpoint of non-finite weights is written."""

from __future__ import annotations

import pytest
import torch

from reroll.config.errors import RunStopped
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate
from reroll.models.loading import load_model
from reroll.pipelines import objective
from reroll.pipelines.common import UpdateGuard
from reroll.training.local import LocalStrategy

pytestmark = pytest.mark.unit


def small_batch():
    trajectories = [Trajectory([5, 6, 7], [8, 9], [-1.0, -1.0], "stop", group_id=0, reward=1.0)
                    for _ in range(4)]
    batch, _ = collate(trajectories, pad_token_id=0)
    return batch


class InfGrad(torch.autograd.Function):
    """0 in the forward pass; an infinite gradient for its input in the backward pass."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.full_like(x, float("inf"))


def poisoned(loss_fn, how: str):
    """`loss_fn` with its loss made NaN, or its gradient made infinite (the loss stays finite)."""
    def wrapped(model, micro):
        loss, metrics = loss_fn(model, micro)
        if how == "loss":
            return loss * float("nan"), metrics
        return loss + InfGrad.apply(next(model.parameters())), metrics
    return wrapped


def strategy(tiny_model) -> LocalStrategy:
    torch.manual_seed(0)
    return LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=1e-2),
                         TrainConfig(micro_batch_size=2), total_steps=10)


@pytest.mark.parametrize("how", ["loss", "grad"])
def test_a_non_finite_update_is_skipped_and_leaves_the_weights(tiny_model, how):
    s, batch = strategy(tiny_model), small_batch()
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    metrics = s.train_step(batch, poisoned(objective.sft_loss(batch), how))
    assert metrics["train/update_skipped"] == 1.0
    assert metrics["train/nonfinite_loss"] == float(how == "loss")
    assert metrics["train/nonfinite_grad_norm"] == 1.0  # a NaN loss gives a NaN gradient too
    for k, v in s.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not s.optimizer.state and s.scheduler.last_epoch == 0  # no step taken
    assert all(p.grad is None for p in s.model.parameters())
    # The next finite batch trains as usual.
    metrics = s.train_step(batch, objective.sft_loss(batch))
    assert metrics["train/update_skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in s.model.state_dict().items())


def test_the_guard_stops_after_max_skipped_updates_in_a_row():
    guard = UpdateGuard(limit=3)
    skipped = {"train/update_skipped": 1.0, "train/nonfinite_loss": 0.0, "train/loss": 0.5,
               "train/grad_norm": float("nan")}
    fine = {"train/update_skipped": 0.0}
    for step, metrics in enumerate([skipped, skipped, fine, skipped, skipped], start=1):
        guard.check(step, metrics)  # never three in a row
    assert guard.metrics() == {"train/skipped_updates": 4.0}
    with pytest.raises(RunStopped, match=r"step 6: 3 optimizer updates in a row skipped, the "
                                         r"last for a non-finite gradient norm"):
        guard.check(6, skipped)
    with pytest.raises(RunStopped, match="non-finite loss"):
        UpdateGuard(limit=1).check(1, {"train/update_skipped": 1.0, "train/nonfinite_loss": 1.0})


def test_no_checkpoint_of_non_finite_weights_is_written(tiny_model, tmp_path):
    s = strategy(tiny_model)
    with torch.no_grad():
        next(s.model.parameters())[0, 0] = float("nan")
    with pytest.raises(RunStopped, match="holds NaN/inf"):
        s.save(tmp_path / "step_1", {"step": 1})
    assert not (tmp_path / "step_1").exists()

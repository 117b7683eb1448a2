"""`algorithm.epochs`: each pass over the rollout batch is the one-pass update again, against the
same pi_old (PPO epochs)."""

from __future__ import annotations

import pytest
import torch

from reroll.config.schema import RLConfig
from reroll.data.batch import Trajectory
from reroll.pipelines import objective, rl
from reroll.pipelines.common import UpdateGuard
from reroll.pipelines.roles import build_roles

pytestmark = pytest.mark.unit


def learner_for(tiny_model: str, epochs: int) -> tuple[RLConfig, rl.Learner]:
    c = RLConfig(model={"path": tiny_model}, data={"train": "unused"}, steps=2, seed=0,
                 rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
                 algorithm={"epochs": epochs, "correction": {"tis": {"level": "token"}}},
                 optimizer={"lr": 1e-2}, train={"micro_batch_size": 2, "num_threads": 1})
    roles = build_roles(c, total_steps=4, pad_token_id=0)  # the same schedule for both
    built = objective.build(c.algorithm, group_size=2, max_new_tokens=8)
    return c, rl.Learner(built, roles.policy, None, None, built.new_kl_controller(),
                         UpdateGuard(c.train.max_skipped_updates))


def weights(learner: rl.Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.policy.model.parameters()]


def test_two_epochs_are_the_one_pass_update_twice_against_the_first_pi_old(tiny_model):
    trajectories = [Trajectory([5, 6, 7], [8 + i, 9, 10 + i], [-1.0, -1.2, -0.9], "stop",
                               group_id=i // 2, reward=float(i % 2)) for i in range(4)]
    c2, two = learner_for(tiny_model, epochs=2)
    c1, one = learner_for(tiny_model, epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(weights(two), weights(one), strict=True))
    start = weights(one)

    batch, _ = rl.make_batch(trajectories, two, pad_token_id=0)
    metrics = rl.update(batch, two, step=1)
    batch, _ = rl.make_batch(trajectories, one, pad_token_id=0)  # pi_old: the start weights
    rl.update(batch, one, step=1)
    after_one_pass = weights(one)
    rl.update(batch, one, step=1)  # again, against the same pi_old

    assert any(not torch.equal(a, b) for a, b in zip(start, after_one_pass, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(after_one_pass, weights(one), strict=True))
    for a, b in zip(weights(two), weights(one), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "train/policy_skipped" not in metrics

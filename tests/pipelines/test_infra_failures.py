"""Infrastructure failures do not bias learning: an episode whose environment failed
(`env_error`) is out of the loss and out of its group's statistics, so its siblings get the
advantages they would get in a group without it; a group left with fewer than two valid members
is dropped and counted. A failure the policy caused (an invalid action, out of turns) is a
reward like any other."""

import pytest
import torch

from reroll.config.algorithm import AlgorithmConfig
from reroll.data.batch import Trajectory
from reroll.pipelines import objective, rl
from reroll.rollout.metrics import rollout_metrics

pytestmark = pytest.mark.unit

FAILED = None  # an episode whose environment failed


def episode(reward: float | None, group: int) -> Trajectory:
    """A two-turn episode (4 policy tokens, 1 env token between), or one that failed."""
    if reward is FAILED:  # the agent loop's record of it: no policy token, return 0
        return Trajectory([1, 2], [3, 4, 5], [0.0] * 3, "env_error", group, reward=0.0,
                          reward_info={"env_error": "reset raised"}, policy_mask=[0] * 3,
                          turn_ids=[-1] * 3, turn_rewards=[0.0], turn_states=[11])
    return Trajectory([1, 2], [3, 4, 9, 5, 6], [-0.5] * 5, "stop", group, reward=reward,
                      policy_mask=[1, 1, 0, 1, 1], turn_ids=[0, 0, -1, 1, 1],
                      turn_rewards=[0.0, reward], turn_states=[11, 12 + int(reward * 4)])


def advantages(advantage: dict, rewards: list, group_size: int) -> torch.Tensor:
    """Per-token advantages of one batch of episodes (groups of `group_size`)."""
    obj = objective.build(AlgorithmConfig(advantage=advantage), group_size=group_size)
    episodes = [episode(r, i // group_size) for i, r in enumerate(rewards)]
    batch, _ = rl.collate_for_rl(episodes, 0, obj)
    batch, _ = rl.drop_failed_groups(batch, obj)
    return objective.estimate_advantages(obj, batch)[0]


GROUPED = [{"name": "grpo"}, {"name": "grpo", "std": "batch"}, {"name": "dr_grpo"},
           {"name": "lite_ppo"}, {"name": "rloo"}, {"name": "reinforce_pp_baseline"},
           {"name": "reinforce_pp"}, {"name": "gigpo"}, {"name": "rebn"}, {"name": "ipa_chunk"}]


@pytest.mark.parametrize("advantage", GROUPED, ids=lambda a: "-".join(a.values()))
def test_a_group_with_one_env_failure_gives_its_siblings_the_advantages_of_the_group_without_it(
        advantage):
    with_failure = advantages(advantage, [1.0, FAILED, 0.0, 0.5], 4)
    without = advantages(advantage, [1.0, 0.0, 0.5], 3)
    assert torch.allclose(with_failure[[0, 2, 3]], without, atol=1e-5)
    assert with_failure[1].abs().sum() == 0  # the failed episode trains nothing
    assert without.abs().sum() > 0


def test_env_raising_on_every_other_episode_does_not_push_the_survivors():
    # Measured before: the two survivors scoring 1.0 got advantage +0.866.
    adv = advantages({"name": "grpo"}, [1.0, FAILED, 1.0, FAILED], 4)
    assert adv.abs().max() < 1e-6


def test_a_group_left_with_fewer_than_two_valid_members_is_dropped_and_counted():
    obj = objective.build(AlgorithmConfig(), group_size=4)
    rewards = [1.0, FAILED, FAILED, FAILED, 1.0, 0.0, 1.0, 0.0, FAILED, FAILED, FAILED, FAILED]
    batch, _ = rl.collate_for_rl([episode(r, i // 4) for i, r in enumerate(rewards)], 0, obj)
    kept, metrics = rl.drop_failed_groups(batch, obj)
    assert kept["group_ids"].tolist() == [1, 1, 1, 1]
    assert metrics == {"train/infra_groups_dropped": 2.0}
    same, metrics = rl.drop_failed_groups(kept, obj)
    assert same is kept and metrics == {"train/infra_groups_dropped": 0.0}


def test_dynamic_sampling_judges_a_group_on_its_valid_members():
    # The survivors all scored 1.0: no signal, dropped as an all-equal group would be.
    obj = objective.build(AlgorithmConfig(dynamic_sampling={}), group_size=4)
    rewards = [1.0, FAILED, 1.0, 1.0, 1.0, FAILED, 0.0, 1.0]
    batch, _ = rl.collate_for_rl([episode(r, i // 4) for i, r in enumerate(rewards)], 0, obj)
    kept, metrics = rl.filter_groups(batch, obj)
    assert kept["group_ids"].tolist() == [1, 1, 1, 1]
    assert metrics == {"filter/groups_kept": 1.0, "filter/groups_dropped": 1.0}


def test_a_failure_the_policy_caused_stays_a_reward():
    # Out of turns ("truncated") with return 0: a sibling like any other, in the statistics.
    obj = objective.build(AlgorithmConfig(), group_size=2)
    out_of_turns = episode(0.0, 0)
    out_of_turns.finish_reason = "truncated"
    batch, _ = rl.collate_for_rl([episode(1.0, 0), out_of_turns], 0, obj)
    assert batch["valid"].tolist() == [True, True]
    adv = objective.estimate_advantages(obj, batch)[0]
    assert adv[0].max() > 0.7 and adv[1].min() < -0.7


def test_the_steps_reward_statistics_leave_infra_failures_out():
    metrics = rollout_metrics([episode(r, 0) for r in [1.0, FAILED, 0.5, FAILED]], 4)
    assert metrics["train/reward_mean"] == 0.75 and metrics["train/reward_min"] == 0.5

"""Issue 17: the behaviour-policy correction is on by default when samples can be off-policy;
reward shaping reaches every reward an estimator reads; one k3 for the behaviour KL; per-turn
rewards keep their timing; masked tokens stay in the loss normaliser."""

import logging
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.agentic import AgenticConfig
from reroll.config.algorithm import AlgorithmConfig, TISConfig
from reroll.config.schema import RLConfig
from reroll.data.batch import RLBatch
from reroll.pipelines import objective
from reroll.pipelines import rl as pipeline

pytestmark = pytest.mark.unit

BASE = {"steps": 1, "model": {"path": "m"}, "data": {"train": "t.jsonl"}}


def rl(**sections) -> RLConfig:
    return RLConfig.model_validate(BASE | sections)


def rl_batch(fields: dict) -> RLBatch:
    """The RL batch of these fields, the ones the test does not care about made up (token ids
    0, every position attended, behaviour logprobs 0, one group per sample)."""
    mask = fields["response_mask"]
    size, width = mask.shape
    made = {"input_ids": torch.zeros(size, width, dtype=torch.long),
            "attention_mask": torch.ones(size, width, dtype=torch.long),
            "behaviour_logprobs": torch.zeros(size, width), "rewards": torch.zeros(size),
            "group_ids": torch.arange(size)}
    return RLBatch.derived(TensorDict(made | fields, batch_size=[size]))


# ----------------------------------------------------------------------------- 1. correction


@pytest.mark.parametrize("sections", [
    {"async_training": {"enabled": True, "max_staleness": 2}},
    {"rollout": {"engine": "vllm"}},
], ids=["async", "vllm"])
def test_off_policy_samples_get_token_tis_by_default(sections):
    config = rl(**sections)
    assert config.off_policy_reasons()
    assert config.algorithm.correction.tis == TISConfig(level="token", cap=2.0)
    assert objective.build(config.algorithm).needs_old_logprobs
    # the resolved config (what config.yaml holds) loads to the same correction
    again = RLConfig.model_validate(config.model_dump(mode="json"))
    assert again.algorithm.correction == config.algorithm.correction


def test_on_policy_runs_and_explicit_choices_are_left_alone():
    assert rl().algorithm.correction.tis is None and not rl().off_policy_reasons()
    on = {"async_training": {"enabled": True}}
    for off in ("none", None):
        config = rl(**on, algorithm={"correction": off})
        assert config.algorithm.correction.tis is None and not config.algorithm.correction.auto
    mine = rl(**on, algorithm={"correction": {"tis": {"level": "sequence", "cap": 1.2}}})
    assert mine.algorithm.correction.tis == TISConfig(level="sequence", cap=1.2)
    masked = rl(**on, algorithm={"correction": {"ratio_mask": {}}})
    assert masked.algorithm.correction.tis is None  # a ratio mask is a correction already
    decoupled = rl(**on, algorithm={"policy_loss": {"name": "decoupled_ppo"}})
    assert decoupled.algorithm.correction.tis is None  # it weights by pi_old / mu itself
    agentic = AgenticConfig.model_validate({"pipeline": "agentic", "steps": 1,
                                            "model": {"path": "m"}, "env": {"id": "x"},
                                            "rollout": {"engine": "vllm"}})
    assert agentic.algorithm.correction.tis is not None


def test_turning_the_correction_off_is_logged(caplog):
    config = rl(async_training={"enabled": True, "max_staleness": 3},
                algorithm={"correction": "none"})
    with caplog.at_level(logging.WARNING):
        message = objective.announce_correction(config.algorithm, config.off_policy_reasons())
    assert "algorithm.correction: none" in message and "3 versions old" in message
    assert message in caplog.text
    assert objective.announce_correction(rl().algorithm, rl().off_policy_reasons()) is None
    auto = rl(async_training={"enabled": True})
    assert "truncated IS (token, cap 2.0)" in objective.announce_correction(
        auto.algorithm, auto.off_policy_reasons())


def test_async_default_applies_is_weights_that_are_not_all_one():
    config = rl(async_training={"enabled": True, "max_staleness": 2}).algorithm
    mask = torch.ones(2, 4)
    behaviour = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.4], [0.3, 0.3, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.6, 0.1], [0.3, 0.9, 0.3, 0.3]]))
    batch = TensorDict({"old_logprobs": old, "behaviour_logprobs": behaviour,
                        "response_mask": mask, "loss_mask": mask.clone(),
                        "turn_ids": torch.zeros(2, 4, dtype=torch.long)}, [2])
    metrics = objective.apply_corrections(config.correction, batch)
    want = torch.tensor([[1.0, 2.0, 2 / 3, 0.25], [1.0, 2.0, 1.0, 1.0]])  # min(old/mu, 2)
    torch.testing.assert_close(batch["is_weights"], want)
    assert metrics["correction/tis_weight_mean"] == pytest.approx(float(want.mean()))


# ----------------------------------------------------------------------------- 3. behaviour k3


class ConstantLM(torch.nn.Module):
    """The same next-token distribution softmax(logits) at every position."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False,
                logits_to_keep=0):
        out = self.logits.expand(*input_ids.shape, -1)
        return SimpleNamespace(logits=out[:, -logits_to_keep:])


def test_actor_behaviour_kl_k3_is_kl_mu_pi_old_on_tokens_sampled_from_mu():
    g = torch.Generator().manual_seed(0)
    log_mu = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    log_pi = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    true_kl = float((log_mu.exp() * (log_mu - log_pi)).sum())
    rows, width = 200, 1001  # 200k response tokens after a one-token prompt
    ids = torch.multinomial(log_mu.exp(), rows * width, replacement=True, generator=g)
    ids = ids.reshape(rows, width)
    response = torch.ones(rows, width)
    response[:, 0] = 0
    batch = rl_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "response_mask": response, "behaviour_logprobs": log_mu[ids] * response})
    loss_fn = objective.make_rl_loss(objective.build(
        AlgorithmConfig(policy_loss={"name": "reinforce"}), max_new_tokens=width), batch)
    _, metrics = loss_fn(ConstantLM(log_pi), batch)
    assert metrics["actor/behaviour_kl_k3"] == pytest.approx(true_kl, abs=0.01)
    old = log_pi[ids] * response
    shared = algorithms.off_policy_metrics(old, batch["behaviour_logprobs"], response)
    assert metrics["actor/behaviour_kl_k3"] == pytest.approx(float(shared["behaviour_kl_k3"]),
                                                             rel=1e-4)


# ----------------------------------------------------------------------------- 2. shaping

# Six two-turn episodes (group_size 3), 8 response positions: turn 0, an env token, turn 1.
# Turn lengths (tokens): row r's turn 0 has TURN0[r] tokens, turn 1 has TURN1[r].
TURN_REWARDS = [[0.0, 5.0], [0.0, -5.0], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0], [0.2, 3.0]]
TURN0, TURN1 = [2, 3, 4, 1, 2, 4], [4, 1, 2, 3, 2, 3]
ESTIMATORS = {
    "grpo": {}, "dr_grpo": {}, "lite_ppo": {}, "rloo": {},
    "reinforce_pp": {"gamma": 0.9}, "reinforce_pp_baseline": {"gamma": 0.9},
    "gae": {"gamma": 0.9, "lam": 0.8}, "rebn": {"gamma": 0.9}, "gigpo": {"gamma": 0.9},
    "ipa_chunk": {"gamma": 0.9},
}


def episode_batch(turn_rewards, rewards=None) -> TensorDict:
    turn_ids = torch.full((6, 10), -1, dtype=torch.long)
    for r, (a, b) in enumerate(zip(TURN0, TURN1, strict=True)):
        turn_ids[r, :a] = 0
        turn_ids[r, a + 1 : a + 1 + b] = 1  # position a is the env token
    turn_rewards = torch.tensor(turn_rewards)
    rewards = turn_rewards.sum(-1) if rewards is None else torch.tensor(rewards)
    g = torch.Generator().manual_seed(1)
    mask = (turn_ids >= 0).float()
    return rl_batch({"rewards": rewards, "turn_rewards": turn_rewards, "turn_ids": turn_ids,
                     "response_mask": mask, "values": torch.randn(6, 10, generator=g) * mask,
                     "state_ids": torch.tensor([[0, 1]] * 6)})


def estimate(name: str, batch: TensorDict, **extra) -> torch.Tensor:
    config = AlgorithmConfig(advantage={"name": name, **ESTIMATORS[name]},
                             critic={} if name == "gae" else None, **extra)
    return objective.estimate_advantages(objective.build(config, group_size=3), batch)[0]


@pytest.mark.parametrize("name", ESTIMATORS)
def test_reward_clip_reaches_the_reward_each_estimator_reads(name):
    batch = episode_batch(TURN_REWARDS)
    clipped = estimate(name, batch, normalize={"reward_clip": [-1.0, 1.0]})
    # by hand: each turn's reward clipped (turn-level and token-level estimators), and each
    # episode's summed reward clipped (outcome estimators)
    by_hand = episode_batch([[0.0, 1.0], [0.0, -1.0], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0],
                             [0.2, 1.0]], rewards=[1.0, -1.0, 0.5, 1.0, 0.0, 1.0])
    torch.testing.assert_close(clipped, estimate(name, by_hand))
    assert not torch.allclose(clipped, estimate(name, batch), atol=1e-3)  # the clip did bite


@pytest.mark.parametrize("name", ESTIMATORS)
def test_overlong_penalty_reaches_the_reward_each_estimator_reads(name):
    batch = episode_batch(TURN_REWARDS)
    config = AlgorithmConfig(overlong={"soft_penalty_cache": 2, "soft_penalty": 1.0})
    metrics = pipeline.shape_rewards(batch, objective.build(config, max_new_tokens=4))
    # a turn's limit is 4 tokens, cache 2: lengths <= 2 -> 0, 3 -> -0.5, 4 -> -1
    penalty = [[0.0, -1.0], [-0.5, 0.0], [-1.0, 0.0], [0.0, -0.5], [0.0, 0.0], [-1.0, -0.5]]
    shaped = [[r + p for r, p in zip(rs, ps, strict=True)]
              for rs, ps in zip(TURN_REWARDS, penalty, strict=True)]
    torch.testing.assert_close(batch["turn_rewards"], torch.tensor(shaped))
    torch.testing.assert_close(batch["rewards"], torch.tensor(shaped).sum(-1))
    assert metrics["train/overlong_penalty_mean"] == pytest.approx(-4.5 / 6)
    torch.testing.assert_close(estimate(name, batch), estimate(name, episode_batch(shaped)))
    plain = estimate(name, episode_batch(TURN_REWARDS))
    assert not torch.allclose(estimate(name, batch), plain, atol=1e-3)


def test_single_turn_overlong_penalty_is_unchanged():
    # one turn = the whole response: DAPO's penalty on the response length, as before
    mask = torch.tensor([[1.0] * 3 + [0.0] * 3, [1.0] * 6])
    batch = rl_batch({"rewards": torch.tensor([1.0, 1.0]), "response_mask": mask})
    pipeline.shape_rewards(batch, objective.build(
        AlgorithmConfig(overlong={"soft_penalty_cache": 3}), max_new_tokens=6))
    torch.testing.assert_close(batch["rewards"], torch.tensor([1.0, 0.0]))  # 3 -> 0, 6 -> -1


# ----------------------------------------------------------------------------- 4. turn timing


def test_per_turn_rewards_land_on_each_turn_s_last_token_for_token_level_estimators():
    # turn 0 = positions 0, 1; env token at 2; turn 1 = position 3. Turn rewards (1, 2), gamma 0.5:
    # G_3 = 2, G_1 = 1 + 0.5 * 2 = 2, G_0 = 0.5 * 2 = 1 (the env token does not discount).
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    mask = (turn_ids >= 0).float()
    batch = rl_batch({"rewards": torch.tensor([3.0]), "turn_rewards": torch.tensor([[1.0, 2.0]]),
                      "turn_ids": turn_ids, "response_mask": mask, "values": torch.zeros(1, 4)})
    _, returns = objective.estimate_advantages(objective.build(
        AlgorithmConfig(advantage={"name": "reinforce_pp", "gamma": 0.5})), batch)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 2.0, 0.0, 2.0]]))
    _, returns = objective.estimate_advantages(objective.build(
        AlgorithmConfig(advantage={"name": "gae", "gamma": 0.5, "lam": 1.0, "whiten": False},
                        critic={})), batch)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 2.0, 0.0, 2.0]]))


# ----------------------------------------------------------------------------- 4. normaliser


def test_ratio_masked_tokens_stay_in_the_loss_normaliser():
    # IcePop's objective divides by every sampled token (1 / sum |y_i|): a masked token weighs 0
    # but still counts; the overlong filter (normaliser_mask) removes the sample from the count.
    ids = torch.tensor([[1, 2, 3, 4], [1, 3, 2, 4]])
    response = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    loss_mask = response.clone()
    loss_mask[0, 2] = 0  # ratio-masked
    batch = rl_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "response_mask": response, "loss_mask": loss_mask,
                      "normaliser_mask": response.clone(),
                      "advantages": torch.ones(2, 4) * response})
    model = ConstantLM(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]))
    loss, _ = objective.make_rl_loss(objective.build(
        AlgorithmConfig(policy_loss={"name": "reinforce"}), max_new_tokens=4), batch)(model, batch)
    logp = torch.log_softmax(model.logits.detach(), -1)[ids] * response
    assert float(loss) == pytest.approx(float(-(logp * loss_mask).sum() / 6))

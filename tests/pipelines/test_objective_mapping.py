"""The config -> function mapping of `reroll.pipelines.objective` and `step`: each config
calls the right pure function with the right knobs, with values checked by hand where the
mapping itself decides something (KL in the reward, turn inputs, normalisation order, masks)."""

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.algorithm import AlgorithmConfig, AsyPPOConfig, KLConfig
from reroll.data.batch import RLBatch, Trajectory
from reroll.models.logprobs import forward_logprobs
from reroll.pipelines import objective, rl

pytestmark = pytest.mark.unit


def batch_of(rewards, mask, **extra) -> TensorDict:
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.tensor(mask, dtype=torch.float32)
    size, width = mask.shape
    data = {"rewards": rewards, "response_mask": mask, "group_ids": torch.arange(size),
            "input_ids": torch.zeros(size, width, dtype=torch.long),
            "attention_mask": torch.ones(size, width, dtype=torch.long),
            "behaviour_logprobs": torch.zeros(size, width), **extra}
    return RLBatch.derived(TensorDict(data, batch_size=[size]))


KL_IN_REWARD = {"kl": {"coef": 0.1, "mode": "reward"}}


def advantages(algorithm: dict, batch, group_size, kl_coef=0.0):
    built = objective.build(AlgorithmConfig(**algorithm), group_size=group_size)
    return objective.estimate_advantages(built, batch, kl_coef=kl_coef)


# ----------------------------------------------------------------------------- advantages

ONE_RIGHT = [1.0, 0.0, 0.0, 0.0]
MASK4 = [[1, 1, 0]] * 4


def test_grpo_by_hand():
    # mean 0.25, unbiased std 0.5 -> (1.5, -0.5, -0.5, -0.5) on every response token
    adv, _ = advantages({}, batch_of(ONE_RIGHT, MASK4), 4)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5])[:, None] * torch.tensor([1.0, 1.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-5)


@pytest.mark.parametrize(("advantage", "per_sample"), [
    ({"name": "dr_grpo"}, [0.75, -0.25, -0.25, -0.25]),
    ({"name": "rloo"}, [1.0, -1 / 3, -1 / 3, -1 / 3]),
    ({"name": "grpo", "mean": "group", "std": "none"}, [0.75, -0.25, -0.25, -0.25]),
    ({"name": "grpo", "mean": "none", "std": "none"}, ONE_RIGHT),
])
def test_outcome_estimators_by_hand(advantage, per_sample):
    adv, returns = advantages({"advantage": advantage}, batch_of(ONE_RIGHT, MASK4), 4)
    assert returns is None
    assert torch.allclose(adv[:, 0], torch.tensor(per_sample), atol=1e-5)
    assert torch.all(adv[:, 2] == 0)


def test_lite_ppo_is_group_mean_over_batch_std():
    batch = batch_of([1.0, 0.0, 1.0, 1.0], MASK4)
    lite, _ = advantages({"advantage": {"name": "lite_ppo"}}, batch, 2)
    # group means 0.5 and 1.0; batch std of (1, 0, 1, 1) = 0.5
    assert torch.allclose(lite[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-4)
    grpo, _ = advantages({"advantage": {"name": "grpo", "std": "batch"}}, batch, 2)
    assert torch.allclose(lite, grpo)


def test_kl_reward_penalty_reaches_outcome_estimators_as_a_sequence_sum():
    kl = torch.tensor([[0.5, 0.5, 9.0], [0.0, 1.0, 9.0]])  # the 9s are off the response
    batch = batch_of([1.0, 1.0], [[1, 1, 0], [1, 1, 0]], token_kl=kl)
    # scores: 1 - 0.1 * 1.0 = 0.9 and 1 - 0.1 * 1.0 = 0.9 -> equal, advantage 0
    dr_grpo = {"advantage": {"name": "dr_grpo"}} | KL_IN_REWARD
    adv, _ = advantages(dr_grpo, batch, 2, kl_coef=0.1)
    assert torch.allclose(adv, torch.zeros(2, 3))
    batch["token_kl"] = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, _ = advantages(dr_grpo, batch, 2, kl_coef=0.1)
    assert torch.allclose(adv[:, 0], torch.tensor([0.1, -0.1]))
    # without a coefficient (the controller's value) the penalty is ignored even when present
    adv, _ = advantages(dr_grpo, batch, 2, kl_coef=0.0)
    assert torch.allclose(adv, torch.zeros(2, 3))
    # in kl.mode loss the penalty is not a reward's
    adv, _ = advantages({"advantage": {"name": "dr_grpo"}}, batch, 2, kl_coef=0.1)
    assert torch.allclose(adv, torch.zeros(2, 3))


def test_gae_by_hand_with_kl_in_the_token_rewards():
    # one response of two tokens after a prompt token: V = (0.5, 0.2), score 1 on the last token
    batch = batch_of([1.0], [[0, 1, 1]], values=torch.tensor([[9.0, 0.5, 0.2]]),
                     token_kl=torch.tensor([[0.0, 1.0, 0.0]]))
    config = {"advantage": {"name": "gae", "gamma": 1.0, "lam": 0.5, "whiten": False},
              "critic": {}} | KL_IN_REWARD
    adv, returns = advantages(config, batch, 1)
    # delta_2 = 1 - 0.2 = 0.8; delta_1 = 0.2 - 0.5 = -0.3; A_1 = -0.3 + 0.5 * 0.8 = 0.1
    assert torch.allclose(adv, torch.tensor([[0.0, 0.1, 0.8]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.0, 0.6, 1.0]]), atol=1e-6)
    adv, _ = advantages(config, batch, 1, kl_coef=0.5)  # r_1 = -0.5: delta_1 = -0.8
    assert torch.allclose(adv, torch.tensor([[0.0, -0.4, 0.8]]), atol=1e-6)


def test_reinforce_pp_takes_the_kl_penalty_per_token():
    kl = torch.tensor([[0.2, 0.0], [0.0, 0.0]])
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 1]], token_kl=kl)
    adv, returns = advantages({"advantage": {"name": "reinforce_pp"}} | KL_IN_REWARD, batch, 1,
                              kl_coef=1.0)
    assert torch.allclose(returns, torch.tensor([[0.8, 1.0], [0.0, 0.0]]))
    assert torch.allclose(adv, algorithms.masked_whiten(returns, batch["response_mask"]))


def test_multi_turn_estimators_on_single_turn_responses():
    batch = batch_of([1.0, 0.0, 0.0, 1.0], MASK4)
    grpo, _ = advantages({}, batch, 2)
    gigpo, _ = advantages({"advantage": {"name": "gigpo", "step_weight": 0.5}}, batch, 2)
    assert torch.allclose(gigpo, 1.5 * grpo, atol=1e-5)  # one turn: step group = episode group
    rebn, _ = advantages({"advantage": {"name": "rebn"}}, batch, 2)
    assert torch.allclose(rebn[:, 0], (batch["rewards"] - 0.5) / batch["rewards"].std(), atol=1e-4)
    ipa, returns = advantages({"advantage": {"name": "ipa_chunk"}}, batch, 2)
    assert torch.allclose(ipa, batch["rewards"][:, None] * batch["response_mask"])


def test_multi_turn_inputs_from_turn_ids():
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1]])
    mask = (turn_ids >= 0).float()
    config = {"advantage": {"name": "ipa_chunk", "gamma": 0.5}} | KL_IN_REWARD
    # explicit per-turn rewards (1, 2): G_1 = 2, G_0 = 1 + 0.5 * 2 = 2
    batch = batch_of([3.0], mask.tolist(), turn_ids=turn_ids,
                     turn_rewards=torch.tensor([[1.0, 2.0]]))
    adv, _ = advantages(config, batch, 1)
    assert torch.allclose(adv, torch.tensor([[0.0, 2.0, 2.0, 0.0, 2.0]]))
    # the scalar reward on the last turn: G = (1.5, 3)
    batch["turn_rewards"] = torch.tensor([[0.0, 3.0]])
    adv, _ = advantages(config, batch, 1)
    assert torch.allclose(adv, torch.tensor([[0.0, 1.5, 1.5, 0.0, 3.0]]))
    # a KL penalty is summed over each turn's tokens: turn 0 loses 0.2 + 0.2
    batch["token_kl"] = torch.tensor([[5.0, 0.2, 0.2, 5.0, 0.0]])
    adv, _ = advantages(config, batch, 1, kl_coef=1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 1.1, 1.1, 0.0, 3.0]]), atol=1e-6)


def test_normalisation_order_clip_rewards_then_whiten_then_clip_advantages():
    batch = batch_of([5.0, 0.0, 0.0, 0.0], MASK4)
    adv, _ = advantages({"advantage": {"name": "dr_grpo"},
                         "normalize": {"reward_clip": [0, 1]}}, batch, 4)
    assert torch.allclose(adv[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert float(batch["rewards"][0]) == 5.0  # the batch itself is left alone
    adv, _ = advantages({"advantage": {"name": "dr_grpo"},
                         "normalize": {"whiten_advantages": True, "advantage_clip": 1.0}}, batch, 4)
    whitened = algorithms.masked_whiten(torch.tensor([3.75, -1.25, -1.25, -1.25])[:, None]
                                        .expand(4, 3) * batch["response_mask"],
                                        batch["response_mask"])
    assert torch.allclose(adv, whitened.clamp(-1, 1) * batch["response_mask"], atol=1e-5)
    assert float(adv.max()) == 1.0


# ----------------------------------------------------------------------------- losses


class FakeLM(torch.nn.Module):
    """logits = table[token]: enough of a causal LM for `forward_logprobs`."""

    def __init__(self, vocab: int = 13, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False,
                logits_to_keep=0):  # transformers' convention: 0 keeps every position
        return SimpleNamespace(logits=self.table[input_ids][:, -logits_to_keep:])


def loss_batch(seed: int = 0, size: int = 6, width: int = 7) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (size, width), generator=g)
    lengths = torch.randint(4, width + 1, (size,), generator=g)
    attention = (torch.arange(width) < lengths[:, None]).long()
    response = ((torch.arange(width) >= 2) & (attention > 0)).float()
    noise = lambda: 0.3 * torch.randn(size, width, generator=g) * response  # noqa: E731
    logprobs, _ = forward_logprobs(FakeLM(), ids, attention)
    turn_ids = torch.where(response > 0, (torch.arange(width) >= 4).long(), -1)
    loss_mask = response * (torch.rand(size, width, generator=g) > 0.2)
    return RLBatch.derived(TensorDict({
        "input_ids": ids, "attention_mask": attention, "response_mask": response,
        "rewards": torch.zeros(size), "group_ids": torch.arange(size),
        "loss_mask": loss_mask, "normaliser_mask": loss_mask.clone(),
        "advantages": torch.randn(size, width, generator=g) * response,
        "old_logprobs": (logprobs.detach() + noise()) * response,
        "behaviour_logprobs": (logprobs.detach() + noise()) * response,
        "ref_logprobs": (logprobs.detach() + noise()) * response,
        "is_weights": torch.rand(size, width, generator=g) * response,
        "entropy_mask": response * (torch.rand(size, width, generator=g) > 0.3),
        "turn_ids": turn_ids, "turn_rewards": torch.zeros(size, 2),
    }, batch_size=[size]))


def loss_objective(algorithm: dict | None = None) -> objective.Objective:
    """The objective of `algorithm` reading the batch's old logprobs (two updates per batch)
    and, but for decoupled_ppo (which weights by itself), its truncated IS weights."""
    algorithm = {"updates_per_batch": 2} | (algorithm or {})
    if algorithm.get("policy_loss", {}).get("name") != "decoupled_ppo":
        algorithm = {"correction": {"tis": {}}} | algorithm
    return objective.build(AlgorithmConfig(**algorithm), max_new_tokens=9)


LOSS_CONFIGS = [
    {"policy_loss": {"name": "ppo", "clip_low": 0.1, "clip_high": 0.3, "dual_clip": 2.0}},
    {"policy_loss": {"name": "gspo", "clip_low": 0.01, "clip_high": 0.02}},
    {"policy_loss": {"name": "cispo", "clip_low": 0.5, "clip_high": 0.1}},
    {"policy_loss": {"name": "topr", "sequence_ratio": True}},
    {"policy_loss": {"name": "reinforce"}, "loss_agg": "seq_mean_token_sum_norm"},
    {"policy_loss": {"name": "decoupled_ppo", "behaviour_cap": 1.1}},
    {"policy_loss": {"name": "ipa_chunk", "clip_low": 0.05}},
]


@pytest.mark.parametrize("algorithm", LOSS_CONFIGS, ids=lambda a: a["policy_loss"]["name"])
def test_each_policy_loss_config_calls_its_function_with_its_knobs(algorithm):
    config = AlgorithmConfig(**algorithm)
    batch = loss_batch()
    model = FakeLM()
    loss, metrics = objective.make_rl_loss(loss_objective(algorithm), batch)(model, batch)
    logprobs, _ = forward_logprobs(model, batch["input_ids"], batch["attention_mask"])
    knobs = {k: v for k, v in algorithm["policy_loss"].items() if k != "name"}
    name = config.policy_loss.name
    if name == "decoupled_ppo":
        knobs["behaviour_logprobs"] = batch["behaviour_logprobs"]
        weights = None
    elif name == "ipa_chunk":
        knobs["turn_ids"] = batch["turn_ids"]
        weights = batch["is_weights"]
    else:
        weights = batch["is_weights"]
    mask = batch["loss_mask"]
    num_tokens, num_seqs = algorithms.loss_normalisers(mask)
    if name == "ipa_chunk":
        num_tokens = algorithms.chunk_count(batch["turn_ids"], mask)
    expected, _ = objective.POLICY_LOSSES[name][0](
        logprobs, batch["old_logprobs"], batch["advantages"], mask, **knobs, is_weights=weights,
        agg=config.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=9)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert "actor/ratio_mean" in metrics and "actor/entropy" in metrics


def test_reinforce_on_policy_by_hand():
    batch = loss_batch()
    batch["loss_mask"] = batch["normaliser_mask"] = batch["response_mask"]
    config = AlgorithmConfig(policy_loss={"name": "reinforce"})  # reads no old logprobs, no IS
    model = FakeLM()
    loss, metrics = objective.make_rl_loss(objective.build(config, max_new_tokens=9),
                                           batch)(model, batch)
    logprobs, _ = forward_logprobs(model, batch["input_ids"], batch["attention_mask"])
    mask = batch["response_mask"]
    assert torch.allclose(loss, -(batch["advantages"] * logprobs * mask).sum() / mask.sum())
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0)


def test_kl_term_is_in_the_loss_only_in_loss_mode_and_entropy_uses_its_mask():
    batch, model = loss_batch(), FakeLM()
    plain, _ = objective.make_rl_loss(loss_objective(), batch)(model, batch)
    logprobs, entropy = forward_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                         with_entropy=True)
    mask = batch["loss_mask"]
    kl = algorithms.kl_estimate(logprobs, batch["ref_logprobs"], "k2")
    with_kl = loss_objective({"kl": {"coef": 0.3, "estimator": "k2"}})
    loss, metrics = objective.make_rl_loss(with_kl, batch)(model, batch)
    assert torch.allclose(loss, plain + 0.3 * (kl * mask).sum() / mask.sum(), atol=1e-6)
    assert "actor/kl_ref" in metrics
    # the controller's current value replaces the configured coefficient
    loss, _ = objective.make_rl_loss(with_kl, batch, kl_coef=0.1)(model, batch)
    assert torch.allclose(loss, plain + 0.1 * (kl * mask).sum() / mask.sum(), atol=1e-6)
    in_reward = loss_objective({"kl": {"coef": 0.3, "mode": "reward"}})
    loss, metrics = objective.make_rl_loss(in_reward, batch)(model, batch)
    assert torch.allclose(loss, plain) and "actor/kl_ref" not in metrics
    bonus = loss_objective({"entropy_coef": 0.2})
    loss, _ = objective.make_rl_loss(bonus, batch)(model, batch)
    # the bonus is over the entropy mask's tokens, normalised by the loss normaliser's count
    emask = batch["entropy_mask"]
    assert torch.allclose(loss, plain - 0.2 * (entropy * emask).sum() / mask.sum(), atol=1e-6)


@pytest.mark.parametrize("algorithm", LOSS_CONFIGS + [
    {"loss_agg": "seq_mean_token_mean", "kl": {"coef": 0.1}, "entropy_coef": 0.01}],
    ids=lambda a: a.get("policy_loss", {"name": "ppo+kl+entropy"})["name"])
def test_micro_batch_losses_add_up_to_the_full_batch_loss(algorithm):
    batch, model = loss_batch(seed=3, size=8), FakeLM()
    loss_fn = objective.make_rl_loss(loss_objective(algorithm), batch)
    full, _ = loss_fn(model, batch)
    parts = sum(loss_fn(model, batch[i : i + 3])[0] for i in range(0, 8, 3))
    assert torch.allclose(parts, full, atol=1e-6)


# ----------------------------------------------------------------------------- KL, AsyPPO


def test_adaptive_kl_controller_moves_towards_its_target():
    controller = objective.kl_controller(KLConfig(coef=0.1, controller={
        "name": "adaptive", "target": 0.05, "horizon": 100}))
    controller.update(0.5, 50)  # KL 10x the target: error clipped to 0.2 -> x (1 + 0.2 * 0.5)
    assert controller.value == pytest.approx(0.11)
    fixed = objective.kl_controller(KLConfig(coef=0.1))
    fixed.update(0.5, 50)
    assert fixed.value == 0.1


def test_asyppo_masks_by_hand():
    # critic stds per token: |V1 - V2| / 2 = 0, 1, 2, 3, 4 on five response tokens
    v1 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    v2 = torch.tensor([[0.0, 0.0, 2.0, 4.0, 6.0, 8.0]])
    response = torch.tensor([[0.0, 1, 1, 1, 1, 1]])
    policy, entropy, metrics = objective.asyppo_masks(
        AsyPPOConfig(advantage_mask_quantile=0.25, entropy_mask_quantile=0.75),
        torch.stack([v1, v2]), response, response)
    # quantiles of (0, 1, 2, 3, 4): 25% -> 1, 75% -> 3
    assert policy.tolist() == [[0, 0, 1, 1, 1, 1]]
    assert entropy.tolist() == [[0, 1, 1, 1, 1, 0]]
    assert metrics["critic/advantage_masked_frac"] == pytest.approx(0.2)
    off = AsyPPOConfig(advantage_mask_quantile=0.0, entropy_mask_quantile=1.0)
    policy, entropy, _ = objective.asyppo_masks(off, torch.stack([v1, v2]), response, response)
    assert torch.equal(policy, response) and torch.equal(entropy, response)


def test_old_logprobs_are_computed_only_when_something_reads_them():
    assert not objective.build(AlgorithmConfig()).needs_old_logprobs
    assert not objective.build(AlgorithmConfig(kl={"coef": 0.1})).needs_old_logprobs
    for algorithm in ({"updates_per_batch": 2}, {"epochs": 2}, {"policy_loss": {"name": "decoupled_ppo"}},
                      {"correction": {"tis": {}}}, {"correction": {"ratio_mask": {}}},
                      {"kl": {"coef": 0.1, "mode": "reward"}}):
        assert objective.build(AlgorithmConfig(**algorithm)).needs_old_logprobs, algorithm


# ----------------------------------------------------------------------------- batch shaping


def trajectories(rewards, lengths, finish=None):
    return [Trajectory([1, 2], list(range(3, 3 + n)), [-0.5] * n,
                       (finish or ["stop"] * len(rewards))[i], group_id=i // 2, reward=r)
            for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]


def test_collate_applies_the_soft_overlong_penalty_and_the_overlong_filter():
    config = AlgorithmConfig(overlong={"filter": True, "soft_penalty_cache": 4,
                                       "soft_penalty": 1.0})
    # max 10 tokens, cache 4: lengths 6 -> 0, 8 -> -0.5, 10 -> -1
    batch, metrics = rl.collate_for_rl(
        trajectories([1.0, 1.0, 0.0, 0.0], [6, 8, 10, 3], ["stop", "stop", "length", "stop"]),
        0, objective.build(config, group_size=2, max_new_tokens=10))
    assert batch["rewards"].tolist() == [1.0, 0.5, -1.0, 0.0]
    assert batch["task_rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch["loss_mask"][2].sum() == 0 and batch["loss_mask"][1].sum() == 8
    assert batch["turn_ids"][0].tolist() == [-1, -1] + [0] * 6 + [-1] * 4
    assert batch["index_in_group"].tolist() == [0, 1, 0, 1]
    assert metrics["filter/overlong_dropped"] == 1.0


def test_dynamic_sampling_drops_whole_groups_judged_on_the_task_reward():
    batch, _ = rl.collate_for_rl(trajectories([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [3] * 6),
                                 0, objective.build(AlgorithmConfig(), group_size=2))
    sampling = objective.build(AlgorithmConfig(dynamic_sampling={}), group_size=2)
    kept, metrics = rl.filter_groups(batch, sampling)
    assert kept.batch_size[0] == 2 and kept["task_rewards"].tolist() == [1.0, 0.0]
    assert isinstance(kept, RLBatch)
    assert metrics == {"filter/groups_kept": 1.0, "filter/groups_dropped": 2.0}
    same, metrics = rl.filter_groups(batch, objective.build(AlgorithmConfig(), group_size=2))
    assert same is batch and metrics == {}


def test_corrections_mask_then_weight():
    mask = torch.ones(2, 3)
    behaviour = torch.zeros(2, 3)
    old = torch.log(torch.tensor([[1.0, 3.0, 1.5], [1.0, 1.0, 1.0]]))
    batch = TensorDict({"old_logprobs": old, "behaviour_logprobs": behaviour,
                        "response_mask": mask, "loss_mask": mask.clone(),
                        "turn_ids": torch.zeros(2, 3, dtype=torch.long)}, [2])
    config = AlgorithmConfig(correction={"ratio_mask": {"level": "token", "low": 0.5, "high": 2.0},
                                         "tis": {"level": "token", "cap": 1.2}}).correction
    metrics = objective.apply_corrections(config, batch)
    assert batch["loss_mask"].tolist() == [[1, 0, 1], [1, 1, 1]]  # ratio 3 is masked
    assert torch.allclose(batch["is_weights"], torch.tensor([[1.0, 0.0, 1.2], [1.0, 1.0, 1.0]]))
    assert metrics["correction/masked_frac"] == pytest.approx(1 / 6)
    assert metrics["correction/behaviour_ratio_max"] == pytest.approx(3.0)

"""The `algorithm:` section: advantage estimator, policy loss, aggregation, KL, entropy,
normalisation, sampling-side filters, off-policy corrections and the critic.

Each choice is a typed union told apart by `name`; `reroll/pipelines/objective.py` maps a chosen
model to the pure functions of `reroll.algorithms`. Combinations that cannot work are errors that
name the fields: those inside this section are checked here (`_check_combinations`), those that
involve `rollout:` by `AlgorithmConfig.rollout_errors`, called from `RLConfig` at load time.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from reroll.config.base import Section, choice
from reroll.config.on_policy_distill import OnPolicyDistillConfig

NormLevel = Literal["group", "batch", "none"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                  "seq_mean_token_sum_norm"]

# ----------------------------------------------------------------------------------------------
# Advantage estimators


class AdvantageSection(Section):
    """What every advantage estimator's section has."""

    group_baseline: ClassVar[bool] = False
    """Whether the baseline comes from the other responses of the prompt's group (then a group
    of one response has none)."""


class GRPOAdvantage(AdvantageSection):
    """Group-normalised outcome reward (DeepSeekMath, Shao et al. 2024):
    A_i = (r_i - mean r) / (std r + eps), the mean and the std each over the group, the batch or
    nothing, broadcast to the response's tokens."""

    name: Literal["grpo"] = "grpo"
    group_baseline: ClassVar[bool] = True
    mean: NormLevel = "group"
    """Baseline subtracted from the reward: the group mean, the batch mean, or none."""
    std: NormLevel = "group"
    """Divide by the std of the raw rewards over the group, the batch, or not at all (`none` is
    Dr. GRPO's advantage, `batch` Lite PPO's)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""


class DrGRPOAdvantage(AdvantageSection):
    """Dr. GRPO ("Understanding R1-Zero-like Training", Liu et al. 2025): A_i = r_i - mean_group r,
    no std division. Its loss aggregation defaults to `seq_mean_token_sum_norm`."""

    name: Literal["dr_grpo"] = "dr_grpo"
    group_baseline: ClassVar[bool] = True


class LitePPOAdvantage(AdvantageSection):
    """Lite PPO ("Tricks or Traps?", Liu et al. 2025): group mean, batch std:
    A_i = (r_i - mean_group r) / (std_batch r + eps). Pairs with `token_mean`."""

    name: Literal["lite_ppo"] = "lite_ppo"
    group_baseline: ClassVar[bool] = True
    eps: float = Field(1e-6, gt=0)
    """Added to the batch std before dividing."""


class RLOOAdvantage(AdvantageSection):
    """REINFORCE leave-one-out ("Back to Basics", Ahmadian et al. 2024): A_i = r_i - mean_{j!=i} r_j."""

    name: Literal["rloo"] = "rloo"
    group_baseline: ClassVar[bool] = True


class ReinforcePPAdvantage(AdvantageSection):
    """REINFORCE++ (Hu et al. 2025): token returns G_t = sum_k gamma^(k-t) r_k of the score on the
    last token (minus beta*KL per token when `kl.mode: reward`), whitened over the batch."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per response token."""
    eps: float = Field(1e-8, gt=0)
    """Added to the variance when whitening."""


class ReinforcePPBaselineAdvantage(AdvantageSection):
    """REINFORCE++-baseline: the group mean of the rewards is subtracted first, then REINFORCE++."""

    name: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    group_baseline: ClassVar[bool] = True
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per response token."""
    eps: float = Field(1e-8, gt=0)
    """Added to the variance when whitening."""


class GAEAdvantage(AdvantageSection):
    """GAE(gamma, lambda) over token rewards (the score on the last response token, minus beta*KL
    per token when `kl.mode: reward`) with values from a learned critic (PPO, Schulman et al.
    2017). Needs an `algorithm.critic` section."""

    name: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per response token."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda: 1 gives Monte-Carlo returns minus V, 0 one-step TD errors."""
    whiten: bool = True
    """Whiten the advantages over all response tokens of the batch (as verl and OpenRLHF do)."""


class ReBNAdvantage(AdvantageSection):
    """ReBN, Return Batch Normalisation (GEM, 2025): per-turn discounted returns, normalised over
    all turns in the batch. In the RLVR pipeline a response is one turn."""

    name: Literal["rebn"] = "rebn"
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per turn."""
    eps: float = Field(1e-8, gt=0)
    """Added to the variance when normalising."""


class GiGPOAdvantage(AdvantageSection):
    """GiGPO (Feng et al. 2025): episode-level group advantage + `step_weight` x step-level
    advantage within groups of turns that share an anchor state. Without state ids from an
    environment, turn k of every episode of a group counts as one anchor state."""

    name: Literal["gigpo"] = "gigpo"
    group_baseline: ClassVar[bool] = True
    gamma: float = Field(0.95, ge=0, le=1)
    """Discount per turn for the step-level returns."""
    step_weight: float = Field(1.0, ge=0)
    """Weight omega of the step-level advantage."""
    scale_by_std: bool = True
    """Divide both levels by their group std (False: mean-centred only)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the stds before dividing."""


class IPAChunkAdvantage(AdvantageSection):
    """IPA chunk-level returns ("Let It Flow" / ROME, 2025): the discounted return of each
    interaction chunk (the model's tokens of one turn), constant over the chunk. Pair it with
    `policy_loss: {name: ipa_chunk}` for the chunk-level ratio and normalisation."""

    name: Literal["ipa_chunk"] = "ipa_chunk"
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per chunk."""


class CustomAdvantage(AdvantageSection):
    """Your own estimator, `function(batch, group_size, **kwargs) -> advantages [B, T]`, named
    by import path (importable from the working directory; docs/algorithms.md). It is imported
    and its signature checked at start. Reward clipping, whitening and the advantage clip of
    `normalize` apply around it as around the built-in ones."""

    name: Literal["custom"] = "custom"
    function: str = Field(..., pattern=r"^[\w.]+:[\w.]+$")
    """Import path `package.module:function`."""
    kwargs: dict[str, float | int | bool | str] = Field(default_factory=dict)
    """Keyword arguments passed to the function on every call (its knobs)."""


ADVANTAGES = (GRPOAdvantage, DrGRPOAdvantage, LitePPOAdvantage, RLOOAdvantage,
              ReinforcePPAdvantage, ReinforcePPBaselineAdvantage, GAEAdvantage, ReBNAdvantage,
              GiGPOAdvantage, IPAChunkAdvantage, CustomAdvantage)
AdvantageConfig = choice("name", "grpo", *ADVANTAGES)
ADVANTAGE_NAMES = tuple(a.model_fields["name"].default for a in ADVANTAGES)
"""Every advantage estimator by name: the one list of them (pipelines/advantages.py maps each
to its function; tests derive theirs from it)."""

# ----------------------------------------------------------------------------------------------
# Policy losses


class PPOLoss(Section):
    """PPO's clipped surrogate with separate low/high clip (DAPO's clip-higher) and optional dual clip."""

    name: Literal["ppo"] = "ppo"
    clip_low: float = Field(0.2, ge=0, le=1)
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """The ratio is clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = Field(None, gt=1)
    """For negative advantages also bound the loss by `dual_clip * |A|` (Ye et al. 2020); None: off."""


class GSPOLoss(Section):
    """GSPO (Zheng et al. 2025): the sequence ratio exp(mean_t log rho_t), clipped at the sequence
    level with a very narrow range. A sequence-level objective: `loss_agg` is
    `seq_mean_token_mean`."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, le=1)
    """The sequence ratio is clipped below at 1 - clip_low (the paper: 3e-4)."""
    clip_high: float = Field(4e-4, ge=0, le=10)
    """The sequence ratio is clipped above at 1 + clip_high (the paper: 4e-4)."""


class CISPOLoss(Section):
    """CISPO (MiniMax-M1, 2025): -sg(clip(rho, 1-low, 1+high)) * A * log pi; the IS weight is
    clipped and detached, so no token loses its gradient."""

    name: Literal["cispo"] = "cispo"
    clip_low: float | None = Field(None, ge=0, le=1)
    """Lower bound 1 - clip_low on the IS weight; None: unbounded below (the paper)."""
    clip_high: float = Field(0.28, ge=0, le=10)
    """Upper bound 1 + clip_high on the IS weight."""


class TOPRLoss(Section):
    """TOPR (Le Roux et al. 2025): A>=0: -A log pi (no ratio); A<0: -sg(clip(rho, 0, 1)) A log pi."""

    name: Literal["topr"] = "topr"
    sequence_ratio: bool = False
    """Use the trajectory ratio prod_t rho_t (the paper) instead of the token ratio."""


class ReinforceLoss(Section):
    """Plain REINFORCE: -A log pi (no ratio, no clip)."""

    name: Literal["reinforce"] = "reinforce"


class DecoupledPPOLoss(Section):
    """Decoupled PPO (Hilton et al. 2022; AReaL): clip pi_theta / pi_old, weight by sg(pi_old / mu)
    where mu is the engine that sampled (its recorded behaviour logprobs)."""

    name: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip_low: float = Field(0.2, ge=0, le=1)
    """The proximal ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """The proximal ratio is clipped above at 1 + clip_high."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip bound c for negative advantages (None: off)."""
    behaviour_cap: float | None = Field(None, gt=0)
    """Bound on the behaviour weight pi_old / mu (None: unbounded); what happens above it is
    `behaviour_cap_mode`."""
    behaviour_cap_mode: Literal["truncate", "drop"] = "truncate"
    """truncate: the weight becomes the cap (truncated IS: the token keeps a bounded gradient).
    drop: the token gets weight 0, as AReaL's `behav_imp_weight_cap` filters it (it stays in the
    loss normaliser, like a masked token)."""


class IPAChunkLoss(Section):
    """IPA's chunk-level clipped surrogate: the ratio is the geometric mean over a chunk (one turn
    of model tokens) and every chunk weighs 1. Uses `loss_agg: token_mean` (counting chunks)."""

    name: Literal["ipa_chunk"] = "ipa_chunk"
    clip_low: float = Field(0.2, ge=0, le=1)
    """The chunk ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """The chunk ratio is clipped above at 1 + clip_high."""


class CustomLoss(Section):
    """Your own policy loss, named by import path (importable from the working directory;
    docs/algorithms.md): `function(logprobs, old_logprobs, advantages, mask, *, agg, num_tokens,
    num_seqs, max_len, is_weights, **kwargs) -> (loss, metrics)`, all tensors [B, T]. Pass the
    aggregation keywords to `reroll.algorithms.aggregate_loss` so micro-batch losses add up. It is
    imported and its signature checked at start."""

    name: Literal["custom"] = "custom"
    function: str = Field(..., pattern=r"^[\w.]+:[\w.]+$")
    """Import path `package.module:function`."""
    kwargs: dict[str, float | int | bool | str] = Field(default_factory=dict)
    """Keyword arguments passed to the function on every call (its knobs)."""


POLICY_LOSSES = (PPOLoss, GSPOLoss, CISPOLoss, TOPRLoss, ReinforceLoss, DecoupledPPOLoss,
                 IPAChunkLoss, CustomLoss)
PolicyLossConfig = choice("name", "ppo", *POLICY_LOSSES)
POLICY_LOSS_NAMES = tuple(p.model_fields["name"].default for p in POLICY_LOSSES)
"""Every policy loss by name (objective.py maps each to its function; tests derive theirs)."""

# ----------------------------------------------------------------------------------------------
# KL, normalisation, filters, corrections


class FixedKL(Section):
    """A constant KL coefficient (`kl.coef`)."""

    name: Literal["fixed"] = "fixed"


class AdaptiveKL(Section):
    """Adaptive KL coefficient (Ziegler et al. 2019): starting at `kl.coef`, after every step
    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon)."""

    name: Literal["adaptive"] = "adaptive"
    target: float = Field(0.1, gt=0)
    """The per-token KL(policy || reference) the controller steers towards."""
    horizon: float = Field(10000, gt=0)
    """Samples over which the coefficient may change by the clipped error (~20%)."""


KLControllerConfig = choice("name", "fixed", FixedKL, AdaptiveKL)


class KLConfig(Section):
    """KL(policy || reference) as a loss term or as a per-token reward penalty."""

    coef: float = Field(0.0, ge=0)
    """Weight beta of the KL term (the starting value for an adaptive controller). 0 turns it off
    and the reference model is not loaded at all."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator (Schulman's 'Approximating KL divergence')."""
    mode: Literal["loss", "reward"] = "loss"
    """loss: add coef * KL to the policy loss (GRPO). reward: subtract coef * KL from the token
    rewards before the advantages (PPO, REINFORCE++; outcome estimators see the sequence sum)."""
    controller: KLControllerConfig = Field(default_factory=FixedKL)
    """How the coefficient evolves: `fixed`, or `adaptive` with a KL `target`."""

    @property
    def in_reward(self) -> bool:
        """KL is a per-token reward penalty (`mode: reward`), not a loss term: the one place
        the mode is compared."""
        return self.mode == "reward"

    @property
    def in_loss(self) -> bool:
        """KL is a term of the policy loss (`mode: loss`)."""
        return not self.in_reward


class NormalizationConfig(Section):
    """Reward clipping before the estimator; advantage whitening and clipping after it."""

    reward_clip: tuple[float, float] | None = None
    """Clamp each response's reward (after the overlong penalty) to [low, high]; None: off."""
    whiten_advantages: bool = False
    """Whiten the advantages over all response tokens of the batch (zero mean, unit variance)."""
    advantage_clip: float | None = Field(None, gt=0)
    """Clamp the advantages to [-c, c] (ROLL's `advantage_clip`); None: off."""


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling and ROLL's difficulty filters, applied to the step's groups: a group
    that fails them is dropped from the step (counted in `filter/groups_dropped`). Filters look at
    the task reward, before any shaping."""

    drop_all_equal: bool = True
    """Drop groups whose rewards are all equal (no learning signal for group baselines)."""
    min_mean: float | None = None
    """Drop groups whose mean reward is below this (too hard); None: no bound."""
    max_mean: float | None = None
    """Drop groups whose mean reward is above this (too easy); None: no bound."""
    min_std: float | None = Field(None, ge=0)
    """Drop groups whose reward std is below this; None: no bound."""
    max_std: float | None = Field(None, ge=0)
    """Drop groups whose reward std is above this; None: no bound."""
    atol: float = Field(0.0, ge=0)
    """Rewards within this distance count as equal for `drop_all_equal`."""


class OverlongConfig(Section):
    """What to do with responses that reach `rollout.max_new_tokens` (DAPO)."""

    filter: bool = False
    """Drop truncated responses from the policy loss (DAPO's overlong filtering)."""
    soft_penalty_cache: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: over the last N tokens before `rollout.max_new_tokens`
    the reward falls linearly by up to `soft_penalty`; None: off."""
    soft_penalty: float = Field(1.0, gt=0)
    """The penalty at `rollout.max_new_tokens`."""


class TISConfig(Section):
    """Truncated importance sampling: weight the policy loss by min(pi_old / mu, cap), where mu is
    the engine's (behaviour) distribution and pi_old the trainer's at the start of the step."""

    level: Literal["token", "turn", "sequence", "geometric"] = "token"
    """Ratio per token, per turn (segment), per sequence (product) or the sequence's geometric mean."""
    cap: float | None = Field(2.0, gt=0)
    """Truncation C of the weight (ROLL uses 1.2 as `upper_bound`); None: no truncation."""


class RatioMaskConfig(Section):
    """IcePop-style masking: drop tokens or whole sequences whose pi_old / mu is outside [low, high]."""

    level: Literal["token", "sequence"] = "token"
    """Mask single tokens, or whole sequences by their ratio."""
    low: float = Field(0.5, ge=0)
    """Smallest kept ratio."""
    high: float = Field(2.0, gt=0)
    """Largest kept ratio."""
    geometric: bool = True
    """Sequence level: use the geometric mean of the token ratios (False: their product)."""


class CorrectionConfig(Section):
    """Off-policy corrections between the trainer's policy and the engine that sampled.

    Written `algorithm.correction: none` in YAML it is `{auto: false}`: no correction, even when
    the samples can be off-policy (the pipeline then logs a warning at start)."""

    tis: TISConfig | None = None
    """Truncated importance-sampling weights on the policy loss; None: off (unless `auto` turns
    it on)."""
    ratio_mask: RatioMaskConfig | None = None
    """Ratio-based masking of tokens or sequences; None: off."""
    auto: bool = True
    """When the samples can be off-policy (`async_training.enabled`, or `rollout.engine: vllm`,
    whose logprobs are not the trainer's) and neither `tis` nor `ratio_mask` is set and
    the policy loss is not `decoupled_ppo` (which corrects by itself): turn on token-level TIS with
    cap 2 (`tis: {level: token, cap: 2.0}`, see docs/async.md). Resolved when the config loads;
    the run's config.yaml shows the result. false: leave the samples uncorrected (logged)."""

    @model_validator(mode="before")
    @classmethod
    def _none_means_off(cls, value):
        """`correction: none` (or null) is the explicit way to turn every correction off."""
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return {"auto": False}
        return value


# ----------------------------------------------------------------------------------------------
# Critic


class AsyPPOConfig(Section):
    """AsyPPO's use of the disagreement (std) between mini-critics; active when num_critics > 1."""

    advantage_mask_quantile: float = Field(0.2, ge=0, lt=1)
    """Tokens whose critic std is below this quantile of the batch's stds (the critics agree)
    leave the policy loss. 0: off."""
    entropy_mask_quantile: float = Field(0.8, gt=0, le=1)
    """Tokens whose critic std is above this quantile (the critics diverge) leave the entropy
    bonus. 1: off."""


class CriticConfig(Section):
    """A learned value model: a backbone of the policy's family with a linear value head."""

    model_path: str | None = None
    """Where the critic starts: a policy model (its backbone, with a new value head) or a saved
    critic (`checkpoints/step_N/critic_0`). None: the policy's `model.path`."""
    num_critics: int = Field(1, ge=1, le=8)
    """More than 1: AsyPPO's mini-critics, each trained on its own share of every group's
    responses; V is their mean."""
    lr: float | None = Field(None, gt=0, le=1)
    """Critic learning rate; None: the policy's `optimizer.lr`. Schedule, warm-up and betas follow
    `optimizer:`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of the critic."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the critic's gradient norm (None: no clipping)."""
    value_clip: float | None = Field(0.5, gt=0)
    """PPO value clipping: new values stay within this distance of the old ones; None: off."""
    warmup_steps: int = Field(0, ge=0)
    """Train only the critic for the first N steps (the policy is not updated)."""
    asyppo: AsyPPOConfig = Field(default_factory=AsyPPOConfig)
    """Advantage and entropy masks from the mini-critics' disagreement (num_critics > 1)."""


# ----------------------------------------------------------------------------------------------
# The section


class AlgorithmConfig(Section):
    """The RL objective: advantage estimator, policy loss and everything around them (KL, entropy,
    normalisation, filters, off-policy corrections, critic). See docs/algorithms.md."""

    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantage)
    """How rewards become per-token advantages; chosen by `name`."""
    policy_loss: PolicyLossConfig = Field(default_factory=PPOLoss)
    """The policy objective; chosen by `name`."""
    loss_agg: LossAgg | None = None
    """How per-token losses become one number; normalisers are global over the step's batch.
    None: the method's own choice (seq_mean_token_mean for gspo, seq_mean_token_sum_norm for
    dr_grpo, token_mean otherwise)."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL(policy || reference): coefficient, estimator, loss or reward, fixed or adaptive."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (entropy is always logged)."""
    updates_per_batch: int = Field(1, ge=1, le=16)
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches, one
    step each (PPO mini-batches). With 1 the update is exactly on-policy, so the old logprobs are
    the current ones and no extra forward pass is spent on them."""
    epochs: int = Field(1, ge=1, le=16)
    """Passes over each rollout batch (PPO epochs; the inner iterations of GRPO), each of
    `updates_per_batch` optimizer steps, so a step makes epochs x updates_per_batch of them, in
    the same mini-batch order every pass. The critic, if any, makes as many passes. Above 1 the
    passes after the first are off-policy, so pi_old is computed before the update."""
    skip_zero_advantage: bool = True
    """Leave out of the forward/backward pass the samples whose advantage is 0 on every loss
    token (e.g. GRPO groups whose rewards are all equal): every policy loss here is the advantage
    times a function of the ratio, so their gradient is exactly 0 and the update is the same,
    cheaper. Normalisers still count them. Ignored (they are trained) when a KL term is in the
    loss or `entropy_coef` > 0, which do depend on them. Actor metrics (entropy, clip fraction)
    then cover the trained samples."""
    normalize: NormalizationConfig = Field(default_factory=NormalizationConfig)
    """Reward clipping, advantage whitening and clipping around the estimator."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """Drop groups without learning signal (all rewards equal, or outside mean/std bounds) from
    the step; None: keep every group."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Overlong filtering and DAPO's soft overlong penalty."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Off-policy corrections (truncated IS, ratio masks) against the engine's behaviour logprobs.
    On by default (token TIS, cap 2) whenever the samples can be off-policy; `none` turns it off."""
    critic: CriticConfig | None = None
    """The value model that `advantage: {name: gae}` needs; None: no critic."""
    distill: OnPolicyDistillConfig | None = None
    """On-policy distillation from a teacher model (None: none)."""
    routing_replay: Literal["off", "rollout", "old_policy"] = "off"
    """Mixture-of-experts models only (docs/moe.md): which routing the trainer's forwards use.
    `off`: the trainer's router routes again; `rollout` (R3): the experts the engine routed each
    token to, recorded at rollout (hf engine only; agentic runs join every turn's), in pi_old's
    forward and every update's; `old_policy`: pi_old's own routing, recorded by the trainer when
    it computes pi_old, in every update (it changes nothing with one update and one epoch per
    batch, where pi_old is the first update's own forward). The replayed experts' weights still
    come from the current router, so the router keeps learning."""
    router_aux_loss_coef: float = Field(0.0, ge=0, le=1)
    """Mixture-of-experts models: weight of the router's load-balancing loss (Switch
    Transformer's, as transformers computes it) in the policy loss; 0 logs it only
    (`actor/router_aux_loss`)."""
    router_z_loss_coef: float = Field(0.0, ge=0, le=1)
    """Mixture-of-experts models: weight of the router z-loss (mean squared logsumexp of the
    router logits, ST-MoE) in the policy loss; 0 logs it only (`actor/router_z_loss`)."""

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _check_combinations(self) -> AlgorithmConfig:
        adv, loss = self.advantage.name, self.policy_loss.name
        if self.loss_agg is None:
            self.loss_agg = ("seq_mean_token_mean" if loss == "gspo" else
                             "seq_mean_token_sum_norm" if adv == "dr_grpo" else "token_mean")
        if loss == "gspo" and self.loss_agg != "seq_mean_token_mean":
            raise ValueError(f"algorithm.policy_loss gspo is a sequence-level objective (the mean "
                             f"over sequences); algorithm.loss_agg={self.loss_agg} would weight "
                             f"sequences by their length: use seq_mean_token_mean or leave it unset")
        if loss == "ipa_chunk" and self.loss_agg != "token_mean":
            raise ValueError(f"algorithm.policy_loss ipa_chunk normalises per chunk itself and "
                             f"needs algorithm.loss_agg=token_mean (got {self.loss_agg})")
        if adv == "gae" and self.critic is None:
            raise ValueError("algorithm.advantage gae needs a critic: add an algorithm.critic "
                             "section (e.g. `critic: {lr: 1.0e-5}`)")
        if self.critic is not None and adv != "gae":
            raise ValueError(f"algorithm.critic is only used by algorithm.advantage gae (got "
                             f"{adv}): remove the critic section or use gae")
        if self.distill is not None and self.distill.dense:
            for wrong, why in ((self.critic is not None, "algorithm.critic"),
                               (self.entropy_coef > 0, "algorithm.entropy_coef > 0"),
                               (self.kl.in_reward and self.kl.coef > 0, "algorithm.kl.mode reward")):
                if wrong:
                    raise ValueError(f"algorithm.distill.mode dense trains on the divergence "
                                     f"(and the task's policy loss with task_coef > 0): {why} "
                                     f"would have no effect (remove it)")
        if loss == "decoupled_ppo" and self.correction.tis is not None:
            raise ValueError("algorithm.policy_loss decoupled_ppo already weights by pi_old / mu "
                             "(see its behaviour_cap); algorithm.correction.tis would apply the "
                             "same weight twice")
        if adv == "custom" and self.kl.in_reward and self.kl.coef > 0:
            raise ValueError("algorithm.kl.mode reward: algorithm.advantage custom is not "
                             "given a KL reward penalty; use algorithm.kl.mode loss")
        if self.kl.controller.name == "adaptive" and self.kl.coef == 0:
            raise ValueError("algorithm.kl.controller adaptive multiplies algorithm.kl.coef, "
                             "which is 0: set a starting coefficient > 0")
        mask = self.correction.ratio_mask
        if mask is not None and mask.low >= mask.high:
            raise ValueError(f"algorithm.correction.ratio_mask: low ({mask.low}) must be below "
                             f"high ({mask.high})")
        clip = self.normalize.reward_clip
        if clip is not None and clip[0] >= clip[1]:
            raise ValueError(f"algorithm.normalize.reward_clip: low ({clip[0]}) must be below "
                             f"high ({clip[1]})")
        return self

    def resolve_correction(self, off_policy_reasons: list[str]) -> None:
        """`correction.auto`: token-level TIS (cap 2) when the samples can be off-policy and no
        correction is configured. Called by the run config, which knows the rollout side."""
        corr = self.correction
        if (corr.auto and off_policy_reasons and corr.tis is None and corr.ratio_mask is None
                and self.policy_loss.name != "decoupled_ppo"):
            corr.tis = TISConfig()

    def rollout_errors(self, group_size: int, max_new_tokens: int) -> list[str]:
        """Problems of this section together with `rollout:`; each names the fields."""
        errors = []
        adv = self.advantage
        grouped = adv.group_baseline and not (
            adv.name == "grpo" and "group" not in (adv.mean, adv.std))
        dense_alone = self.distill is not None and self.distill.dense and not self.distill.with_task
        if grouped and group_size < 2 and not dense_alone:
            errors.append(f"algorithm.advantage {adv.name} needs rollout.group_size >= 2 (a group "
                          f"of one response has no baseline)")
        if self.critic is not None and self.critic.num_critics > group_size:
            errors.append(f"algorithm.critic.num_critics ({self.critic.num_critics}) mini-critics "
                          f"each train on a share of every group: rollout.group_size "
                          f"({group_size}) must be at least as large")
        cache = self.overlong.soft_penalty_cache
        if cache is not None and cache > max_new_tokens:
            errors.append(f"algorithm.overlong.soft_penalty_cache ({cache}) must not exceed "
                          f"rollout.max_new_tokens ({max_new_tokens})")
        return errors

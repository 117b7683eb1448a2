"""Trajectory (one sampled response and what we learned about it) and the training Batch.

A Batch is a `tensordict.TensorDict` of right-padded [B, L] tensors over the concatenated
prompt + response tokens, plus a list of per-sample metadata. Keys:

- `input_ids`, `attention_mask`: the tokens the engine consumed and produced, exactly.
- `response_mask`: 1 on policy-generated tokens (the only tokens the loss sees). In a multi-turn
  episode the response also holds the environment's tokens between turns: they have mask 0.
- `behaviour_logprobs`: the engine's logprob of each generated token (0 elsewhere).
- multi-turn only (present when any trajectory has `turn_ids`): `turn_ids` [B, T] (turn index of
  each policy token, -1 elsewhere), `turn_rewards` [B, K] (reward of each turn) and `state_ids`
  [B, K] (an id of the observation each turn acted on: GiGPO's anchor states).
- `old_logprobs`, `ref_logprobs`, `advantages`, ...: filled in by the pipeline's phases.
- `rewards` [B]: the scalar reward of each sample; `group_ids` [B]: samples of one prompt share it.
- `model_inputs` (present when any trajectory has them): the prompts' model inputs beyond
  tokens (an image's `pixel_values`, `image_grid_thw`...), a nested TensorDict [B] holding, per
  input name, `values` [B, N, ...] (each sample's tensor padded along its first dimension to the
  batch's longest) and `sizes` [B] (its true first dimension). `model_kwargs` turns a batch's
  rows back into the model's keyword arguments (the rule is there).

The RL step's batch is an `RLBatch`: the fields above and the ones the RL step adds, declared
below (`RLBatch.REQUIRED`, `RLBatch.OPTIONAL`) and checked, with their shapes, where the batch is
made (`RLBatch.checked`), so a missing field fails there and not deep in a loss.

Token-level tensors follow the logprob convention of `reroll.models.logprobs`: position t holds
the value for token t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tensordict import TensorDict


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    finish_reason: str
    group_id: int
    prompt_text: str = ""
    response_text: str = ""
    answer: str | None = None
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0
    policy_mask: list[int] | None = None
    """Multi-turn: 1 on the model's tokens, 0 on environment tokens in the response (None: all 1)."""
    turn_ids: list[int] | None = None
    """Multi-turn: per response token, the turn of a policy token (0, 1, ...), -1 elsewhere."""
    turn_rewards: list[float] | None = None
    """Multi-turn: the reward of each turn (`reward` is their sum, the episode's return)."""
    turn_states: list[int] | None = None
    """Multi-turn: an id of the observation each turn acted on (equal ids = the same state)."""
    segments: list[dict[str, Any]] | None = None
    """Multi-turn: the episode as text segments `{text, policy, turn}`, for the run viewer."""
    conversation: dict[str, Any] | None = None
    """Multi-turn: `{messages, tools}`, the episode as chat messages (assistant turns as the
    model wrote them, observations as user messages, tool results as `tool` messages) and the
    env's tool schemas: in rollout and eval rows, so `reroll make-sft` turns episodes into SFT
    rows."""
    model_inputs: dict[str, torch.Tensor] | None = None
    """The prompt's model inputs beyond its token ids (an image's `pixel_values`,
    `image_grid_thw`...), as the model's processor built them for this one prompt: the trainer's
    forward gets them with the tokens (`collate`, `model_kwargs`). None: tokens only."""
    token_versions: list[int] | None = None
    """Per response token, the policy version that sampled it (-1 on environment tokens); None:
    all `policy_version`. Multi-turn episodes record it (an async run's episode can span
    several versions, and a resumed request's tokens differ within one turn)."""
    tag: str | None = None
    """The prompt row's `tag` column (None without one): routes the sample to its teacher in
    on-policy distillation (`algorithm.distill.teachers`)."""
    images: list[str] | None = None
    """The prompt's image paths, in order, for the rollout files and the run viewer (None: no
    images; the pixels the model saw are in `model_inputs`)."""
    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts: the experts the engine routed each prompt and response token to,
    [prompt + response tokens, layers, top_k] (-1: none recorded), for routing replay."""

    def __post_init__(self) -> None:
        if len(self.behaviour_logprobs) != len(self.response_ids):
            raise ValueError("behaviour_logprobs must have one entry per response token")
        for name in ("policy_mask", "turn_ids", "token_versions"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.response_ids):
                raise ValueError(f"{name} must have one entry per response token")
        tokens = len(self.prompt_ids) + len(self.response_ids)
        if self.routed_experts is not None and self.routed_experts.shape[0] != tokens:
            raise ValueError(f"routed_experts must have one entry per prompt and response token "
                             f"({tokens}), not {self.routed_experts.shape[0]}: a record that "
                             f"does not line up would force other tokens' experts")


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """A trajectory as text, for people and the run viewer (a batch's metadata, the rollout
    files, evaluation samples): the one place this row is built; callers add their own keys."""
    return ({"prompt": t.prompt_text, "response": t.response_text, "answer": t.answer,
             "reward": t.reward, "reward_info": t.reward_info, "finish_reason": t.finish_reason}
            | ({"segments": t.segments} if t.segments is not None else {})
            | ({"turn_rewards": t.turn_rewards} if t.turn_rewards is not None else {})
            | ({"images": t.images} if t.images else {})
            | (t.conversation or {}))


def infra_failed(t: Trajectory) -> bool:
    """Whether the sample ended in an infrastructure failure, not the policy's doing: its
    environment failed (`env_error`: a reset or step that raised or timed out, a lost env host)
    or its agent harness did (a gateway episode whose `agent_status` is not `ok`). Such a sample
    is out of the loss and out of its group's statistics (`RLBatch`'s `valid`)."""
    return t.finish_reason == "env_error" or t.reward_info.get("agent_status", "ok") != "ok"


def collate(trajectories: list[Trajectory], pad_token_id: int) -> tuple[TensorDict, list[dict]]:
    """Right-pad prompt+response sequences into a Batch; returns (tensors, per-sample metadata)."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    size, width = len(trajectories), max(lengths)
    input_ids = torch.full((size, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((size, width), dtype=torch.long)
    response_mask = torch.zeros((size, width), dtype=torch.float32)
    behaviour = torch.zeros((size, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        response_mask[i, p : p + r] = 1.0 if t.policy_mask is None else \
            torch.tensor(t.policy_mask, dtype=torch.float32)
        behaviour[i, p : p + r] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
    tensors = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "behaviour_logprobs": behaviour,
            "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            "group_ids": torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        },
        batch_size=[size],
    )
    if any(t.turn_ids is not None for t in trajectories):
        tensors.update(turn_tensors(trajectories, width))
    if any(t.model_inputs for t in trajectories):
        tensors["model_inputs"] = batched_model_inputs([t.model_inputs or {} for t in trajectories])
    if any(t.routed_experts is not None for t in trajectories):
        tensors["routed_experts"] = routing_tensor(trajectories, width)
    metadata = [trajectory_row(t) | {"policy_version": t.policy_version} for t in trajectories]
    return tensors, metadata


def batched_model_inputs(per_sample: list[dict[str, torch.Tensor]]) -> TensorDict:
    """The `model_inputs` field of a batch of samples' model inputs: per name, `values` [B, N, ...]
    (each sample's tensor, padded with zeros along its first dimension) and `sizes` [B] (its true
    first dimension; 0 where a sample lacks the input, e.g. a text-only prompt beside an image
    one). Padded per row, not concatenated, so slicing the batch by rows (micro-batches, shards)
    keeps each sample's inputs with its tokens."""
    size, fields = len(per_sample), {}
    for name in sorted({name for inputs in per_sample for name in inputs}):
        present = [inputs[name] for inputs in per_sample if name in inputs]
        tail, dtype = present[0].shape[1:], present[0].dtype
        if any(t.dim() == 0 or t.shape[1:] != tail for t in present):
            raise ValueError(f"model input {name!r}: every sample's tensor needs a first "
                             f"dimension and the same trailing shape, got "
                             f"{sorted({tuple(t.shape) for t in present})}")
        longest = max(t.shape[0] for t in present)
        values = torch.zeros((size, longest, *tail), dtype=dtype)
        sizes = torch.zeros(size, dtype=torch.long)
        for i, inputs in enumerate(per_sample):
            if name in inputs:
                values[i, : inputs[name].shape[0]] = inputs[name]
                sizes[i] = inputs[name].shape[0]
        fields[name] = TensorDict({"values": values, "sizes": sizes}, batch_size=[size])
    return TensorDict(fields, batch_size=[size])


def model_kwargs(batch: TensorDict, device: torch.device | str | None = None
                 ) -> dict[str, torch.Tensor]:
    """The keyword arguments a model's forward takes for `batch`'s rows' model inputs ({} without
    any). The rule: each input is its rows' tensors concatenated along the first dimension, in row
    order, padding dropped. It is the layout processors give a batch of prompts and models expect:
    Qwen2-VL's `pixel_values` [all patches of all images, D] with `image_grid_thw` [all images, 3],
    or one image tensor per row [rows, C, H, W]; the model places image i's features at the i-th
    run of image tokens in the batch, which row order keeps. An input none of the rows holds is
    left out, as for a text-only batch (a model given an empty `pixel_values` fails: a
    micro-batch or a rank's shard of text-only rows from a mixed batch)."""
    if "model_inputs" not in batch.keys():
        return {}
    out = {}
    for name, field_ in batch["model_inputs"].items():
        values, sizes = field_["values"], field_["sizes"].tolist()
        if not any(sizes):
            continue
        out[name] = torch.cat([values[i, :n] for i, n in enumerate(sizes)])
        if device is not None:
            out[name] = out[name].to(device)
    return out


def routing_tensor(trajectories: list[Trajectory], width: int) -> torch.Tensor:
    """[B, width, layers, top_k] the samples' routing records, -1 past each one's end (and for a
    sample without one)."""
    shape = next(t.routed_experts for t in trajectories if t.routed_experts is not None).shape
    out = torch.full((len(trajectories), width, *shape[1:]), -1, dtype=torch.int16)
    for i, t in enumerate(trajectories):
        if t.routed_experts is not None:
            out[i, : t.routed_experts.shape[0]] = t.routed_experts[:width]
    return out


def turn_tensors(trajectories: list[Trajectory], width: int) -> dict[str, torch.Tensor]:
    """`turn_ids` [B, width], `turn_rewards` and `state_ids` [B, K] of multi-turn trajectories (a
    trajectory without turns counts as one turn holding its reward)."""
    size = len(trajectories)
    turns = max(len(t.turn_rewards or [0]) for t in trajectories)
    turn_ids = torch.full((size, width), -1, dtype=torch.long)
    turn_rewards = torch.zeros((size, turns), dtype=torch.float32)
    state_ids = torch.full((size, turns), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids = t.turn_ids if t.turn_ids is not None else [0] * r
        turn_ids[i, p : p + r] = torch.tensor(ids, dtype=torch.long)
        rewards = t.turn_rewards if t.turn_rewards is not None else [t.reward]
        turn_rewards[i, : len(rewards)] = torch.tensor(rewards, dtype=torch.float32)
        if t.turn_states:
            state_ids[i, : len(t.turn_states)] = torch.tensor(t.turn_states, dtype=torch.long)
    return {"turn_ids": turn_ids, "turn_rewards": turn_rewards, "state_ids": state_ids}


class RLBatch(TensorDict):
    """The RL step's batch: a TensorDict whose fields are declared here. `REQUIRED` fields exist
    from the moment the batch is made (`checked`), with these shapes (B samples, T tokens, K
    turns); `OPTIONAL` ones are added by the step's phases when the objective needs them.
    Indexing and slicing keep the type."""

    REQUIRED: ClassVar[dict[str, str]] = {
        "input_ids": "B T", "attention_mask": "B T", "response_mask": "B T",
        "behaviour_logprobs": "B T", "rewards": "B", "task_rewards": "B", "group_ids": "B",
        "index_in_group": "B", "valid": "B", "turn_ids": "B T", "turn_rewards": "B K",
        "state_ids": "B K",
        "loss_mask": "B T", "normaliser_mask": "B T", "entropy_mask": "B T", "advantages": "B T",
    }
    """`rewards`: shaped (overlong penalty); `task_rewards`: as the task gave them. `valid`:
    False for a sample that ended in an infrastructure failure (`infra_failed`: out of the loss,
    and out of every group and batch statistic). `loss_mask`: the tokens in the policy loss;
    `normaliser_mask`: the tokens the normalisers count; `entropy_mask`: those in the entropy
    bonus. `advantages`: 0 until the estimator fills them."""
    OPTIONAL: ClassVar[dict[str, str]] = {
        "old_logprobs": "B T", "ref_logprobs": "B T", "token_kl": "B T", "is_weights": "B T",
        "values": "B T", "returns": "B T", "teacher_logprobs": "B T", "teacher_route": "B",
        "teacher_top_ids": "B T k", "teacher_top_logprobs": "B T k", "model_inputs": "B ...",
        "routed_experts": "B T l k", "old_routed_experts": "B T l k",
    }
    """Set by the phases: pi_old, the reference's logprobs, the KL reward penalty, the truncated
    IS weights, the critics' values (and `old_values_{m}` of each) and returns, the teacher's
    logprobs (or top-k), and `model_inputs`: the prompts' model inputs beyond tokens (images'
    pixel values and the like), a nested TensorDict made by `collate` (`batched_model_inputs`),
    which every forward of the policy, reference and teacher passes on (`model_kwargs`);
    `routed_experts`: a mixture-of-experts model's routing at rollout (`old_routed_experts`: the
    trainer's at pi_old), replayed by `algorithm.routing_replay`."""

    @classmethod
    def derived(cls, tensors: TensorDict, group_size: int = 1) -> RLBatch:
        """The RL batch of collated samples (`collate`'s fields, or the same made by hand), with
        the fields the RL step derives before its phases, where `tensors` lacks them: the task
        reward (the reward as given), each sample's index in its group, one turn per response
        holding its reward (`turn_ids`, `turn_rewards`, `state_ids` -1), every response token in
        the loss, its normalisers and the entropy bonus, and advantages 0. Then `checked`."""
        mask, rewards = tensors["response_mask"], tensors["rewards"]
        size = mask.shape[0]
        made = {
            "task_rewards": lambda f: rewards.clone(),
            "index_in_group": lambda f: torch.arange(size) % group_size,
            "valid": lambda f: torch.ones(size, dtype=torch.bool),
            "turn_ids": lambda f: torch.where(mask > 0, 0, -1).long(),
            "turn_rewards": lambda f: rewards[:, None].clone(),
            "state_ids": lambda f: torch.full_like(f["turn_rewards"], -1, dtype=torch.long),
            "loss_mask": lambda f: mask.clone(), "normaliser_mask": lambda f: mask.clone(),
            "entropy_mask": lambda f: mask.clone(), "advantages": lambda f: torch.zeros_like(mask),
        }
        fields = dict(tensors.items())
        for name, make in made.items():
            if name not in fields:
                fields[name] = make(fields)
        return cls.checked(TensorDict(fields, batch_size=tensors.batch_size))

    @classmethod
    def checked(cls, tensors: TensorDict) -> RLBatch:
        """The batch of `tensors`, after checking that every required field is there with its
        declared shape (a ValueError naming the field otherwise)."""
        batch = cls(dict(tensors.items()), batch_size=tensors.batch_size)
        missing = [f"{name!r} [{dims}]" for name, dims in cls.REQUIRED.items()
                   if name not in batch.keys()]
        if missing:
            raise ValueError(f"RLBatch: required fields missing: {', '.join(missing)}")
        size, width = batch["input_ids"].shape
        turns = batch["turn_rewards"].shape[1]
        sizes = {"B": size, "T": width, "K": turns}
        for name in batch.keys():
            dims = (cls.REQUIRED | cls.OPTIONAL).get(name)
            if dims is None or "..." in dims:
                continue
            want = [sizes.get(d) for d in dims.split()]
            got = list(batch[name].shape)
            if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=True)):
                raise ValueError(f"RLBatch: field {name!r} has shape {got}, declared [{dims}] "
                                 f"with B={size}, T={width}, K={turns}")
        return batch


def split_micro_batches(batch: TensorDict, micro_batch_size: int) -> list[TensorDict]:
    """Consecutive slices of `micro_batch_size` samples, each trimmed to its own longest sequence
    (every [B, T, ...] tensor along T, e.g. a distillation teacher's top-k [B, T, k])."""
    out = []
    for start in range(0, batch.batch_size[0], micro_batch_size):
        micro = batch[start : start + micro_batch_size]
        width = int(micro["attention_mask"].sum(-1).max())
        out.append(_trim(micro, width))
    return out


def _trim(batch: TensorDict, width: int) -> TensorDict:
    trimmed = {k: (v[:, :width] if v.dim() >= 2 else v) for k, v in batch.items()}
    return TensorDict(trimmed, batch_size=batch.batch_size)

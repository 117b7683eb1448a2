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

Token-level tensors follow the logprob convention of `reroll.models.logprobs`: position t holds
the value for token t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    tag: str | None = None
    """The prompt row's `tag` column (None without one): routes the sample to its teacher in
    on-policy distillation (`algorithm.distill.teachers`)."""

    def __post_init__(self) -> None:
        if len(self.behaviour_logprobs) != len(self.response_ids):
            raise ValueError("behaviour_logprobs must have one entry per response token")
        for name in ("policy_mask", "turn_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.response_ids):
                raise ValueError(f"{name} must have one entry per response token")


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """A trajectory as text, for people and the run viewer (a batch's metadata, the rollout
    files, evaluation samples): the one place this row is built; callers add their own keys."""
    return ({"prompt": t.prompt_text, "response": t.response_text, "answer": t.answer,
             "reward": t.reward, "reward_info": t.reward_info, "finish_reason": t.finish_reason}
            | ({"segments": t.segments} if t.segments is not None else {})
            | ({"turn_rewards": t.turn_rewards} if t.turn_rewards is not None else {})
            | (t.conversation or {}))


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
        tensors.update(_turn_tensors(trajectories, width))
    metadata = [trajectory_row(t) | {"policy_version": t.policy_version} for t in trajectories]
    return tensors, metadata


def _turn_tensors(trajectories: list[Trajectory], width: int) -> dict[str, torch.Tensor]:
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

"""Per-step statistics of a rollout batch."""

from __future__ import annotations

import torch

from reroll.data.batch import Trajectory


def rollout_metrics(trajectories: list[Trajectory], group_size: int) -> dict[str, float]:
    rewards = torch.tensor([t.reward for t in trajectories])
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    groups = rewards.view(-1, group_size)
    return {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "train/reward_min": float(rewards.min()),
        "train/reward_max": float(rewards.max()),
        # Groups whose rewards are all equal carry no GRPO signal.
        "train/groups_all_equal": float((groups.max(-1).values == groups.min(-1).values).float().mean()),
        "train/response_len_mean": float(lengths.mean()),
        "train/response_len_max": float(lengths.max()),
        "train/truncated_frac": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        "rollout/tokens": float(lengths.sum()),
    }

"""Per-step statistics of a rollout batch."""

from __future__ import annotations

import re
from collections import Counter

import torch

from reroll.data.batch import Trajectory, infra_failed
from reroll.rollout.groups import Group


def rollout_metrics(trajectories: list[Trajectory], group_size: int) -> dict[str, float]:
    """The step's rewards, lengths and truncation. The reward statistics leave out samples
    that ended in an infrastructure failure (`infra_failed`: no reward the policy earned)
    while any other is left."""
    valid = [t for t in trajectories if not infra_failed(t)] or trajectories
    rewards = torch.tensor([t.reward for t in valid])
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t.reward for t in trajectories]).view(-1, group_size)
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
    } | reward_function_metrics(trajectories)


def reward_function_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """`train/rewards/<function>`: the mean score of each of several summed reward functions
    (`reward.type: python`; each sample's `reward_info["rewards"]`), over the samples they
    scored (a failed call records none)."""
    scores: dict[str, list[float]] = {}
    for t in trajectories:
        for name, score in (t.reward_info.get("rewards") or {}).items():
            scores.setdefault(name, []).append(float(score))
    keys = metric_names(list(scores))
    return {f"train/rewards/{keys[name]}": sum(v) / len(v) for name, v in scores.items()}


def metric_names(functions: list[str]) -> dict[str, str]:
    """A short metric name for each function (`module:qualname` -> `qualname`; `<lambda>` ->
    `lambda`); names that would clash keep their place in the list (`lambda_1`, `lambda_2`)."""
    short = {f: re.sub(r"[^A-Za-z0-9_.-]", "", f.rsplit(":", 1)[-1]) or "function"
             for f in functions}
    counts = Counter(short.values())
    return {f: f"{name}_{i}" if counts[name] > 1 else name
            for i, (f, name) in enumerate(short.items())}


def staleness_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Staleness (trainer version - version of the oldest token) and the off-policy token share."""
    stale = [version - g.version for g in groups]
    tokens = sum(len(s.tokens) for g in groups for s in g.samples)
    behind = sum(v < version for g in groups for s in g.samples for v in s.token_versions)
    resumed = sum(s.resumes > 0 for g in groups for s in g.samples)
    return {"staleness/mean": sum(stale) / max(len(stale), 1),
            "staleness/max": float(max(stale, default=0)),
            "staleness/off_policy_token_frac": behind / max(tokens, 1),
            "rollout/resumed_samples": float(resumed)}

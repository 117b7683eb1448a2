"""A researcher's own advantage estimator and policy loss, named by import path in the config
(`name: custom`): a 2-step run on the tiny model calls both, and, written to be Dr. GRPO's
advantage with REINFORCE, trains the weights to what the built-in pair gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.pipelines.rlvr import train

pytestmark = pytest.mark.e2e

USER_MODULE = '''
from reroll.algorithms import aggregate_loss

def digits(sample):
    """A reward every response earns some of: its share of digits."""
    return sum(c.isdigit() for c in sample.response) / max(len(sample.response), 1)

def centred(batch, group_size, log):
    """Each reward less its group's mean, on every response token (Dr. GRPO)."""
    open(log, "a").write("estimator\\n")
    rewards = batch["rewards"].view(-1, group_size)
    advantages = (rewards - rewards.mean(-1, keepdim=True)).flatten()
    return advantages[:, None] * batch["response_mask"]

def reinforce(logprobs, old_logprobs, advantages, mask, *, agg, num_tokens, num_seqs, max_len,
              is_weights, log):
    open(log, "a").write("loss\\n")
    loss = aggregate_loss(-advantages * logprobs, mask, agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_len=max_len)
    return loss, {"my_pg_loss": loss.detach()}
'''


def run(tmp_path: Path, tiny_model: str, data: str, name: str, algorithm: dict) -> Path:
    config = {"output_dir": str(tmp_path / name), "seed": 3, "steps": 2,
              "model": {"path": tiny_model}, "data": {"train": data},
              "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
              "optimizer": {"lr": 1e-2}, "train": {"micro_batch_size": 16},
              "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2},
              "tracking": {"progress": False, "tensorboard": False},
              "reward": {"type": "custom", "function": "my_objective_e2e:digits"},
              "algorithm": {"loss_agg": "token_mean", **algorithm}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_config(path))
    return tmp_path / name / "checkpoints" / "step_2" / "model.safetensors"


def test_a_users_estimator_and_loss_are_called_and_train(tmp_path, tiny_model, arithmetic,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # the user's module imports from the working directory
    (tmp_path / "my_objective_e2e.py").write_text(USER_MODULE)
    log = tmp_path / "calls.txt"
    try:
        mine = run(tmp_path, tiny_model, arithmetic["eval"], "mine", {
            "advantage": {"name": "custom", "function": "my_objective_e2e:centred",
                          "kwargs": {"log": str(log)}},
            "policy_loss": {"name": "custom", "function": "my_objective_e2e:reinforce",
                            "kwargs": {"log": str(log)}}})
        calls = log.read_text().split()
        assert calls.count("estimator") == 2 and calls.count("loss") >= 2  # every step, both
        builtin = run(tmp_path, tiny_model, arithmetic["eval"], "builtin", {
            "advantage": {"name": "grpo", "std": "none"}, "policy_loss": {"name": "reinforce"}})
    finally:
        sys.modules.pop("my_objective_e2e", None)
    start = load_file(Path(tiny_model) / "model.safetensors")
    mine, builtin = load_file(mine), load_file(builtin)
    assert any(not torch.equal(start[k], mine[k]) for k in start)  # it trained
    for key in start:  # and it is the same update as the built-in pair's
        torch.testing.assert_close(mine[key], builtin[key], rtol=1e-4, atol=1e-5)

"""Colocated policy and engine take turns: the engine sleeps while the policy trains, the policy
offloads its optimizer state while the engine generates, and the numbers do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from reroll.config import load_config
from reroll.pipelines.rlvr import rlvr_pipeline
from reroll.tracking import read_metrics
from reroll.training.offload import OptimizerOffload, optimizer_state_tensors


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """Bytes of optimizer state on devices of `device_type`."""
    return sum(t.numel() * t.element_size() for _, _, t in optimizer_state_tensors(optimizer)
               if t.device.type == device_type)


def adam_after_one_step(device: str) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optimizer)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.linspace(-1, 1, 8 * 256, device=next(model.parameters()).device).reshape(8, 256)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.unit
def test_offload_on_cpu_moves_nothing_and_changes_nothing():
    """On a CPU-only machine the optimizer state already is in host memory: nothing to free."""
    model, optimizer = adam_after_one_step("cpu")
    reference, reference_optimizer = adam_after_one_step("cpu")
    offload = OptimizerOffload(optimizer)
    assert offload.offload() == 0 and offload.offloaded
    offload.reload()
    step(model, optimizer)
    step(reference, reference_optimizer)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_frees_the_optimizer_state_on_the_gpu():
    model, optimizer = adam_after_one_step("cuda")
    reference, reference_optimizer = adam_after_one_step("cuda")
    state_bytes = optimizer_state_bytes(optimizer, "cuda")
    assert state_bytes > 0
    before = torch.cuda.memory_allocated()
    offload = OptimizerOffload(optimizer)
    assert offload.offload() == state_bytes
    assert optimizer_state_bytes(optimizer, "cuda") == 0
    assert torch.cuda.memory_allocated() <= before - state_bytes
    offload.reload()
    assert optimizer_state_bytes(optimizer, "cuda") == state_bytes
    step(model, optimizer)
    step(reference, reference_optimizer)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def run_config(tmp_path: Path, tiny_model: str, arithmetic: dict, name: str, **distributed):
    data = {
        "name": name, "output_dir": str(tmp_path / name), "seed": 5, "steps": 3,
        "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 10},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 3, "max_prompts": 8},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": distributed,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@pytest.mark.e2e
def test_colocated_run_takes_turns_in_order_and_matches_the_separate_run(tmp_path, tiny_model,
                                                                          arithmetic):
    separate = rlvr_pipeline(run_config(tmp_path, tiny_model, arithmetic, "separate"))
    separate.run()
    colocated = rlvr_pipeline(run_config(tmp_path, tiny_model, arithmetic, "colocated",
                                        rollout={"colocate_with": "policy"}))
    colocated.run()
    # The first evaluation is the rollout's turn; then every step: score and train, sync and
    # generate. Training while the optimizer state is offloaded would have raised.
    one_step = ["engine.sleep", "policy.reload", "policy.offload", "engine.wake"]
    assert colocated.step.turns.history == ["policy.offload"] + one_step * 3
    rows, expected = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "separate")
    assert [r["colocation/swaps"] for r in rows] == [5, 4, 4]  # step 1 counts the first eval's
    for row, reference in zip(rows, expected, strict=True):
        for key in ("train/reward_mean", "train/loss", "train/grad_norm", "eval/reward_mean"):
            assert row.get(key) == reference.get(key), key

"""A whole PPO run (GAE, a critic, a KL reference) on the tiny VLM with `distributed.executor:
ray`: 2 FSDP2 policy workers, the reference and the critic colocated with them, the HF engine in
an engine actor fed by the object store. The images go to the engine actor (in each request's
model inputs) and to the policy, reference and critic workers (in each trajectory's): the
engine's and the trainer's logprobs agree, the engine's are the model's on those images, not on
blank ones, and so are the critic worker's values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from reroll.config import load_config
from reroll.data.batch import collate, model_kwargs
from reroll.data.images import write_count_task
from reroll.models.loading import load_tokenizer
from reroll.pipelines.rlvr import train
from reroll.rollout.recording import batch_path, load_batch
from reroll.tracking import read_metrics
from reroll.training.critic import load_value_model

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"  # parity_reward.py


def vlm_ray_run(tmp_path: Path, tiny_vlm: str, name: str) -> list[dict]:
    task = write_count_task(tmp_path / f"{name}-task", train_size=8, eval_size=2, seed=0)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "output_dir": str(tmp_path / name), "seed": 0, "steps": 2,
        "model": {"path": tiny_vlm},
        "data": {"train": str(task["train"])},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        # Odd vs even response length: a random model's groups carry signal, so the step trains.
        "reward": {"type": "custom", "function": "parity_reward:odd_length"},
        # the reference and the critic score the images too
        "algorithm": {"kl": {"coef": 0.05}, "advantage": {"name": "gae", "lam": 0.95},
                      "critic": {"lr": 1e-2}},
        "optimizer": {"lr": 1e-3},
        # one micro-batch: the critic's values_mean is one forward's, comparable below
        "train": {"micro_batch_size": 4, "num_threads": 1},
        "checkpoint": {"every_steps": 1},
        "tracking": {"progress": False, "tensorboard": False},
        "distributed": {"executor": "ray", "policy": {"num_workers": 2, "num_cpus": 0.5},
                        "rollout": {"num_cpus": 0.5}, "reference": {"colocate_with": "policy"},
                        "weight_sync": "object_store"},
    }))
    summary = train(load_config(config))
    assert summary["steps"] == 2
    return read_metrics(tmp_path / name)


def trainer_logprobs(model_path: str, tensors, blank: bool = False):
    """The one-process trainer's logprobs of a collated batch (`blank`: every pixel white)."""
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.models.loading import load_model
    from reroll.training.local import LocalStrategy

    tensors = tensors.clone()
    if blank:
        pixels = tensors["model_inputs"]["pixel_values"]["values"]
        pixels.copy_(torch.ones_like(pixels))
    strategy = LocalStrategy(load_model(model_path), OptimizerConfig(), TrainConfig(), 1)
    return strategy.forward_logprobs(tensors)


def test_a_ray_ppo_run_on_a_vlm_trains_on_its_images(ray_session, tiny_vlm, tmp_path,
                                                      monkeypatch):
    monkeypatch.syspath_prepend(str(PIPELINES))
    rows = vlm_ray_run(tmp_path, tiny_vlm, "images")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["train/grad_norm"] > 0 and row["train/reward_std"] > 0
        # The policy workers score the engine actor's tokens with the same images and the
        # weights it was sent; a loss forward without the pixel values parts from the engine
        # (behaviour KL 0.012 at step 1, measured by dropping them).
        assert row["actor/behaviour_kl_k3"] < 1e-6, row
    # The reference worker (the initial weights) read the images too: at step 1 it is the policy.
    assert rows[0]["actor/kl_ref"] < 1e-6 < rows[1]["actor/kl_ref"]
    # The engine actor sampled step 1 from the images: its logprobs are the initial model's on
    # these rows with their images, and part from those with blank images (same weights, rows
    # and text; the pixels alone differ).
    sampled = load_batch(batch_path(tmp_path / "images", 1))
    tensors, _ = collate(sampled, pad_token_id=load_tokenizer(tiny_vlm).pad_token_id)
    mask = tensors["response_mask"].bool()
    engine = tensors["behaviour_logprobs"][mask]
    assert trainer_logprobs(tiny_vlm, tensors)[mask] == pytest.approx(engine, abs=1e-4)
    blank = trainer_logprobs(tiny_vlm, tensors, blank=True)[mask]
    assert (blank - engine).abs().max() > 1e-3

    # The critic worker read the images: its values of step 2's batch (one forward, the critic
    # of step 1's checkpoint) are those of a one-process value model with the images, and part
    # from those with blank images.
    critic = load_value_model(str(tmp_path / "images" / "checkpoints" / "step_1" / "critic_0"))
    tensors, _ = collate(load_batch(batch_path(tmp_path / "images", 2)),
                         pad_token_id=load_tokenizer(tiny_vlm).pad_token_id)
    mask = tensors["response_mask"].float()
    with torch.no_grad():
        values = critic(tensors["input_ids"], tensors["attention_mask"], model_kwargs(tensors))
        pixels = tensors["model_inputs"]["pixel_values"]["values"]
        pixels.copy_(torch.ones_like(pixels))
        blank = critic(tensors["input_ids"], tensors["attention_mask"], model_kwargs(tensors))
    mean = float((values * mask).sum() / mask.sum())
    assert rows[1]["critic/values_mean"] == pytest.approx(mean, abs=1e-5)
    assert abs(float((blank * mask).sum() / mask.sum()) - mean) > 1e-4

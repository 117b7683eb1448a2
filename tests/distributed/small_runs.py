"""Test helper: the small GRPO run (tiny model, arithmetic data, 4 prompts x 4 samples) that the
ray and multinode tests run under one layout or another and compare with the one-process run."""

from __future__ import annotations

from pathlib import Path

import yaml

from reroll.config import load_config
from reroll.config.schema import RLConfig


def small_run_config(tmp_path: Path, tiny_model: str, arithmetic: dict, name: str, *,
                     steps: int, micro_batch_size: int = 8, eval_every: int | None = None,
                     checkpoint_every: int | None = None, kl_coef: float | None = None,
                     algorithm: dict | None = None, task_reward: dict | None = None,
                     **distributed) -> RLConfig:
    """The run ``name`` (written to ``tmp_path/name``), evaluated every ``eval_every`` steps
    (default: at its end); ``distributed`` is the config's `distributed` section, ``task_reward`` its
    `reward` (default: math)."""
    data = {
        "name": name, "output_dir": str(tmp_path / name), "seed": 3, "steps": steps,
        "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": micro_batch_size, "num_threads": 1},
        "eval": {"every_steps": eval_every or steps, "max_prompts": 8, "temperature": 1.0},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": distributed,
    }
    if task_reward is not None:
        data["reward"] = task_reward
    if checkpoint_every is not None:
        data["checkpoint"] = {"every_steps": checkpoint_every, "keep_last": 3}
    data["algorithm"] = (algorithm or {}) | ({"kl": {"coef": kl_coef}} if kl_coef is not None
                                             else {})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def watch_reward_actors(monkeypatch) -> dict:
    """`seen["actors"]`, once a run has started its reward actors: the names of the live Ray
    actors then (a placed reward's actors are named `reroll-<run>-reward-<i>`)."""
    import ray

    from reroll.pipelines import roles

    seen, start = {}, roles.start_reward_actors

    def start_and_look(*args, **kwargs):
        actors = start(*args, **kwargs)
        seen["actors"] = set(ray.util.list_named_actors())
        return actors

    monkeypatch.setattr(roles, "start_reward_actors", start_and_look)
    return seen

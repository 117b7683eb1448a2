"""GRPO with `distributed.executor: ray` (2 FSDP2 policy workers, engine actor): the same run as
the one-process executor (with the engine colocated and weights broadcast), and a run whose
policy actor is killed (engine on CPUs of its own, weights through the object store) restarts
and finishes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml
from small_runs import small_run_config

from reroll.config import load_config
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


def make_config(tmp_path: Path, tiny_model: str, arithmetic: dict, name: str, **distributed):
    return small_run_config(tmp_path, tiny_model, arithmetic, name, steps=4, micro_batch_size=4,
                            eval_every=2, checkpoint_every=2, **distributed)


def test_ray_executor_with_fsdp2_reproduces_the_local_run(ray_session, tmp_path, tiny_model,
                                                          arithmetic):
    local = train(make_config(tmp_path, tiny_model, arithmetic, "local"))
    # The engine actor takes turns with the policy on its CPUs (an engine generating while asleep
    # or a policy training with its optimizer state offloaded would fail) and receives the
    # weights by a gloo broadcast from the policy's rank 0.
    ray_run = train(make_config(tmp_path, tiny_model, arithmetic, "ray", executor="ray",
                                policy={"num_workers": 2}, rollout={"colocate_with": "policy"},
                                weight_sync="broadcast", bucket_mb=1))
    local_rows, ray_rows = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["step"] for r in ray_rows] == [1, 2, 3, 4]
    # Step 1 samples from the same initial weights: the same batch, the same loss.
    assert ray_rows[0]["train/reward_mean"] == local_rows[0]["train/reward_mean"]
    assert ray_rows[0]["train/loss"] == pytest.approx(local_rows[0]["train/loss"], abs=1e-5)
    local_curve = [r["eval/reward_mean"] for r in local_rows if "eval/reward_mean" in r]
    ray_curve = [r["eval/reward_mean"] for r in ray_rows if "eval/reward_mean" in r]
    assert ray_curve == pytest.approx(local_curve, abs=0.15)
    assert ray_run["eval_reward_start"] == local["eval_reward_start"]
    assert all(r["time/weight_sync_s"] > 0 and r["colocation/swaps"] >= 4 for r in ray_rows)


def test_killed_policy_actor_restarts_and_resumes_from_checkpoint(ray_session, tmp_path,
                                                                  tiny_model, arithmetic):
    import ray

    config = make_config(tmp_path, tiny_model, arithmetic, "killed", executor="ray",
                         policy={"num_workers": 2}, rollout={"num_cpus": 0.5}, max_restarts=1)
    config.steps = 6
    marker = tmp_path / "killed" / "checkpoints" / "step_2" / "trainer_state.pt"

    def kill_after_first_checkpoint():
        while not marker.exists():
            time.sleep(0.05)
        ray.kill(ray.get_actor("reroll-killed-policy-1"), no_restart=True)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    summary = train(config)
    killer.join(timeout=1)
    assert summary["restarts"] == 1
    rows = read_metrics(tmp_path / "killed")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps after step 2 were redone
    assert all(r.get("fault/restarts") == 1 for r in rows[2:])
    assert "fault/restarts" not in rows[0]


def test_killed_policy_actor_of_an_agentic_run_restarts_it(ray_session, tmp_path, tiny_model):
    """Agentic runs go through the same restart supervisor: `distributed.max_restarts` applies."""
    import ray

    from reroll.pipelines.agentic import train_agentic

    data = {
        "pipeline": "agentic", "name": "agent-killed", "output_dir": str(tmp_path / "agent"),
        "seed": 3, "steps": 4, "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "algorithm": {"advantage": {"name": "rebn"}},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 2, "keep_last": 3},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": {"executor": "ray", "rollout": {"num_cpus": 0.5}, "max_restarts": 1},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    marker = tmp_path / "agent" / "checkpoints" / "step_2" / "trainer_state.pt"

    def kill_after_first_checkpoint():
        while not marker.exists():
            time.sleep(0.05)
        ray.kill(ray.get_actor("reroll-agent-killed-policy-0"), no_restart=True)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    summary = train_agentic(load_config(path))
    killer.join(timeout=1)
    assert summary["restarts"] == 1
    rows = read_metrics(tmp_path / "agent")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps after step 2 were redone
    assert all(r.get("fault/restarts") == 1 for r in rows[2:])
    assert "fault/restarts" not in rows[0]

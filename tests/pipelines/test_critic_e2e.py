"""PPO with a critic in the RLVR pipeline: the critic's warm-up leaves the policy alone, AsyPPO's
mini-critics diverge and mask tokens, and a run with critics and an adaptive KL resumes exactly.
(Reward improvement of the ppo recipe: test_recipes_e2e.py.)"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_recipes_e2e import recipe_config, shared_warm_model, weights_changed

from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
SMALL = {"rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24},
         "train": {"micro_batch_size": 8}}


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def test_during_critic_warmup_only_the_critic_learns(tmp_path, warm_model):
    config = recipe_config("ppo", tmp_path / "run", warm_model, steps=2,
                           algorithm={"critic": {"warmup_steps": 2, "lr": 1e-3}}, **SMALL)
    summary = train(config)
    rows = read_metrics(tmp_path / "run")
    assert all(r["train/policy_skipped"] == 1.0 and "critic/loss" in r for r in rows)
    assert not any("actor/entropy" in r for r in rows)
    final = Path(summary["final_checkpoint"])
    assert not weights_changed(Path(warm_model["model"]), final)
    head = load_file(final / "critic_0" / "model.safetensors")["value_head.weight"]
    assert head.abs().sum() > 0  # the value head started at 0


def test_asyppo_mini_critics_diverge_and_mask_tokens(tmp_path, warm_model):
    config = recipe_config("asyppo", tmp_path / "run", warm_model, steps=2, **SMALL)
    summary = train(config)
    last = read_metrics(tmp_path / "run")[-1]
    assert 0.1 < last["critic/advantage_masked_frac"] < 0.4  # the 20% most agreed-on tokens
    assert 0.1 < last["critic/entropy_masked_frac"] < 0.4
    assert last["critic/disagreement_mean"] > 0
    final = Path(summary["final_checkpoint"])
    a = load_file(final / "critic_0" / "model.safetensors")
    b = load_file(final / "critic_1" / "model.safetensors")
    assert not torch.equal(a["value_head.weight"], b["value_head.weight"])


def test_resume_with_critics_and_an_adaptive_kl_reproduces_the_run(tmp_path, warm_model):
    algorithm = {"kl": {"coef": 0.05, "mode": "reward", "estimator": "k1",
                        "controller": {"name": "adaptive", "target": 0.01, "horizon": 50}},
                 "updates_per_batch": 2}
    data = {"algorithm": algorithm, "checkpoint": {"every_steps": 2, "keep_last": 3}, **SMALL}
    train(recipe_config("asyppo", tmp_path / "run", warm_model, steps=4, **data))
    full = read_metrics(tmp_path / "run")
    assert len({r["kl/coef"] for r in full}) > 1  # the controller moved

    # Pretend the run died during step 3: only the step-2 checkpoint and 2 rows of metrics exist.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(tmp_path / "run", interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_4")
    lines = (interrupted / "metrics.jsonl").read_text().splitlines()[:3]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    config = recipe_config("asyppo", interrupted, warm_model, steps=4, resume=True, **data)
    summary = train(config)
    resumed = read_metrics(interrupted)
    assert summary["resumed_from_step"] == 2
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if not k.startswith("time/")}, a["step"]


def test_ppo_with_a_critic_and_a_reference_on_the_tiny_vlm_s_image_task(tmp_path, tiny_vlm,
                                                                        monkeypatch):
    """GAE on image prompts, started as a user starts it: the critic (the VLM's multimodal base
    model and a value head) and the reference read the images; 2 steps with finite metrics and
    the critic saved with the VLM's config."""
    import json
    import math

    import yaml

    from reroll.cli import main
    from reroll.data.images import write_count_task

    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(Path(__file__).resolve().parents[2] / "examples")
    paths = write_count_task(tmp_path / "task", train_size=4, eval_size=1, seed=0)
    Path("ppo.yaml").write_text(yaml.safe_dump({
        "output_dir": "run", "model": {"path": tiny_vlm}, "steps": 2,
        "data": {"train": str(paths["train"])},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "reward": {"type": "custom", "function": "examples.vlm.reward:count"},
        "algorithm": {"advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95},
                      "kl": {"coef": 0.001, "estimator": "k1", "mode": "reward"},
                      "critic": {"lr": 1e-3}},
        "train": {"micro_batch_size": 4, "num_threads": 1},
        "checkpoint": {"every_steps": 0}, "tracking": {"progress": False, "tensorboard": False}}))
    assert main(["train", "ppo.yaml"]) == 0
    rows = read_metrics(Path("run"))
    assert len(rows) == 2
    for row in rows:
        assert row["critic/update_skipped"] == row["train/update_skipped"] == 0, row
        for key in ("critic/loss", "critic/grad_norm", "critic/values_mean", "train/loss",
                    "train/grad_norm", "kl/reward_kl_mean"):
            assert math.isfinite(row[key]), (key, row)
    critic = Path("run/checkpoints/step_2/critic_0")
    assert json.loads((critic / "config.json").read_text())["model_type"] == "idefics3"

"""Every recipe of examples/recipes/ runs end to end on the tiny model, and the main methods (GRPO,
DAPO, Lite PPO, GSPO, PPO with a critic) raise the reward on a fixed prompt set in a short run."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.config.loading import read_yaml, validate
from reroll.config.schema import RLConfig
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))


def shared_warm_model(session_cache, tiny_model) -> dict:
    """The tiny model after a short SFT on single-digit additions (as in test_rlvr_e2e.py), built
    once per test session (`session_cache`: shared by the xdist workers too), for every module
    that asks for it."""
    from reroll.data.tasks import write_arithmetic
    from reroll.pipelines.sft import train_sft

    def build(root: Path) -> None:
        data = write_arithmetic(root / "data", train_size=1200, eval_size=16, seed=0, levels=(1,))
        config = root / "sft.yaml"
        config.write_text(yaml.safe_dump({
            "pipeline": "sft", "output_dir": str(root / "sft"), "model": {"path": tiny_model},
            "data": {"train": str(data["train"]), "response_key": "solution"},
            "epochs": 3.0, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
            "train": {"micro_batch_size": 32},
            "tracking": {"progress": False, "tensorboard": False}}))
        train_sft(load_config(config, expect="sft"))

    root = session_cache("warm-arithmetic", build)
    return {"model": str(root / "sft" / "final"), "train": str(root / "data" / "train.jsonl"),
            "eval": str(root / "data" / "eval.jsonl")}


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def recipe_config(name: str, run_dir: Path, warm: dict, steps: int, **sections) -> RLConfig:
    """A recipe with the warm model, the 16 fixed prompts of `warm["eval"]` and small budgets."""
    data = read_yaml(ROOT / "examples" / "recipes" / f"{name}.yaml")
    data |= {"output_dir": str(run_dir), "seed": 1, "steps": steps,
             "model": {"path": warm["model"]}, "data": {"train": warm["eval"]},
             "optimizer": {"lr": 3e-4}, "eval": {"every_steps": 0},
             "checkpoint": {"every_steps": 0},
             "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 2}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return validate(RLConfig, data, name)


def weights_changed(before: Path, after: Path) -> bool:
    a, b = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    return any(not torch.equal(a[k], b[k]) for k in a)


# What each recipe must show in its metrics besides the common ones.
EXPECTED = {
    "ppo": {"critic/loss", "critic/explained_var", "kl/coef", "kl/reward_kl_mean"},
    "asyppo": {"critic/loss", "critic/advantage_masked_frac", "critic/entropy_masked_frac"},
    "dapo": {"filter/groups_kept", "filter/groups_dropped", "train/overlong_penalty_mean"},
    "grpo": {"actor/kl_ref", "kl/coef"},
    "reinforce_pp": {"kl/reward_kl_mean", "kl/coef"},
    "gspo": {"actor/seq_ratio_mean"},
    "topr": {"actor/neg_frac"},
}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_runs_end_to_end(tmp_path, warm_model, path):
    config = recipe_config(path.stem, tmp_path / "run", warm_model, steps=2,
                           rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24},
                           train={"micro_batch_size": 8})
    summary = train(config)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        assert torch.isfinite(torch.tensor(row["train/loss"])), row
        assert {"train/reward_mean", "actor/entropy", "time/step_s"} <= set(row)
        assert EXPECTED.get(path.stem, set()) <= set(row), path.stem
    final = Path(summary["final_checkpoint"])
    assert weights_changed(Path(warm_model["model"]), final)
    critics = config.algorithm.critic.num_critics if config.algorithm.critic else 0
    assert sorted(p.name for p in final.glob("critic_*")) == [f"critic_{m}" for m in range(critics)]


@pytest.mark.parametrize("name", ["grpo", "dapo", "lite_ppo", "gspo", "ppo"])
def test_recipe_raises_the_reward_on_a_fixed_prompt_set(tmp_path, warm_model, name):
    """16 fixed prompts, all used every step, 8 responses each, lr 3e-4, 16 steps (the pattern of
    test_grpo_raises_reward_and_changes_weights). Means over 4 steps: DAPO's dynamic sampling
    makes a step's reward noisy, and over 12 steps with 3-step means a change of float rounding
    alone (the chunked LM head, values equal to 1e-7) moved it from passing to failing."""
    config = recipe_config(name, tmp_path / "run", warm_model, steps=16,
                           rollout={"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 24},
                           train={"micro_batch_size": 32})
    train(config)
    rewards = [r["train/reward_mean"] for r in read_metrics(tmp_path / "run")]
    early, late = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert late > early + 0.08, (name, early, late, rewards)

"""The agentic demo, shortened: a tiny model with a tokenizer trained on guess-the-number's text,
SFT on a careless expert (it scans upwards in most episodes and bisects in the rest, so imitating
its likeliest move scans), then multi-turn GRPO. The held-out greedy success rate must rise: RL
finds that bisecting pays. The full demo is `make demo-agentic` (docs/agentic.md)."""

from __future__ import annotations

import json

import pytest
import yaml

from reroll.cli import main
from reroll.envs.episodes import expert_rows, write_expert_rows
from reroll.envs.guess_number import GuessNumberEnv
from reroll.models.factory import make_model

ENV = {"high": 8, "max_turns": 3}
CARELESS = {"noise": 0.6, "careless": "scan", "noise_scope": "episode"}


def write_yaml(path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def expert_episode(env: GuessNumberEnv, seed: int) -> tuple[int, list[int]]:
    """(the hidden number, the expert's guesses) of one episode."""
    _, info = env.reset(seed)
    guesses = []
    for _ in range(env.max_turns):
        guesses.append(int(env.expert_action()))
        if env.step(str(guesses[-1]))[2]:
            break
    return info["target"], guesses


def bisection(target: int, low: int, high: int, turns: int) -> list[int]:
    guesses = []
    while len(guesses) < turns and (not guesses or guesses[-1] != target):
        guesses.append((low + high) // 2)
        low, high = (guesses[-1] + 1, high) if guesses[-1] < target else (low, guesses[-1] - 1)
    return guesses


@pytest.mark.unit
def test_the_careless_expert_scans_whole_episodes_or_bisects_them():
    env = GuessNumberEnv(**ENV, **CARELESS)
    scans = 0
    for seed in range(200):
        target, guesses = expert_episode(env, seed)
        scanned = guesses == list(range(1, min(target, 3) + 1))
        assert scanned or guesses == bisection(target, 1, 8, 3), (target, guesses)
        scans += scanned
    assert 0.5 < scans / 200 < 0.7  # noise: 0.6


@pytest.mark.e2e
def test_rl_lifts_the_success_rate_of_the_sft_warm_start(tmp_path):
    rows = expert_rows("guess_number", 600, seed=0, kwargs={**ENV, **CARELESS})
    episodes = write_expert_rows(tmp_path / "sft.jsonl", rows)
    corpus = episodes.read_text().splitlines(keepends=True)  # as `make-model --corpus` reads it
    model = make_model(tmp_path / "model", "tiny", corpus=corpus, seed=0)
    quiet = {"tensorboard": False, "progress": False}
    sft = write_yaml(tmp_path / "sft.yaml", {
        "pipeline": "sft", "name": "sft", "output_dir": str(tmp_path / "sft"), "seed": 0,
        "model": {"path": str(model)}, "data": {"train": str(episodes)},
        "epochs": 3.0, "batch_size": 32,
        "optimizer": {"lr": 3e-3, "warmup_steps": 10, "schedule": "cosine"},
        "train": {"micro_batch_size": 32, "num_threads": 1}, "tracking": quiet})
    assert main(["sft", sft]) == 0
    rl = write_yaml(tmp_path / "rl.yaml", {
        "pipeline": "agentic", "name": "rl", "output_dir": str(tmp_path / "rl"), "seed": 0,
        "steps": 10, "model": {"path": str(tmp_path / "sft" / "final")},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3, "max_context_tokens": 128,
                "eval_episodes": 64},
        "rollout": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 4,
                    "temperature": 1.0},
        "algorithm": {"advantage": {"name": "grpo"}, "policy_loss": {"name": "ppo"}},
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": 64, "num_threads": 1},
        "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0}, "tracking": quiet})
    assert main(["train", rl]) == 0
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    # The reward is 1 for finding the number, so the eval reward is the success rate.
    before, after = summary["eval_reward_start"], summary["eval_reward_end"]
    # Imitating the expert's likeliest move scans 1, 2, 3: 3 of the 8 numbers found in 3 turns.
    assert before <= 0.5, summary
    assert after >= before + 0.25, summary

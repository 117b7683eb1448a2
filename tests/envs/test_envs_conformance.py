"""Every built-in env: the reset/step contract, seeding, and its scripted expert solves it."""

from __future__ import annotations

import asyncio

import pytest

from reroll.config.errors import ConfigError
from reroll.envs import AsyncVectorEnv, EnvError, env_specs, make_env, step_async
from reroll.envs.countdown import evaluate, solve

ENV_IDS = sorted(env_specs())
SANDBOXED = {"math_python", "terminal", "terminal_tasks"}


def _seeds(env_id: str) -> range:
    return range(3) if env_id in SANDBOXED else range(20)


def play_expert(env, seed: int) -> tuple[float, dict, list[str]]:
    obs, info = env.reset(seed)
    assert isinstance(obs, str) and obs and isinstance(info, dict)
    total, observations = 0.0, [obs]
    for _ in range(50):
        obs, reward, terminated, truncated, info = env.step(env.expert_action())
        assert isinstance(obs, str) and isinstance(reward, float)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        total += reward
        observations.append(obs)
        if terminated or truncated:
            return total, info, observations
    raise AssertionError("the expert's episode never ended")


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_expert_solves_every_seed(env_id):
    for seed in _seeds(env_id):
        total, info, _ = play_expert(make_env(env_id), seed)
        assert info["success"] and total == 1.0, (env_id, seed)
        assert info["episode"]["success"] and info["episode"]["return"] == 1.0


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_same_seed_same_episode_other_seed_other_task(env_id):
    first = play_expert(make_env(env_id), 7)[2]
    assert play_expert(make_env(env_id), 7)[2] == first
    starts = {repr(make_env(env_id).reset(seed)) for seed in range(12)}
    assert len(starts) > 1, "different seeds should give different tasks"


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_nonsense_actions_end_by_the_turn_limit_without_reward(env_id):
    env = make_env(env_id, max_turns=3) if env_id != "math_python" else make_env(env_id)
    env.reset(0)
    total, done, turns = 0.0, False, 0
    while not done:
        _, reward, terminated, truncated, _ = env.step("blah ~~")
        total, done, turns = total + reward, terminated or truncated, turns + 1
        assert turns <= 10
    assert total == 0.0


def test_guess_number_feedback():
    env = make_env("guess_number", low=1, high=8)
    env.reset(3)
    target = env.target
    assert "Higher" in env.step(str(target - 1))[0] if target > 1 else True
    obs, reward, terminated, _, info = env.step(f"my guess is \\boxed{{{target}}}")
    assert (obs, reward, terminated, info["success"]) == ("Correct!", 1.0, True, True)


def test_countdown_checks_numbers_and_value():
    assert evaluate("(3 + 4) * 2")[0] == 14
    with pytest.raises(ValueError):
        evaluate("__import__('os')")
    expression = solve([3, 4, 2], 14)
    assert evaluate(expression)[0] == 14
    env = make_env("countdown")
    env.reset(0)
    assert "not available" in env.step("99 + 1")[0]


def test_terminal_state_persists_between_commands_and_test_decides():
    env = make_env("terminal")
    env.reset(0)
    env.step("echo hi > note.txt")
    obs, *_ = env.step("cat note.txt")
    assert "hi" in obs and "[exit 0]" in obs
    obs, reward, terminated, _, info = env.step("submit")  # the task was not done
    assert (reward, terminated, info["success"]) == (0.0, True, False)


def test_python_tool_runs_code_in_the_sandbox():
    env = make_env("math_python")
    env.reset(1)
    obs, reward, terminated, _, _ = env.step("```python\nprint(6 * 7)\n```")
    assert obs == "Output: 42" and reward == 0.0 and not terminated


def test_unknown_env_and_bad_kwargs_are_config_errors():
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        make_env("nope")
    with pytest.raises(ConfigError, match="env.kwargs"):
        make_env("guess_number", colour="red")


class SlowEnv:
    def __init__(self, delay: float):
        self.delay = delay

    def reset(self, seed=None):
        return "start", {}

    def step(self, action):
        import time

        time.sleep(self.delay)
        if action == "boom":
            raise RuntimeError("broken env")
        return action, 0.0, False, False, {}


def test_vector_env_steps_concurrently_and_isolates_failures():
    vec = AsyncVectorEnv(lambda: SlowEnv(0.2), 4, step_timeout_s=5)

    async def run():
        await vec.reset([0, 1, 2, 3])
        return await vec.step(["a", "boom", "c", "d"])

    results = asyncio.run(run())
    assert isinstance(results[1], EnvError) and "broken env" in str(results[1])
    assert [r[0] for i, r in enumerate(results) if i != 1] == ["a", "c", "d"]


def test_step_timeout_raises_env_error():
    with pytest.raises(EnvError, match="longer than"):
        asyncio.run(step_async(SlowEnv(1.0), "x", timeout_s=0.1))

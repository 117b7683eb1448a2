"""An environment that keeps failing stops the run, loudly: each way a user's env breaks (a reset
that raises, a non-string observation, a wrong-shape step, a NaN reward, an `astep` that never
returns) fails its episodes as infrastructure failures (`env/infra_failure_frac`), and the
failure bound (`env.max_failure_rate_step`, `_run`) stops the run with the env and the failure
named. A reset that fails is tried again on a fresh env first (`env.reset_retries`)."""

from __future__ import annotations

import broken_envs
import pytest
import torch

from reroll.config.agentic import AgenticConfig
from reroll.config.algorithm import AlgorithmConfig
from reroll.config.errors import RunStopped
from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model
from reroll.pipelines import objective, rl
from reroll.pipelines.agentic import EnvTask

BROKEN = "broken_envs"  # tests/rollout/broken_envs.py, importable as the tests' own modules are


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    torch.set_num_threads(1)
    return HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)


def env_task(tiny_model, tokenizer, engine, env: str, **settings) -> EnvTask:
    config = AgenticConfig(
        model={"path": tiny_model}, seed=0, steps=1,
        env={"id": f"{BROKEN}:{env}", "isolation": "thread", "max_turns": 2,
             "max_context_tokens": 128, "eval_episodes": 0, "step_timeout_s": 0.5,
             "reset_backoff_s": 0.0} | settings,
        rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3})
    task = EnvTask(config, tokenizer)
    task.start(engine)
    return task


def params(tokenizer) -> SamplingParams:
    return SamplingParams(3, 1.0, 1.0, 0, (tokenizer.eos_token_id,))


@pytest.mark.parametrize(("env", "failure"), [
    ("ResetRaises", "ConnectionError: sandbox unreachable (after 2 retries)"),
    ("NonStringObservation", "env reset must return (observation: str, info: dict)"),
    ("WrongShape", "env step must return (observation, reward, terminated, truncated"),
    ("NaNReward", "non-finite reward (nan)"),
    ("NeverReturns", "env step took longer than 0.5s"),
])
def test_an_env_that_fails_every_episode_stops_the_run_naming_env_and_failure(
        tiny_model, tokenizer, engine, env, failure):
    task = env_task(tiny_model, tokenizer, engine, env)
    with pytest.raises(RunStopped) as stopped:
        task.next_batch(1, params(tokenizer))
    message = str(stopped.value)
    assert "\n" not in message
    assert f"step 1: environment '{BROKEN}:{env}' failed in 8 of 8 episodes this step" in message
    assert "env.max_failure_rate_step" in message and failure in message, message


def test_half_the_episodes_failing_logs_the_share_and_the_run_bound_stops_it(
        tiny_model, tokenizer, engine):
    broken_envs.EveryOtherFails.made = iter(range(10**6))
    task = env_task(tiny_model, tokenizer, engine, "EveryOtherFails", reset_retries=0,
                    max_failure_rate_run=0.6)
    trajectories = task.next_batch(1, params(tokenizer))  # 50%: under both bounds
    assert task.metrics()["env/infra_failure_frac"] == 0.5
    assert [t.finish_reason == "env_error" for t in trajectories].count(True) == 4
    # The measurement: every episode that ran scored 1.0, so no survivor is pushed
    # (before: +0.866 each, from the failures' 0 in the group statistics).
    assert {t.reward for t in trajectories if t.finish_reason != "env_error"} == {1.0}
    obj = objective.build(AlgorithmConfig(), group_size=4)
    batch, _ = rl.collate_for_rl(trajectories, tokenizer.pad_token_id, obj)
    batch, dropped = rl.drop_failed_groups(batch, obj)
    assert dropped == {"train/infra_groups_dropped": 0.0}  # two valid members in each group
    assert objective.estimate_advantages(obj, batch)[0].abs().max() == 0
    task = env_task(tiny_model, tokenizer, engine, "EveryOtherFails", reset_retries=0)  # run: 0.5
    with pytest.raises(RunStopped, match=r"failed in 4 of 8 episodes this run so far \(50%\), "
                                         r"at or past the bound of 50% \(env.max_failure_rate_run"
                                         r"\); the last failure: .*lost the sandbox"):
        task.next_batch(1, params(tokenizer))


def test_a_failed_reset_is_tried_again_on_a_fresh_env(tiny_model, tokenizer, engine):
    broken_envs.FlakyReset.failures = iter(range(10**6))
    broken_envs.FlakyReset.limit = 2  # the first two resets raise
    task = env_task(tiny_model, tokenizer, engine, "FlakyReset", reset_retries=2)
    trajectories = task.next_batch(1, params(tokenizer))
    metrics = task.metrics()
    assert metrics["env/reset_retries"] >= 2 and metrics["env/infra_failure_frac"] == 0.0
    assert all(t.finish_reason != "env_error" for t in trajectories)
    # Without retries, the same two failures are two failed episodes.
    broken_envs.FlakyReset.failures = iter(range(10**6))
    task = env_task(tiny_model, tokenizer, engine, "FlakyReset", reset_retries=0)
    trajectories = task.next_batch(1, params(tokenizer))
    assert task.metrics()["env/infra_failure_frac"] == 2 / 8
    assert task.metrics()["env/reset_retries"] == 0.0


def test_evaluation_leaves_infra_failures_out_of_the_policys_score(tiny_model, tokenizer, engine):
    broken_envs.EveryOtherFails.made = iter(range(10**6))
    task = env_task(tiny_model, tokenizer, engine, "EveryOtherFails", reset_retries=0,
                    eval_episodes=4)
    metrics = task.evaluate(params(tokenizer))
    # Every episode that ran scored 1 (two turns); the failed half is not the policy's 0.
    assert metrics["eval/infra_failure_frac"] == 0.5
    assert metrics["eval/reward_mean"] == 1.0, metrics

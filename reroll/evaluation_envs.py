"""`reroll eval` of a multi-environment agentic run's model (`envs:`): each environment played
on its held-out seeds with its own settings (kwargs, turn limit, context, system prompt), as
training's evaluation plays them. `reroll.evaluation` summarizes the episodes."""

from __future__ import annotations

import functools
from typing import Any

from reroll.config.errors import ConfigError


def envs_settings(config, model: str, given: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """A multi-environment run: every env with held-out episodes (`eval_episodes`), each with
    its settings (`--episodes` replaces each one's `eval_episodes`); `--env` (another
    environment) takes none of them."""
    if "env" in given or "task" in given:
        return {}
    envs = [e.model_copy(update={"eval_episodes": given["episodes"]}) if "episodes" in given
            else e for e in config.envs]
    envs = [e for e in envs if e.eval_episodes]
    if not envs:
        names = ", ".join(e.name for e in config.envs)
        raise ConfigError(f"none of the run's envs ({names}) has eval_episodes; pass --env "
                          f"and --episodes")
    return {"envs": (envs, "envs")}


def play_entry(spec, entry, engine, tokenizer, params, env_processes
               ) -> tuple[list, dict[str, float]]:
    """`spec.n` episodes for each of the env's `eval_episodes` held-out seeds, under its own
    settings; `success_rate` besides the env/* counters. `env_processes(id, factory)`: the
    env host processes of a user's env, or None (`evaluation._env_processes`)."""
    from reroll.data.batch import infra_failed
    from reroll.envs.registry import env_arguments, make_env
    from reroll.models.files import model_context
    from reroll.rollout.agent_loop import AgentJob, run_episodes
    from reroll.rollout.context import from_config

    factory = functools.partial(make_env, entry.id,
                                **env_arguments(entry.id, entry.kwargs, entry.max_turns))
    factory()  # unknown ids and bad arguments fail here, as ConfigErrors
    hosts = env_processes(entry.id, factory)
    job = AgentJob(engine, tokenizer, hosts.make if hosts else factory, params,
                   max_turns=entry.max_turns,
                   max_context_tokens=entry.max_context_tokens or model_context(spec.model),
                   system_prompt=entry.system_prompt, context=from_config(entry.context),
                   history_thinking=entry.history_thinking or "keep")
    # Seeds far from training's (which count up from 0), as `_play_env`'s.
    seeds = [1_000_000 + spec.seed * 10_000 + i for i in range(entry.eval_episodes)]
    try:
        trajectories, stats = run_episodes(job, seeds, spec.n, spec.seed, step=0)
    finally:
        if hosts is not None:
            hosts.close()
    valid = [t for t in trajectories if not infra_failed(t)]
    success = sum(bool(t.reward_info.get("success", False)) for t in valid) / max(len(valid), 1)
    return trajectories, {"success_rate": success} | {
        k: v for k, v in stats.metrics().items() if k != "env/episodes"}

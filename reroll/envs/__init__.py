"""Environments for agentic RL: the Env protocol (GEM's reset/step on strings), a registry of
built-in environments with scripted experts, wrappers, an async vector env and the GEM adapter.
See docs/agentic.md."""

from reroll.envs.base import Env, EnvError, EnvSpec, reset_async, step_async
from reroll.envs.registry import env_specs, make_env
from reroll.envs.vector import AsyncVectorEnv
from reroll.envs.wrappers import ChatFormat, EpisodeStats, MaxTurns

__all__ = ["AsyncVectorEnv", "ChatFormat", "Env", "EnvError", "EnvSpec", "EpisodeStats",
           "MaxTurns", "env_specs", "make_env", "reset_async", "step_async"]

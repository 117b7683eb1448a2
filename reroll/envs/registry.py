"""The registry of environments: `make_env(id, **kwargs)`, `env_specs()` for `reroll envs`.

Built-in ids are listed here explicitly (no import-time side effects); `gem:<id>` makes any
environment of the gem-llm package. Every env comes wrapped in `EpisodeStats` and, when given
`max_turns`, in `MaxTurns`.
"""

from __future__ import annotations

from typing import Any

from reroll.config.errors import ConfigError
from reroll.envs.base import EnvSpec
from reroll.envs.countdown import CountdownEnv
from reroll.envs.gem_adapter import PREFIX as GEM_PREFIX
from reroll.envs.gem_adapter import GemEnv
from reroll.envs.grids import FrozenLakeEnv, SokobanEnv
from reroll.envs.guess_number import GuessNumberEnv
from reroll.envs.tools import MathEnv, PythonTool, TerminalEnv
from reroll.envs.wrappers import EpisodeStats, MaxTurns


def _math_python(max_turns: int = 4, **kwargs: Any) -> Any:
    return MaxTurns(PythonTool(MathEnv(**kwargs)), max_turns)


def env_specs() -> dict[str, EnvSpec]:
    specs = [
        EnvSpec("guess_number", GuessNumberEnv,
                "guess a hidden integer from higher/lower feedback (expert: bisection)"),
        EnvSpec("frozen_lake", FrozenLakeEnv,
                "walk a text-grid lake from S to G around holes (expert: shortest path)"),
        EnvSpec("sokoban", SokobanEnv,
                "push the box onto the target in a text grid (expert: BFS solver)"),
        EnvSpec("countdown", CountdownEnv,
                "reach the target number with + - * / over given numbers (expert: search)"),
        EnvSpec("math_python", _math_python,
                "arithmetic with a Python tool run in the Sandbox (expert: compute, then answer)"),
        EnvSpec("terminal", TerminalEnv,
                "shell tasks in a Sandbox, checked by the task's test script (Terminal-Bench style)"),
    ]
    return {spec.id: spec for spec in specs}


def make_env(env_id: str, **kwargs: Any) -> Any:
    """A fresh environment instance. Unknown ids and bad keyword arguments are ConfigErrors."""
    max_turns = kwargs.pop("max_turns", None) if env_id.startswith(GEM_PREFIX) else None
    if env_id.startswith(GEM_PREFIX):
        env = GemEnv(env_id[len(GEM_PREFIX):], **kwargs)
    else:
        specs = env_specs()
        if env_id not in specs:
            raise ConfigError(f"env.id: unknown environment {env_id!r} (built-in: {sorted(specs)}, "
                              f"or gem:<id> for a gem-llm environment; `reroll envs` lists them)")
        try:
            env = specs[env_id].factory(**kwargs)
        except TypeError as e:
            raise ConfigError(f"env.kwargs: {env_id} does not take these arguments ({e})") from None
        except ValueError as e:
            raise ConfigError(f"env.kwargs: {e}") from None
    if max_turns is not None:
        env = MaxTurns(env, max_turns)
    return EpisodeStats(env)


def env_arguments(env_id: str, kwargs: dict[str, Any], max_turns: int) -> dict[str, Any]:
    """The constructor arguments of `env_id`: `kwargs` plus the run's one turn limit
    (`env.max_turns`) for an environment that takes a `max_turns` of its own (every built-in,
    and gem ones through the `MaxTurns` wrapper), so the env and the agent loop agree on it."""
    import inspect

    spec = env_specs().get(env_id)
    takes = env_id.startswith(GEM_PREFIX) or (
        spec is not None and "max_turns" in inspect.signature(spec.factory).parameters)
    return {**kwargs, "max_turns": max_turns} if takes else dict(kwargs)

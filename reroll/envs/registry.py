"""The registry of environments: `make_env(id, **kwargs)`, `env_specs()` for `reroll envs`.

Built-in ids are listed here explicitly (no import-time side effects); `gem:<id>` makes any
environment of the gem-llm package; `module:Class` / `path/to/file.py:Class` a user's own
(`reroll.envs.user`). Every env comes wrapped in `EpisodeStats`; a gem env given `max_turns`
also in `MaxTurns`.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

from reroll.config.errors import ConfigError
from reroll.envs.base import EnvSpec
from reroll.envs.calculator import CalculatorEnv
from reroll.envs.countdown import CountdownEnv
from reroll.envs.gem_adapter import PREFIX as GEM_PREFIX
from reroll.envs.gem_adapter import GemEnv
from reroll.envs.grids import FrozenLakeEnv, SokobanEnv
from reroll.envs.guess_number import GuessNumberEnv
from reroll.envs.terminal_tasks import TerminalTasksEnv
from reroll.envs.tools import MathEnv, PythonTool, TerminalEnv
from reroll.envs.user import check_kwargs, check_protocol, is_user_id, load_factory
from reroll.envs.wrappers import EpisodeStats, MaxTurns


def _math_python(max_turns: int = 4, max_operand: int = 99) -> Any:
    """An arithmetic question answered in \\boxed{}, with a Python tool.

    Args:
        max_turns: most turns, tool calls and answers together.
        max_operand: largest operand of the question's `a * b + c`.
    """
    return MaxTurns(PythonTool(MathEnv(max_operand=max_operand)), max_turns)


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
        EnvSpec("calculator", CalculatorEnv,
                "big-number arithmetic with a native `calculator` tool call (expert: call, answer)"),
        EnvSpec("terminal", TerminalEnv,
                "shell tasks in a Sandbox, checked by the task's test script (Terminal-Bench style)"),
        EnvSpec("terminal_tasks", TerminalTasksEnv,
                "task folders in the Harbor/Terminal-Bench layout (`reroll make-terminal-tasks` "
                "writes a suite): shell commands in a Sandbox, the task's tests decide"),
    ]
    return {spec.id: spec for spec in specs}


def make_env(env_id: str, **kwargs: Any) -> Any:
    """A fresh environment instance. Unknown ids, bad keyword arguments and a user's object
    that is not an environment are ConfigErrors."""
    max_turns = kwargs.pop("max_turns", None) if env_id.startswith(GEM_PREFIX) else None
    specs = env_specs()
    if env_id.startswith(GEM_PREFIX):
        env = GemEnv(env_id[len(GEM_PREFIX):], **kwargs)
    elif env_id in specs:
        env = _built_in(specs[env_id], kwargs)
    elif is_user_id(env_id):
        env = _user_env(env_id, kwargs)
    else:
        raise ConfigError(f"env.id: unknown environment {env_id!r} (built-in: {sorted(specs)}; "
                          f"gem:<id> for a gem-llm environment; module:Class or "
                          f"path/to/file.py:Class for your own; `reroll envs` lists them)")
    if max_turns is not None:
        env = MaxTurns(env, max_turns)
    return EpisodeStats(env)


def _built_in(spec: EnvSpec, kwargs: dict[str, Any]) -> Any:
    try:
        return spec.factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"env.kwargs: {spec.id} does not take these arguments ({e})") from None
    except ValueError as e:
        raise ConfigError(f"env.kwargs: {e}") from None


def _user_env(env_id: str, kwargs: dict[str, Any]) -> Any:
    factory = load_factory(env_id)
    check_kwargs(env_id, factory, kwargs)
    try:
        env = factory(**kwargs)
    except ValueError as e:  # the env's own check of its arguments
        raise ConfigError(f"env.kwargs: {env_id}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a bug in the user's constructor, named where it is
        raise ConfigError(f"env.id {env_id!r}: building it with env.kwargs {kwargs} raised "
                          f"{type(e).__name__}: {e} ({_last_frame(e)})") from None
    check_protocol(env_id, env)
    return env


def _last_frame(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "no traceback"


def env_arguments(env_id: str, kwargs: dict[str, Any], max_turns: int) -> dict[str, Any]:
    """The constructor arguments of `env_id`: `kwargs` plus the run's one turn limit
    (`env.max_turns`) for an environment that takes a `max_turns` of its own (every built-in,
    gem ones through the `MaxTurns` wrapper, and a user's env whose constructor has one), so the env and the agent loop agree on it."""
    if env_id.startswith(GEM_PREFIX):
        takes = True
    else:
        spec = env_specs().get(env_id)
        factory = spec.factory if spec is not None else (
            load_factory(env_id) if is_user_id(env_id) else None)
        takes = factory is not None and _takes_max_turns(factory)
    return {**kwargs, "max_turns": max_turns} if takes else dict(kwargs)


def _takes_max_turns(factory: Any) -> bool:
    try:
        return "max_turns" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented callable has no signature
        return False

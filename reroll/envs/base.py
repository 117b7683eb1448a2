"""The Env contract (GEM's interface, on strings) and the helpers that call any env from asyncio.

    obs, info = env.reset(seed)                                   # the task, as text
    obs, reward, terminated, truncated, info = env.step(action)   # action: the model's text

An env may also define `async areset(seed)` / `async astep(action)` (I/O-bound envs: sandboxes,
remote services); the agent loop prefers them. Plain `reset`/`step` run in a worker thread so a
slow step never blocks the event loop that drives generation.

Built-in envs also offer `expert_action() -> str`: a scripted policy's next action, used for SFT
warm-start data and conformance tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...


class EnvError(RuntimeError):
    """An environment raised or exceeded its step time limit; only its episode fails."""


async def reset_async(env: Any, seed: int | None, timeout_s: float | None = None
                      ) -> tuple[str, dict[str, Any]]:
    call = env.areset(seed) if hasattr(env, "areset") else asyncio.to_thread(env.reset, seed)
    return checked_reset(await _guard(call, "reset", timeout_s))


async def step_async(env: Any, action: str, timeout_s: float | None = None) -> StepResult:
    call = env.astep(action) if hasattr(env, "astep") else asyncio.to_thread(env.step, action)
    return checked_step(await _guard(call, "step", timeout_s))


def checked_reset(result: Any) -> tuple[str, dict[str, Any]]:
    """`(obs, info)` as the protocol says, or an EnvError saying what came back instead (an
    old-gym env returning just the observation fails its episodes with this message)."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str)
            and isinstance(result[1], dict | None)):
        raise EnvError(f"env reset must return (observation: str, info: dict), not "
                       f"{_shape(result)}")
    return result[0], dict(result[1] or {})


def checked_step(result: Any) -> StepResult:
    """`(obs, reward, terminated, truncated, info)` with those types, or an EnvError."""
    if not (isinstance(result, tuple) and len(result) == 5):
        raise EnvError(f"env step must return (observation, reward, terminated, truncated, "
                       f"info), not {_shape(result)}")
    obs, reward, terminated, truncated, info = result
    if not isinstance(obs, str) or not isinstance(info, dict | None):
        raise EnvError(f"env step must return a str observation and a dict info, not "
                       f"{_shape(result)}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"env step returned a reward that is not a number: {reward!r}") from None
    return obs, reward, bool(terminated), bool(truncated), dict(info or {})


def _shape(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


async def _guard(call, what: str, timeout_s: float | None):
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise EnvError(f"env {what} took longer than {timeout_s}s") from None
    except EnvError:
        raise
    except Exception as e:  # noqa: BLE001 - any env bug fails the episode, not the run
        raise EnvError(f"env {what} raised {type(e).__name__}: {e}") from e


@dataclass
class EnvSpec:
    """One registered environment: how to build it and what it is."""

    id: str
    factory: Any
    """Callable(**kwargs) -> Env."""
    description: str
    multi_turn: bool = True

"""The Env contract (GEM's interface, on strings) and the helpers that call any env from asyncio.

    obs, info = env.reset(seed)                                   # the task, as text
    obs, reward, terminated, truncated, info = env.step(action)   # action: the model's text

An env may also define `async areset(seed)` / `async astep(action)` (I/O-bound envs: sandboxes,
remote services); the agent loop prefers them. Plain `reset`/`step` run in a thread of their own
so a slow step never blocks the event loop that drives generation. That thread is a daemon that
nothing joins: a call past its time limit is abandoned where it is (a thread cannot be
cancelled), and neither the event loop's end nor the interpreter's exit waits for it, as they
would for asyncio's default executor. An env that must be stopped for good, or that may take its
process down, runs in a process of its own (`reroll.envs.process`).

Built-in envs also offer `expert_action() -> str`: a scripted policy's next action, used for SFT
warm-start data and conformance tests.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
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
    call = env.areset(seed) if hasattr(env, "areset") else in_thread(env.reset, seed)
    return checked_reset(await _guard(call, "reset", timeout_s))


async def step_async(env: Any, action: str, timeout_s: float | None = None) -> StepResult:
    call = env.astep(action) if hasattr(env, "astep") else in_thread(env.step, action)
    return checked_step(await _guard(call, "step", timeout_s))


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a daemon thread of its own (not asyncio's default executor, whose
    threads `asyncio.run` and the interpreter's exit join: one env step that never returns would
    hang the run at the end of the rollout). Cancelling the await abandons the thread. A
    `SystemExit` or `KeyboardInterrupt` raised by the call is the env's failure, never the run's
    end."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # the caller may have given up (time limit, abort)
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = context.run(function, *args), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting episode
            result, error = None, e
        except BaseException as e:  # noqa: BLE001 - sys.exit() in an env ends its episode only
            name = getattr(function, "__name__", "call")
            result, error = None, EnvError(f"env {name} raised {type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: nobody waits for this call any more
            pass

    threading.Thread(target=run, daemon=True, name="reroll-env-call").start()
    return await future


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
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any env bug fails the episode only
        raise EnvError(f"env {what} raised {type(e).__name__}: {e}") from e


@dataclass
class EnvSpec:
    """One registered environment: how to build it and what it is."""

    id: str
    factory: Any
    """Callable(**kwargs) -> Env."""
    description: str
    multi_turn: bool = True

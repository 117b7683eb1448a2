"""Agent programs as episodes: each gets a task and a session of the gateway, and its calls
become training samples.

Two shapes of agent (`agent:` in an agentic config, docs/agentic.md):
- `entrypoint: "module:function"`: `async def function(task, base_url, api_key) -> float | None`
  (a plain function works too). It runs in its own thread with its own event loop, so a harness
  that blocks (the synchronous `openai` client) holds up no other episode.
- `command: [...]`: a subprocess with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `REROLL_TASK`
  (the task as JSON) in its environment and the task JSON on its stdin. A last stdout line that
  is a number (or `{"reward": x}`) is its return value; exit status 0 is success.

The episode's reward is the first of: a POST to the session's `reward` route, the agent's
return value, the verifier (`verifier(task, messages) -> float` on the final conversation).
Faults never stop the run; each fails its episode with a counted reason (`gateway/*`):
`crashed` (the harness raised or exited non-zero: an infrastructure failure, so its tokens are
masked from the loss, not scored 0), `timeout` (past `time_limit_s`: killed, its tokens masked
too), `no_calls` (it never called the endpoint: nothing to train), `no_reward` (no reward
from any source: masked). Calls after the episode ended get 409 and are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reroll.data.batch import Trajectory
from reroll.rollout.gateway.app import Gateway
from reroll.rollout.gateway.assembly import chains, faithful, trajectory
from reroll.rollout.gateway.session import Session

FAILURES = ("crashed", "timeout", "no_calls", "no_reward")


@dataclass
class AgentSpec:
    """How to run one episode's agent."""

    entrypoint: Callable | None = None
    command: list[str] | None = None
    time_limit_s: float = 300.0
    verifier: Callable[[Any, list[dict]], float] | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of a `command` agent."""


@dataclass
class AgentOutcome:
    status: str
    """`ok` or one of FAILURES."""
    value: Any = None
    error: str | None = None


@dataclass
class GatewayEpisodeStats:
    episodes: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURES, 0))
    calls: int = 0
    faithful_calls: int = 0
    chains: int = 0
    chains_dropped: int = 0
    """Earlier chains of episodes whose history was rewritten, not trained (see `one_sample`)."""
    tool_parse_errors: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        out = {"gateway/episodes": float(self.episodes), "gateway/calls_mean": self.calls / n,
               "gateway/faithful_fraction": self.faithful_calls / max(self.calls, 1),
               "gateway/chains_per_episode": self.chains / n,
               "gateway/chains_dropped": float(self.chains_dropped),
               "gateway/tool_parse_errors": float(self.tool_parse_errors),
               "gateway/refused_calls": float(self.refused)}
        return out | {f"gateway/{k}": float(v) for k, v in self.failures.items()}


async def run_agent(spec: AgentSpec, task: Any, base_url: str, key: str) -> AgentOutcome:
    """Run the agent once under its time limit; never raises."""
    try:
        if spec.entrypoint is not None:
            value = await asyncio.wait_for(_in_thread(spec.entrypoint, task, base_url, key),
                                           spec.time_limit_s)
            return AgentOutcome("ok", value)
        return await _subprocess(spec, task, base_url, key)
    except TimeoutError:
        return AgentOutcome("timeout", error=f"the agent ran past {spec.time_limit_s} s")
    except Exception as e:  # noqa: BLE001 - the harness's own failure, isolated here
        return AgentOutcome("crashed", error=f"{type(e).__name__}: {e}")


def _in_thread(function: Callable, task: Any, base_url: str, key: str) -> asyncio.Future:
    """The agent on a daemon thread with its own loop; a hung one is abandoned at the time
    limit (its session is ended, so it can do no harm)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result=None, error=None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def main() -> None:
        try:
            out = function(task=task, base_url=base_url, api_key=key)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            loop.call_soon_threadsafe(settle, out, None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting episode
            with contextlib.suppress(RuntimeError):  # the run's loop may be gone
                loop.call_soon_threadsafe(settle, None, e)

    threading.Thread(target=main, name="reroll-agent", daemon=True).start()
    return future


async def _awaited(awaitable):
    return await awaitable


async def _subprocess(spec: AgentSpec, task: Any, base_url: str, key: str) -> AgentOutcome:
    payload = json.dumps(task)
    env = os.environ | spec.env | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key,
                                   "REROLL_TASK": payload}
    process = await asyncio.create_subprocess_exec(
        *spec.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(process.communicate(payload.encode()),
                                          spec.time_limit_s)
    except BaseException:  # past its time limit, or its episode cancelled (the run stopping)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the harness and whatever it started
        with contextlib.suppress(BaseException):  # a second cancellation: the kill stands
            await process.wait()
        raise
    if process.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        return AgentOutcome("crashed", error=f"{spec.command[0]} exited with status "
                                             f"{process.returncode}: {' | '.join(tail)}")
    lines = out.decode(errors="replace").strip().splitlines()
    return AgentOutcome("ok", _number(lines[-1]) if lines else None)


def _number(line: str) -> float | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def episode_reward(spec: AgentSpec, outcome: AgentOutcome, session: Session) -> float | None:
    """The first of: the POSTed reward, the agent's return value, the verifier's score."""
    if session.reward is not None:
        return session.reward
    value = outcome.value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if spec.verifier is not None and session.calls:
        last = session.calls[-1]
        final = (last.messages or []) + ([last.reply] if last.reply else [])
        return float(spec.verifier(session.task, final))
    return None


async def run_episode(gateway: Gateway, spec: AgentSpec, task: Any, seed: int, group_id: int,
                      stats: GatewayEpisodeStats, one_sample: bool = True,
                      session: Session | None = None) -> list[Trajectory]:
    """One agent episode through its own session; its samples (see `assembly.py`).
    `one_sample`: an episode whose history was rewritten trains its last chain only (the RL
    pipeline's group advantages need one sample per episode), the others counted. `session`:
    one the caller opened (`gateway.open(task, seed)`) with its own engine or sampling."""
    session = session or gateway.open(task, seed)
    try:
        outcome = await run_agent(spec, task, gateway.base_url(session),
                                  gateway.api_key(session))
    finally:
        gateway.end(session)
    reward = None
    if outcome.status == "ok" and not session.calls:
        outcome = AgentOutcome("no_calls", error="the agent never called the endpoint")
    if outcome.status == "ok":
        try:
            reward = episode_reward(spec, outcome, session)
        except Exception as e:  # noqa: BLE001 - a failing verifier fails its episode only
            outcome = AgentOutcome("crashed", error=f"verifier: {type(e).__name__}: {e}")
        if outcome.status == "ok" and reward is None:
            outcome = AgentOutcome("no_reward", error="no reward: none posted, returned or "
                                                      "verified")
    stats.episodes += 1
    stats.calls += len(session.calls)
    stats.tool_parse_errors += session.tool_parse_errors
    stats.refused += sum(session.errors.values())
    info = {"success": bool(reward is not None and reward > 0), "agent_status": outcome.status,
            "calls": len(session.calls)}
    if outcome.status != "ok":
        stats.failures[outcome.status] += 1
        stats.errors.append(f"{outcome.status}: {outcome.error}")
        info["agent_error"] = outcome.error
    train = outcome.status == "ok"
    found = chains(session.calls)
    stats.chains += len(found)
    if not found:  # nothing to train: one empty, masked sample keeps the group's size
        prompt = gateway.renderer.encode(json.dumps(task)[:200]) or [0]
        return [Trajectory(prompt, [], [], "stop", group_id, prompt_text=json.dumps(task),
                           reward_info=info | {"lineage": {"episode": session.id, "calls": [],
                                                           "parent": None}})]
    samples = [trajectory(c, session, group_id, reward or 0.0, info, gateway.tokenizer, train)
               for c in found]
    for sample, chain in zip(samples, found, strict=True):
        stats.faithful_calls += faithful(sample, chain.calls)
    if one_sample and len(samples) > 1:
        stats.chains_dropped += len(samples) - 1
        samples = samples[-1:]
    return samples


def run_episodes(gateway: Gateway, spec: AgentSpec, tasks: list[Any], group_size: int,
                 seed: int, one_sample: bool = True) -> tuple[list[Trajectory],
                                                                GatewayEpisodeStats]:
    """`group_size` episodes of each task, all at once; groups are contiguous."""
    stats = GatewayEpisodeStats()

    async def run() -> list[list[Trajectory]]:
        return await asyncio.gather(*(
            run_episode(gateway, spec, task, seed + g * 1_000 + k, g, stats, one_sample)
            for g, task in enumerate(tasks) for k in range(group_size)))

    episodes = asyncio.run(run())
    samples = [t for episode in episodes for t in episode]
    neutral_failures(samples)
    return samples, stats


def neutral_failures(samples: list[Trajectory]) -> None:
    """A failed episode (masked: it trains nothing) takes the mean reward of its group's good
    episodes, so it moves neither their baseline nor, as a 0 would, their advantages: an
    infrastructure failure is not a reward the policy earned."""
    groups: dict[int, list[Trajectory]] = {}
    for t in samples:
        groups.setdefault(t.group_id, []).append(t)
    for group in groups.values():
        good = [t.reward for t in group if t.reward_info.get("agent_status") == "ok"]
        fill = sum(good) / len(good) if good else 0.0
        for t in group:
            if t.reward_info.get("agent_status") != "ok":
                t.reward = fill
                t.turn_rewards = [0.0] * (len(t.turn_rewards or [0]) - 1) + [fill]

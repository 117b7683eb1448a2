"""Environments in Ray actors (`distributed.env`): the episodes' `reset`/`step` run on the nodes
the placement names (CPU-only nodes labelled `env`, say: RollArt's per-environment placement)
instead of in worker threads of the driver process.

`start_env_hosts(factory, options)` starts one `EnvHost` actor per entry of `options`; each
builds environments with `factory()` (one per episode, kept until the episode's env object is
dropped) and steps them in its own threads, so concurrent episodes overlap there as they do in
the driver. `RemoteEnvs.make()` is the agent loop's `make_env`: a `RemoteEnv` on the host with
the fewest live environments, whose `areset`/`astep` the loop awaits under its usual step time
limit (a failed or slow step fails its episode, counted in `env/errors`, never the run).

A host whose process dies (an env that crashed it, a lost node) is restarted by Ray, without
limit; the calls in flight when it died, and later steps of the episodes whose environments it
held, fail (Ray does not retry them: `max_task_retries` 0), so those episodes end as
infrastructure failures (`env_error`, out of the loss and of their groups' statistics), and new
episodes go to the fresh host. An env that keeps killing its host is stopped by the failure
bound (`env.max_failure_rate_step`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

ENV_THREADS = 64
"""Concurrent `reset`/`step` calls one host runs (each in a thread of its own)."""


class EnvHost:
    """The actor body: the environments of the episodes sent to it, by key."""

    def __init__(self, factory: Callable[[], Any], num_threads: int):
        torch.set_num_threads(num_threads)
        self.factory, self.envs = factory, {}
        self.factory()  # a factory that cannot build here fails at start, not mid-run
        self.lock = threading.Lock()

    def reset(self, key: int, seed: int | None) -> Any:
        env = self.factory()
        with self.lock:
            self.envs[key] = env
        return _run(env.areset(seed)) if hasattr(env, "areset") else env.reset(seed)

    def step(self, key: int, action: str) -> Any:
        env = self.envs.get(key)
        if env is None:  # made by an earlier process of this host, which died
            raise LostEnv("the env host was restarted after its process died; this episode's "
                          "environment was lost with it")
        return _run(env.astep(action)) if hasattr(env, "astep") else env.step(action)

    def drop(self, key: int) -> None:
        with self.lock:
            env = self.envs.pop(key, None)
        close = getattr(env, "close", None)
        if close is not None:
            close()

    def info(self) -> dict[str, Any]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return {"node_id": ray.get_runtime_context().get_node_id(), "live": len(self.envs)}


class LostEnv(RuntimeError):
    """A step of an episode whose environment died with its host's previous process."""


def _run(coroutine):
    """An async env's call, run to the end in this host thread."""
    return asyncio.run(coroutine)


class RemoteEnv:
    """One episode's environment on a host; the Env protocol's async variant."""

    def __init__(self, pool: RemoteEnvs, host: int, key: int):
        self.pool, self.host, self.key = pool, host, key

    async def areset(self, seed: int | None = None):
        return await self.pool.actors[self.host].reset.remote(self.key, seed)

    async def astep(self, action: str):
        return await self.pool.actors[self.host].step.remote(self.key, action)

    def __del__(self):
        self.pool.release(self.host, self.key)


class RemoteEnvs:
    """The env hosts of a run; `make()` gives each new episode an environment on the host that
    has the fewest live ones."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.live = [0] * len(actors)
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def make(self) -> RemoteEnv:
        with self._lock:
            host = min(range(len(self.actors)), key=self.live.__getitem__)
            self.live[host] += 1
            return RemoteEnv(self, host, next(self._keys))

    def release(self, host: int, key: int) -> None:
        with self._lock:
            self.live[host] -= 1
        if self.actors:  # not after close()
            self.actors[host].drop.remote(key)

    def node_ids(self) -> list[str]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return [info["node_id"] for info in ray.get([a.info.remote() for a in self.actors])]

    def close(self) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)


@functools.cache
def _remote_host():
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    return ray.remote(EnvHost)


def start_env_hosts(factory: Callable[[], Any], options: list[dict[str, Any]], *,
                    num_threads: int = 1, name_prefix: str | None = None) -> RemoteEnvs:
    """One host per entry of `options` (Ray actor options: CPUs, resources, label selector),
    each checking that `factory()` builds there; blocks until every host is up. A host that
    dies is restarted (module docstring)."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    actors = []
    for rank, host_options in enumerate(options):
        # Restarted when it dies; what was in flight then fails its episode, not retried.
        opts = {"max_concurrency": ENV_THREADS, "max_restarts": -1,
                "max_task_retries": 0} | host_options
        if name_prefix:
            opts["name"] = f"{name_prefix}-env-{rank}"
        actors.append(_remote_host().options(**opts).remote(factory, num_threads))
    ray.get([a.info.remote() for a in actors])
    return RemoteEnvs(actors)

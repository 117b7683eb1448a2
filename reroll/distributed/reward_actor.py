"""The reward role in Ray actors: the reward function runs on the nodes its placement names
(CPU-only nodes, say, RollArt's disaggregation) instead of in the driver process.

`start_reward_actors(factory, options)` builds `factory()` inside each actor (a math verifier
starts its process pool there, on that node); the returned `RemoteRewardFn` is a `RewardFn`
like any other, so the driver's `RewardRunner` still bounds every call with its time limit and
counts failures. Calls are spread round-robin over the actors. Rewards are pure functions of
the sample, so an actor whose node is lost is restarted by Ray on a live node that offers the
role's resources and its in-flight calls are retried there (`max_restarts`, `max_task_retries`);
`reward/actor_restarts` counts those restarts. If no live node can host it, the runner's limit
turns the calls into counted time-outs, never a hung run.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from reroll import settings
from reroll.rewards.base import RewardFn, RewardResult, RewardSample

ACTOR_RESTARTS = -1
"""Ray restarts a lost reward actor as often as it takes (each restart is on a live node)."""


def limit_threads(num_threads: int) -> None:
    """Cap the host's intra-op threads without loading torch: most rewards (verifiers, judges
    over HTTP, sandboxes) never use it, and its import (seconds on a busy node) would delay every
    replica an autoscaler starts for a burst. OMP_NUM_THREADS covers a torch loaded later."""
    settings.export({"OMP_NUM_THREADS": str(num_threads)})
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(num_threads)


class RewardHost:
    """The actor body: owns one reward function. Async, so concurrent calls reach a reward that
    batches or pools them together."""

    def __init__(self, factory: Callable[[], RewardFn], num_threads: int):
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        limit_threads(num_threads)
        self.fn = factory()
        limit_threads(num_threads)  # the factory may have loaded torch with its own default
        with warnings.catch_warnings():  # Ray's own property trips its deprecation of actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    async def reward(self, sample: RewardSample) -> RewardResult:
        return await self.fn(sample)

    async def info(self) -> dict[str, Any]:
        """The reward's name, this actor's node and whether Ray restarted it after a loss."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return {"name": getattr(self.fn, "name", type(self.fn).__name__),
                "node_id": ray.get_runtime_context().get_node_id(),
                "restarted": self.restarted}

    async def queue_metrics(self) -> dict[str, float]:
        queue = getattr(self.fn, "queue_metrics", None)
        return queue() if queue is not None else {}

    async def close(self) -> None:
        close = getattr(self.fn, "close", None)
        if close is not None:
            close()


class RemoteRewardFn:
    """Client side of the reward actors; implements `reroll.rewards.base.RewardFn`. It does not
    claim `times_itself`: the runner's limit also covers the trip to the actor and a retry on a
    restarted one."""

    def __init__(self, actors: list[Any], name: str):
        self.actors, self.name = actors, name
        self._next = 0

    async def __call__(self, sample: RewardSample) -> RewardResult:
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        return await actor.reward.remote(sample)

    def node_ids(self) -> list[str]:
        return [info["node_id"] for info in self._infos()]

    def _infos(self) -> list[dict[str, Any]]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get([a.info.remote() for a in self.actors])

    def queue_metrics(self) -> dict[str, float]:
        """The actors' queueing (summed over actors: every key is a count or a total per step
        for one actor) and how many of them Ray restarted after losing their node."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        metrics: dict[str, float] = {}
        for part in ray.get([a.queue_metrics.remote() for a in self.actors]):
            for key, value in part.items():
                metrics[key] = metrics.get(key, 0.0) + value
        if len(self.actors) > 1:  # means, not sums, for the per-call figures
            metrics = {k: v / len(self.actors) if k.endswith("_mean") else v
                       for k, v in metrics.items()}
        restarted = sum(bool(info["restarted"]) for info in self._infos())
        return metrics | {"reward/actor_restarts": float(restarted)}

    def close(self) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # an actor already gone has nothing left to close
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


@functools.cache
def _remote_host():
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    return ray.remote(RewardHost)


def start_reward_actors(factory: Callable[[], RewardFn], options: list[dict[str, Any]], *,
                        num_threads: int = 1, name_prefix: str | None = None) -> RemoteRewardFn:
    """One actor per entry of `options` (Ray actor options: CPUs, resources), each building
    `factory()`; blocks until every reward is built (a failure to build raises here)."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    actors = []
    for rank, worker_options in enumerate(options):
        opts = {"max_concurrency": 1000, "max_restarts": ACTOR_RESTARTS,
                "max_task_retries": -1} | worker_options
        if name_prefix:
            opts["name"] = f"{name_prefix}-reward-{rank}"
        actors.append(_remote_host().options(**opts).remote(factory, num_threads))
    infos = ray.get([a.info.remote() for a in actors])
    return RemoteRewardFn(actors, infos[0]["name"])

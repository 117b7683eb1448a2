"""A Cluster: N workers of one role behind one call API, in this process or in Ray actors.

    cluster = Cluster(WorkerSpec(PolicyWorker, kwargs), num_workers=2, executor=RayExecutor(...))
    logprobs = cluster.call("forward_logprobs", batch, dispatch=Dispatch.SPLIT)

Dispatch modes: ALL runs the method on every worker and returns their results in rank order;
SPLIT cuts the first argument (a TensorDict batch) into contiguous equal shards by data-parallel
rank, runs each shard on its worker, and gathers the results (tensors and TensorDicts are
concatenated back in batch order, anything else is returned per rank); RANK0 runs on rank 0
only. Pipeline code is the same whichever executor hosts the workers.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from reroll import settings
from reroll.distributed.ray_runtime import quiet_transformers


class Dispatch(enum.Enum):
    ALL = "all"
    SPLIT = "split"
    RANK0 = "rank0"


class WorkerDied(RuntimeError):
    """A worker process of a role is gone (killed, out of memory); the run can restart the roles."""


def is_worker_death(error: BaseException) -> bool:
    """Whether `error` says a worker process is gone (what a restart of the roles can mend)."""
    if isinstance(error, WorkerDied):
        return True
    ray = sys.modules.get("ray")  # only a run that started Ray can lose a Ray actor
    return ray is not None and isinstance(error, ray.exceptions.RayActorError)


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one worker: `cls(rank=r, world_size=n, **kwargs)` (picklable)."""

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    role: str = "worker"


class Executor(Protocol):
    def start(self, spec: WorkerSpec, num_workers: int) -> None: ...

    def run(self, calls: list[tuple[int, str, tuple, dict]]) -> list[Any]: ...

    def shutdown(self) -> None: ...


class Cluster:
    def __init__(self, spec: WorkerSpec, num_workers: int, executor: Executor):
        self.spec, self.num_workers, self.executor = spec, num_workers, executor
        executor.start(spec, num_workers)

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        if dispatch is Dispatch.RANK0:
            return self.executor.run([(0, method, args, kwargs)])[0]
        if dispatch is Dispatch.ALL:
            return self.executor.run([(r, method, args, kwargs) for r in range(self.num_workers)])
        shards = split_batch(args[0], self.num_workers)
        results = self.executor.run([(r, method, (shard, *args[1:]), kwargs)
                                     for r, shard in enumerate(shards)])
        return gather(results)

    def shutdown(self) -> None:
        self.executor.shutdown()


def split_batch(batch: TensorDict, parts: int) -> list[TensorDict]:
    size = batch.batch_size[0]
    if size % parts:
        raise ValueError(f"a batch of {size} does not split evenly over {parts} workers")
    step = size // parts
    return [batch[i * step:(i + 1) * step] for i in range(parts)]


def gather(results: list[Any]) -> Any:
    first = results[0]
    if isinstance(first, torch.Tensor | TensorDict):
        return torch.cat(results, dim=0)
    return results


# ----------------------------------------------------------------------------------------------
# Executors


class LocalExecutor:
    """Workers are plain objects in this process; calls run one after another."""

    def __init__(self) -> None:
        self.workers: list[Any] = []

    def start(self, spec: WorkerSpec, num_workers: int) -> None:
        self.workers = [spec.cls(rank=r, world_size=num_workers, **spec.kwargs)
                        for r in range(num_workers)]

    def run(self, calls: list[tuple[int, str, tuple, dict]]) -> list[Any]:
        return [getattr(self.workers[r], m)(*a, **k) for r, m, a, k in calls]

    def shutdown(self) -> None:
        for worker in self.workers:
            close = getattr(worker, "close", None)
            if close:
                close()
        self.workers = []


class WorkerHost:
    """The Ray actor body: sets up threads and torch.distributed, then hosts one worker."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(num_threads)
        quiet_transformers()
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def build(self, spec: WorkerSpec, rank: int, world_size: int, master: tuple[str, int]) -> int:
        settings.export({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
                           "RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": "0"})
        self.worker = spec.cls(rank=rank, world_size=world_size, **spec.kwargs)
        return os.getpid()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def node_id(self) -> str:
        """The Ray node this worker runs on (colocated roles are pinned to it)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get_runtime_context().get_node_id()


class RayExecutor:
    """Each worker is a Ray actor, placed by `ray_options[rank]` (CPUs, GPUs, placement group)."""

    def __init__(self, ray_options: list[dict[str, Any]], num_threads: int = 1,
                 name_prefix: str | None = None):
        self.ray_options, self.num_threads, self.name_prefix = ray_options, num_threads, name_prefix
        self.actors: list[Any] = []
        self.pids: list[int] = []

    def start(self, spec: WorkerSpec, num_workers: int) -> None:
        host = _remote_worker_host()
        for r in range(num_workers):
            options = dict(self.ray_options[r])
            if self.name_prefix:
                options["name"] = f"{self.name_prefix}-{spec.role}-{r}"
            self.actors.append(host.options(**options).remote(self.num_threads))
        master = self._get([self.actors[0].address.remote()])[0]
        self.pids = self._get([a.build.remote(spec, r, num_workers, master)
                               for r, a in enumerate(self.actors)])

    def run(self, calls: list[tuple[int, str, tuple, dict]]) -> list[Any]:
        return self._get([self.actors[r].call.remote(m, a, k) for r, m, a, k in calls])

    def node_ids(self) -> list[str]:
        """The Ray node of each worker, in rank order."""
        return self._get([a.node_id.remote() for a in self.actors])

    def run_refs(self, rank: int, method: str, num_returns: int, *args: Any) -> Any:
        """Start `method` on one worker and return its result's object refs without fetching
        them (another actor takes them straight from the object store)."""
        return self.actors[rank].call.options(num_returns=num_returns).remote(method, args, {})

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise WorkerDied(f"a worker process died: {e}") from e

    def shutdown(self) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


@functools.cache
def _remote_worker_host() -> Callable[..., Any]:
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    return ray.remote(WorkerHost)  # once per process: Ray registers a class per `ray.remote` call

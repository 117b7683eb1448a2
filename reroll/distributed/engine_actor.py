"""An Engine that lives in a Ray actor process, behind the same `Engine` protocol.

`start_engine_actor(factory)` builds the engine inside a new (async) Ray actor; the returned
`ActorEngine` is used exactly like an in-process engine. Requests made in the same event-loop
tick travel together in one call and are streamed back one completion at a time as the engine
finishes them, so the engine inside the actor batches them as it would in-process. Weights
travel as one flat buffer through the object store (`packing.py`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from reroll.distributed.collective import join_group, receive_buckets
from reroll.distributed.packing import buffer_size, pack, unpack
from reroll.distributed.ray_runtime import ensure_ray, quiet_transformers
from reroll.engines.base import Completion, Engine, Request


class EngineHost:
    """The actor body: owns the engine and counts its work. Async methods run on the actor's
    event loop, so concurrent `generate_stream` calls reach the engine together and aborts are
    handled while a batch decodes."""

    def __init__(self, engine_factory: Callable[[], Engine], num_threads: int):
        torch.set_num_threads(num_threads)
        quiet_transformers()
        self.engine = engine_factory()
        self.requests = 0
        self.generated_tokens = 0
        self.busy_s = 0.0
        self._active = 0
        self._busy_since = 0.0
        self.asleep = False
        self.sync_group: Any = None

    async def generate_stream(self, requests: list[Request]):
        """Yields each request's Completion as soon as the engine finishes it."""
        if self.asleep:
            raise RuntimeError("generate on a sleeping engine: a colocated pipeline must take "
                               "the rollout turn (wake) first")
        self._enter(len(requests))
        try:
            for next_done in asyncio.as_completed([self.engine.generate(r) for r in requests]):
                completion = await next_done
                self.generated_tokens += len(completion.token_ids)
                yield completion
        finally:
            self._leave(len(requests))

    def _enter(self, n: int) -> None:
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += n
        self.requests += n

    def _leave(self, n: int) -> None:
        self._active -= n
        if self._active == 0:
            self.busy_s += time.perf_counter() - self._busy_since

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def load_weights(self, slots, flat, version: int) -> str:
        """Load, and return the fingerprint of the weights taken right after (the caller checks
        it without another round trip, which would wait for a decoding step to end)."""
        named = unpack(slots, flat).items()

        def load() -> str:
            self.engine.load_weights(named, version)
            return self.engine.weights_fingerprint()

        if self.supports_in_flight_updates():
            # On the loop, which also runs the decoding steps: the load falls between two steps
            # and running requests go on under the new weights.
            return load()
        # Off the loop, so streaming completions and aborts are not blocked meanwhile.
        return await asyncio.to_thread(load)

    def supports_in_flight_updates(self) -> bool:
        return getattr(self.engine, "in_flight_updates", False)

    async def weights_fingerprint(self) -> str:
        return await asyncio.to_thread(self.engine.weights_fingerprint)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)
        self.asleep = True

    async def wake(self) -> None:
        await asyncio.to_thread(self.engine.wake)
        self.asleep = False

    async def join_weight_group(self, address: tuple[str, int], rank: int, world_size: int,
                                backend: str) -> None:
        self.sync_group = await asyncio.to_thread(join_group, address, rank, world_size, backend)

    async def receive_weights(self, slots, version: int, bucket_bytes: int, backend: str) -> None:
        """The engine's side of `BroadcastSync`: receive the flat buffer, then load it."""
        def receive_and_load() -> None:
            flat = receive_buckets(self.sync_group, buffer_size(slots), bucket_bytes, backend)
            self.engine.load_weights(unpack(slots, flat).items(), version)

        await asyncio.to_thread(receive_and_load)

    async def call(self, method: str, *args: Any) -> Any:
        """Any other engine method, run off the event loop."""
        return await asyncio.to_thread(getattr(self.engine, method), *args)

    async def node_id(self) -> str:
        """The Ray node this engine runs on."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get_runtime_context().get_node_id()

    async def stats(self) -> dict[str, float]:
        busy = self.busy_s + (time.perf_counter() - self._busy_since if self._active else 0.0)
        return {"requests": self.requests, "generated_tokens": self.generated_tokens,
                "busy_s": busy}


class ActorEngine:
    """Client side of an engine actor; implements `reroll.engines.base.Engine`."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._loaded_fingerprint: str | None = None

    async def generate(self, request: Request) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if len(self._pending) == 1:
            asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        await asyncio.sleep(0)  # every request made in this tick travels in the same call
        batch, self._pending = self._pending, []
        waiting = {request.request_id: future for request, future in batch}
        try:
            async for ref in self.actor.generate_stream.remote([r for r, _ in batch]):
                completion = await ref
                waiting.pop(completion.request_id).set_result(completion)
        except Exception as e:  # noqa: BLE001 - the actor died or the engine failed: tell every caller
            for future in waiting.values():
                if not future.done():
                    future.set_exception(e)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)

    @functools.cached_property
    def in_flight_updates(self) -> bool:
        """Whether the engine in the actor loads weights between decoding steps (see HFEngine)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get(self.actor.supports_in_flight_updates.remote())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Blocks until the engine has the new weights."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        slots, flat = pack(named_tensors)
        self._loaded_fingerprint = ray.get(self.actor.load_weights.remote(slots, flat.numpy(),
                                                                          version))

    def weights_fingerprint(self) -> str:
        """The fingerprint the actor took right after this client's last load, once (one round
        trip less while the engine decodes); otherwise asked for."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        fingerprint, self._loaded_fingerprint = self._loaded_fingerprint, None
        return fingerprint or ray.get(self.actor.weights_fingerprint.remote())

    def stats(self) -> dict[str, float]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get(self.actor.stats.remote())

    def sleep(self) -> None:
        """Free the engine's memory while a colocated trainer runs (generating meanwhile fails)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        ray.get(self.actor.sleep.remote())

    def wake(self) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        ray.get(self.actor.wake.remote())

    def shutdown(self) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        ray.kill(self.actor, no_restart=True)


@functools.cache
def _remote_host():
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    return ray.remote(EngineHost)


def start_engine_actor(engine_factory: Callable[[], Engine], *, num_cpus: float = 1,
                       num_threads: int = 1, name: str | None = None,
                       ray_options: dict[str, Any] | None = None) -> ActorEngine:
    """Build `engine_factory()` inside a new Ray actor reserving `num_cpus` CPUs; blocks until the
    engine is loaded (a failure to build it raises here, not at the first request).
    `ray_options` (GPUs, placement group, ...) override the defaults, as `placement.py` gives them."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    ensure_ray()
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1000} | (ray_options or {})
    if name is not None:
        options["name"] = name
    actor = _remote_host().options(**options).remote(engine_factory, num_threads)
    ray.get(actor.stats.remote())
    return ActorEngine(actor)

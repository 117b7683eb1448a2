"""An Engine that lives in a Ray actor process, behind the same `Engine` protocol.

`start_engine_actor(factory)` builds the engine inside a new (async) Ray actor; the returned
`ActorEngine` is used exactly like an in-process engine. Requests made in the same event-loop
tick travel together in one call and are streamed back one completion at a time as the engine
finishes them, so the engine inside the actor batches them as it would in-process. Weights
travel as one flat buffer through the object store (`packing.py`): whole, or (with a
`DeltaPolicy`) only what changed since the version the actor holds (`reroll.engines.delta`:
the client keeps a copy of the actor's weights, the actor checks the delta's base and refuses
one it does not hold; a refused delta is counted and followed by full weights). A LoRA run's
adapter travels alone (`load_adapter`) to an engine that takes adapters. After every load the
actor answers the version it holds with its fingerprint, and the client's fingerprint names a
version other than the one it sent, so the sync check refuses it.
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
from reroll.engines.base import AdapterSyncError, Completion, Engine, Request, fingerprint
from reroll.engines.delta import (
    BehindError,
    DeltaPolicy,
    DeltaRefused,
    DeltaSender,
    body_bytes,
    held_dtype,
    in_dtype,
    patch_engine,
)


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

    async def load_weights(self, slots, flat, version: int) -> tuple[int | None, str]:
        """Load, and return the version and fingerprint of the weights held right after (the
        caller checks them without another round trip, which would wait for a decoding step)."""
        named = unpack(slots, flat).items()
        return await self._load(lambda: self.engine.load_weights(named, version))

    async def load_delta(self, slots, flat, base: int, version: int) -> dict[str, Any]:
        """A delta against weights version `base` (`patch_engine`): `{"held": (version,
        fingerprint)}` once applied, or `{"refused": why}` (another version held, no weights
        exposed, or a body that does not fit), with no weight changed."""
        try:
            state, _ = patch_engine(self.engine, unpack(slots, flat), base)
        except (BehindError, ValueError) as e:
            return {"refused": str(e)}
        return {"held": await self._load(lambda: self.engine.load_weights(state.items(),
                                                                           version))}

    async def load_adapter(self, adapter: dict[str, torch.Tensor],
                           version: int) -> dict[str, Any]:
        """A LoRA adapter (`engine.load_adapter`): `{"held": (version, fingerprint)}`, or
        `{"refused": why}` when the engine did not take it (it kept its weights)."""
        try:
            return {"held": await self._load(lambda: self.engine.load_adapter(adapter.items(),
                                                                               version))}
        except AdapterSyncError as e:  # a string back: Ray's wrapping of the class is opaque
            return {"refused": str(e)}

    async def _load(self, load: Callable[[], None]) -> tuple[int | None, str]:
        def load_and_check() -> tuple[int | None, str]:
            load()
            return self._held()

        if self.supports_in_flight_updates():
            # On the loop, which also runs the decoding steps: the load falls between two steps
            # and running requests go on under the new weights.
            return load_and_check()
        # Off the loop, so streaming completions and aborts are not blocked meanwhile.
        return await asyncio.to_thread(load_and_check)

    def _held(self) -> tuple[int | None, str]:
        return getattr(self.engine, "version", None), self.engine.weights_fingerprint()

    async def takes_adapters(self) -> bool:
        return bool(getattr(self.engine, "takes_adapters", False))

    async def held_dtype(self) -> str | None:
        """The dtype the engine holds its weights in, for deltas of those bits (None: the
        engine does not expose its weights, and refuses deltas)."""
        dtype = held_dtype(self.engine)
        return None if dtype is None else str(dtype).removeprefix("torch.")

    def supports_in_flight_updates(self) -> bool:
        return getattr(self.engine, "in_flight_updates", False)

    async def weights_fingerprint(self) -> tuple[int | None, str]:
        """The version the engine holds, and its fingerprint."""
        return await asyncio.to_thread(self._held)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)
        self.asleep = True

    async def wake(self) -> None:
        await asyncio.to_thread(self.engine.wake)
        self.asleep = False

    async def join_weight_group(self, address: tuple[str, int], rank: int, world_size: int,
                                backend: str) -> None:
        self.sync_group = await asyncio.to_thread(join_group, address, rank, world_size, backend)

    async def receive_weights(self, slots, version: int, bucket_bytes: int,
                              backend: str) -> tuple[int | None, str]:
        """The engine's side of `BroadcastSync`: receive the flat buffer, then load it."""
        def receive_and_load() -> tuple[int | None, str]:
            flat = receive_buckets(self.sync_group, buffer_size(slots), bucket_bytes, backend)
            self.engine.load_weights(unpack(slots, flat).items(), version)
            return self._held()

        return await asyncio.to_thread(receive_and_load)

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
    """Client side of an engine actor; implements `reroll.engines.base.Engine`. `delta`: send
    each new version as a delta against the one the actor holds, where it is smaller."""

    def __init__(self, actor: Any, delta: DeltaPolicy | None = None):
        self.actor = actor
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._loaded_fingerprint: str | None = None
        self.version: int | None = None
        """The version this client last sent (None: none yet); the actor must hold it."""
        self.sender = DeltaSender(delta) if delta is not None and delta.enabled else None
        self._sent_fingerprint: str | None = None  # of what the actor should hold after a load
        self._policy_fingerprint: str | None = None  # of the weights as given, before the cast
        self.sync_bytes = 0
        """Bytes the last load sent (a delta's, the full weights', or the adapter's)."""

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

    @functools.cached_property
    def takes_adapters(self) -> bool:
        """Whether the engine in the actor takes a LoRA adapter alone (`load_adapter`)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get(self.actor.takes_adapters.remote())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Blocks until the engine has the new weights: whole, or with a delta policy, in the
        actor's dtype and as a delta where one is smaller and taken (`DeltaSender`)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        if self.sender is None:
            slots, flat = pack(named_tensors)
            self.sync_bytes = flat.numel()
            self.loaded(version, ray.get(self.actor.load_weights.remote(slots, flat.numpy(),
                                                                        version)))
            return
        # copies: the sender keeps them as the actor's version, and a caller's tensors may be
        # the live parameters that the next optimizer step changes in place
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        self._policy_fingerprint = fingerprint(tensors.items())
        held = self._held_dtype
        wire = in_dtype(tensors, None if held is None else getattr(torch, held))
        self.sender.send(wire, version, self._send_delta,
                         lambda full: self.load_full(full, version), "engine actor")
        self.sync_bytes = self.sender.counters.sync_bytes
        self._sent_fingerprint = self.sender.held_fingerprint
        self.loaded(version, self._last_held)

    def load_full(self, wire: dict[str, torch.Tensor], version: int) -> None:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        slots, flat = pack(wire.items())
        self._last_held = ray.get(self.actor.load_weights.remote(slots, flat.numpy(), version))

    def _send_delta(self, body: dict[str, torch.Tensor], base: int, version: int) -> str:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        slots, flat = pack(body.items())
        reply = ray.get(self.actor.load_delta.remote(slots, flat.numpy(), base, version))
        if "refused" in reply:
            raise DeltaRefused(reply["refused"])
        self._last_held = reply["held"]
        return reply["held"][1]

    @functools.cached_property
    def _held_dtype(self) -> str | None:
        """Asked once: an engine holds its weights in one dtype for its life."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        return ray.get(self.actor.held_dtype.remote())

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A LoRA adapter alone, merged by the engine into its copy of the base weights; one the
        engine refuses is an AdapterSyncError (it kept its weights: the sync sends merged ones)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        tensors = {name: t.detach().cpu().contiguous() for name, t in adapter}
        reply = ray.get(self.actor.load_adapter.remote(tensors, version))
        if "refused" in reply:
            raise AdapterSyncError(reply["refused"])
        self.sync_bytes = body_bytes(tensors)
        self._sent_fingerprint = self._policy_fingerprint = None
        self.loaded(version, reply["held"])

    def loaded(self, version: int, held: tuple[int | None, str]) -> None:
        """Record a load of `version` whose reply was `held` (the actor's version, fingerprint):
        also for the syncs that send the buffer to the actor themselves (`weight_sync.py`)."""
        self.version = version
        self._loaded_fingerprint = self._checked(held)

    def _checked(self, held: tuple[int | None, str]) -> str:
        """The fingerprint to compare with the sender's, or a value naming what is wrong: the
        actor holds another version than this client sent last, or (after a delta-policy load,
        in its own dtype) other bits than were sent; then the policy's fingerprint stands for
        the bits sent."""
        holds, theirs = held
        if self.version is not None and holds is not None and holds != self.version:
            return f"engine actor holds weights version {holds}, not {self.version}"
        if self._sent_fingerprint is None:
            return theirs
        return self._policy_fingerprint if theirs == self._sent_fingerprint else \
            f"engine actor {theirs} != sent {self._sent_fingerprint}"

    def weights_fingerprint(self) -> str:
        """The fingerprint the actor took right after this client's last load, once (one round
        trip less while the engine decodes); otherwise asked for. Either way checked against
        the version this client sent last (`_checked`)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        fingerprint, self._loaded_fingerprint = self._loaded_fingerprint, None
        return fingerprint or self._checked(ray.get(self.actor.weights_fingerprint.remote()))

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's bytes and, with a delta policy, the delta counters so far."""
        metrics = {"weight_sync/bytes": float(self.sync_bytes)}
        if self.sender is not None:
            c = self.sender.counters
            metrics |= {"weight_sync/full_bytes": float(c.full_bytes),
                        "weight_sync/delta_syncs": float(c.delta_syncs),
                        "weight_sync/delta_fallbacks": float(c.delta_fallbacks)}
        return metrics

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
                       ray_options: dict[str, Any] | None = None,
                       delta: DeltaPolicy | None = None) -> ActorEngine:
    """Build `engine_factory()` inside a new Ray actor reserving `num_cpus` CPUs; blocks until the
    engine is loaded (a failure to build it raises here, not at the first request).
    `ray_options` (GPUs, placement group, ...) override the defaults, as `placement.py` gives them;
    `delta`: new weights go as deltas where smaller (`ActorEngine`)."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    ensure_ray()
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1000} | (ray_options or {})
    if name is not None:
        options["name"] = name
    actor = _remote_host().options(**options).remote(engine_factory, num_threads)
    ray.get(actor.stats.remote())
    return ActorEngine(actor, delta)

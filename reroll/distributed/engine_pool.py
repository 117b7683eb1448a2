"""Several engine actors behind one `Engine` (`distributed.rollout.num_workers` > 1 with
`executor: ray`): engines on several nodes or GPUs serve one run's rollouts.

Each request goes to the engine with the fewest requests in flight; an abort goes where its
request went. Every request carries its own seed (`Request.seed`), so which engine samples it
does not change the sample. Weights reach every engine (`weight_sync.py` sends the one packed
buffer to all of them and checks each engine's fingerprint; an adapter or each engine's delta
goes to each); `weights_fingerprint` here is the engines' common one and a disagreement between
them is a `WeightSyncError`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from reroll.distributed.engine_actor import ActorEngine
from reroll.engines.base import Completion, Engine, Request, WeightSyncError


class EnginePool:
    """Implements `reroll.engines.base.Engine` over `engines` (engine actors in a run; any
    engines work)."""

    def __init__(self, engines: list[ActorEngine] | list[Engine]):
        self.engines = engines
        self._in_flight = [0] * len(engines)
        self._where: dict[str, int] = {}

    async def generate(self, request: Request) -> Completion:
        rank = min(range(len(self.engines)), key=self._in_flight.__getitem__)
        self._in_flight[rank] += 1
        self._where[request.request_id] = rank
        try:
            return await self.engines[rank].generate(request)
        finally:
            self._in_flight[rank] -= 1
            self._where.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        rank = self._where.get(request_id)
        if rank is not None:
            self.engines[rank].abort(request_id)

    @property
    def in_flight_updates(self) -> bool:
        return all(e.in_flight_updates for e in self.engines)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        for engine in self.engines:
            engine.load_weights(named, version)

    @property
    def takes_adapters(self) -> bool:
        return all(getattr(e, "takes_adapters", False) for e in self.engines)

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Every engine; one that refuses raises AdapterSyncError, and the sync's merged
        weights then reach them all (those that took the adapter included)."""
        named = list(adapter)
        for engine in self.engines:
            engine.load_adapter(named, version)

    def sync_metrics(self) -> dict[str, float]:
        """The engines' sync metrics, summed (bytes sent to all, fallbacks of all)."""
        total: dict[str, float] = {}
        for metrics in (e.sync_metrics() for e in self.engines if hasattr(e, "sync_metrics")):
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def weights_fingerprint(self) -> str:
        fingerprints = [e.weights_fingerprint() for e in self.engines]
        if len(set(fingerprints)) > 1:
            raise WeightSyncError(f"the {len(self.engines)} engines hold different weights "
                                  f"(fingerprints {fingerprints}): some would sample from stale "
                                  f"weights")
        return fingerprints[0]

    def stats(self) -> dict[str, float]:
        """The engines' counts (and rates: the pool's is their sum), summed."""
        total: dict[str, float] = {}
        for stats in (e.stats() for e in self.engines):
            for key, value in (stats if isinstance(stats, dict) else vars(stats)).items():
                total[key] = total.get(key, 0.0) + value
        return total

    def sleep(self) -> None:
        for engine in self.engines:
            engine.sleep()

    def wake(self) -> None:
        for engine in self.engines:
            engine.wake()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()

"""The Engine contract: token ids (and the prompt's model inputs, e.g. images) in, token ids and
behaviour logprobs out.

Engines never re-tokenise: a Request carries the exact prompt token ids, and a Completion the
exact generated ids with the log-probability the engine gave each one (at the sampling
temperature, before top-p/top-k truncation), so the trainer can compute importance ratios
against the policy that really sampled.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
import xxhash

from reroll.config.errors import RunStopped

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k limit."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these (the stop token is kept in the response)."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0
    """Seeds this request's own random stream, so its sample does not depend on which other
    requests share its batch."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The prompt's model inputs beyond its token ids (an image's `pixel_values`,
    `image_grid_thw`...), as the model's processor built them for this prompt; {}: tokens only.
    An engine that cannot take them refuses the request rather than drop them."""
    images: list = field(default_factory=list)
    """The prompt's images (PIL) that `model_inputs` were built from, in order, for an engine
    that runs the model's processor itself (vLLM); [] with tokens only."""


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    """The engine's weights version when the request ended."""
    token_versions: list[int] | None = None
    """The version that sampled each token, when weights changed while the request ran (in-flight
    updates); None: all `policy_version`."""
    first_token_s: float | None = None
    """Seconds from submission to the first sampled token (time to first token), when the engine
    measures it (the HF engine does); a serving endpoint's latency objective reads it."""
    routed_experts: torch.Tensor | None = None
    """[prompt + response tokens, MoE layers, top_k] the experts the engine routed each token to
    (-1: none recorded), when it records them (`HFEngine(record_routing=True)`, for routing
    replay); None otherwise."""

    def versions(self) -> list[int]:
        """The version that sampled each token."""
        return list(self.token_versions or [self.policy_version] * len(self.token_ids))


@runtime_checkable
class Engine(Protocol):
    async def generate(self, request: Request) -> Completion: ...

    def abort(self, request_id: str) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def weights_fingerprint(self) -> str: ...


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of names, dtypes, shapes and exact bytes of the weights (order-independent).

    The policy and every engine compute it over their own copies; after a weight sync they must
    agree, otherwise the engine is sampling from stale or corrupted weights. XXH3-128 hashes at
    memory speed (blake2b took 1.1-1.5 s per SmolLM2-135M sync, twice a step: a third of a GPU
    step); it detects stale or damaged weights, which is all it is for (no adversary here).
    """
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.view(torch.uint8).numpy())  # the buffer itself, not a copy
    return digest.hexdigest()


class WeightSyncError(RunStopped):
    """The engine's weights do not match the policy's after a sync."""


class AdapterSyncError(WeightSyncError):
    """An adapter-only sync that did not take (the engine refused the adapter, holds no base to
    merge it into, or does not hold the version sent): the engine kept the weights it had, and the
    sync falls back to merged weights (counted in `weight_sync/adapter_fallbacks`)."""


def adapter_bytes(adapter: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in adapter.values())


@dataclass
class EngineStats:
    """What an engine reports about its load: requests waiting or decoding, and its speed."""

    queued: int
    """Requests submitted and not yet finished (waiting for a batch slot or decoding)."""
    generated_tokens: int
    """Tokens generated since the engine started."""
    tokens_per_s: float
    """Generated tokens per second of busy time (time with at least one request in flight)."""


class LoadMeter:
    """Counts requests in flight and the busy time they span, for `EngineStats`.

    Busy time, not wall time, so an engine idle between training steps does not look slow.
    """

    def __init__(self) -> None:
        import time

        self._clock = time.perf_counter
        self.in_flight = 0
        self.generated_tokens = 0
        self._busy_s = 0.0
        self._busy_since = 0.0

    def started(self) -> None:
        if self.in_flight == 0:
            self._busy_since = self._clock()
        self.in_flight += 1

    def finished(self, tokens: int) -> None:
        self.generated_tokens += tokens
        self.in_flight -= 1
        if self.in_flight == 0:
            self._busy_s += self._clock() - self._busy_since

    def stats(self) -> EngineStats:
        busy = self._busy_s + (self._clock() - self._busy_since if self.in_flight else 0.0)
        return EngineStats(self.in_flight, self.generated_tokens,
                           self.generated_tokens / busy if busy > 0 else 0.0)

"""Delta weight sync: send only the elements that changed since the version the receiver holds.

After a small update, many weights do not change at all once cast to the engine's dtype (an
update below half a bf16 step rounds away), so the receiver is sent, per tensor, the flat indices
and new values of the elements whose bytes changed. A tensor that changed in most of its elements
is sent whole. `diff` builds that body; `patch` applies it to the receiver's copy. The receiver
checks that it holds the base version the delta was taken against, and the sender checks the
result's fingerprint (`engines.base.fingerprint`) against its own copy: a delta is never applied
to other weights than its base, and a wrong result is never used.

Body (safetensors, names taken apart at the last `::`): `name::idx` (int32 or int64 flat indices)
with `name::val` (values, the tensor's dtype), or `name::full` (the whole tensor).

Both ends are shared by every receiver: `DeltaSender` is the sender's side (the copy of what the
receiver holds, delta or full, the counters) for the serving endpoint (`elastic.py`) and Ray
engine actors (`distributed/engine_actor.py`); `patch_engine` is the receiver's (the base check
and the patch) for reroll's server and the engine actor's host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from reroll.engines.base import fingerprint

log = logging.getLogger(__name__)

SEPARATOR = "::"
WHOLE_ABOVE = 0.5
"""A tensor with more than this share of its elements changed is sent whole (indices plus values
would be larger than the tensor)."""


def _bits(t: Tensor) -> Tensor:
    """The tensor's elements as integers of the same width: equal bits, equal elements (NaN
    included, and -0.0 told apart from 0.0)."""
    flat = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width)


def diff(base: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The delta body taking `base` to `new` (same names; a tensor whose shape or dtype changed,
    or that `base` lacks, goes whole)."""
    body: dict[str, Tensor] = {}
    for name, tensor in new.items():
        old = base.get(name)
        tensor = tensor.detach().cpu().contiguous()
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            body[f"{name}{SEPARATOR}full"] = tensor
            continue
        changed = (_bits(old.cpu()) != _bits(tensor)).nonzero().reshape(-1)
        if changed.numel() == 0:
            continue
        if changed.numel() > WHOLE_ABOVE * tensor.numel():
            body[f"{name}{SEPARATOR}full"] = tensor
            continue
        index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        body[f"{name}{SEPARATOR}idx"] = changed.to(index_dtype)
        body[f"{name}{SEPARATOR}val"] = tensor.reshape(-1)[changed]
    return body


def patch(base: Mapping[str, Tensor], body: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`base` with the delta `body` applied: the tensors it changes, as new tensors (`base` is
    not modified). A body naming a tensor `base` lacks, or indices past its size, is a
    ValueError."""
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in body.items():
        name, sep, kind = key.rpartition(SEPARATOR)
        if not sep or kind not in ("idx", "val", "full"):
            raise ValueError(f"{key!r} is not a delta entry (name::idx, name::val, name::full)")
        parts.setdefault(name, {})[kind] = value
    for name, part in parts.items():
        if "full" in part:
            out[name] = part["full"]
            continue
        if name not in base:
            raise ValueError(f"the delta changes {name!r}, which the receiver does not hold")
        if "idx" not in part or "val" not in part or part["idx"].numel() != part["val"].numel():
            raise ValueError(f"{name!r}: the delta's indices and values do not pair up")
        old = base[name]
        flat = old.detach().clone().reshape(-1)
        index = part["idx"].to(torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= flat.numel()):
            raise ValueError(f"{name!r}: the delta's indices go past its {flat.numel()} elements")
        flat[index.to(flat.device)] = part["val"].to(flat.dtype).to(flat.device)
        out[name] = flat.reshape(old.shape)
    return out


def body_bytes(body: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in body.values())


class BehindError(RuntimeError):
    """A delta against a version the receiver does not hold, or a receiver that takes no deltas:
    it asks for full weights (nothing applied)."""


def held_weights(engine) -> dict[str, Tensor] | None:
    """The engine's weights as it holds them (its dtype), for a delta; None when the engine
    does not expose them (vLLM keeps them in its own process)."""
    model = getattr(engine, "model", None)
    return dict(model.state_dict()) if isinstance(model, torch.nn.Module) else None


def held_dtype(engine) -> torch.dtype | None:
    """The dtype the engine holds its floating-point weights in (None: not exposed)."""
    held = held_weights(engine)
    return next((t.dtype for t in (held or {}).values() if t.is_floating_point()), None)


def patch_engine(engine, body: Mapping[str, Tensor], base: int) -> tuple[dict[str, Tensor], int]:
    """The receiver's side: the engine's whole weights with the delta `body` against weights
    version `base` applied, and how many tensors it changed, for `engine.load_weights`. An
    engine holding another version, or not exposing its weights, is a BehindError; a body that
    does not fit a ValueError; either way no weight has changed."""
    held = held_weights(engine)
    if held is None:
        raise BehindError(f"this engine ({type(engine).__name__}) does not take deltas; send "
                          "full weights")
    holds = getattr(engine, "version", None)
    if holds != base:
        raise BehindError(f"this engine holds weights version {holds}, not the delta's base "
                          f"{base}; send full weights")
    changed = patch(held, body)
    return held | changed, len(changed)


def in_dtype(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The weights as a receiver holding `dtype` will (a delta is of the receiver's bits, where
    a small update often changes nothing); None: as they are."""
    if dtype is None:
        return tensors
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}


@dataclass(frozen=True)
class DeltaPolicy:
    """Whether deltas are sent, and every how many syncs a full one is."""

    enabled: bool = True
    full_every: int = 10


@dataclass
class DeltaCounters:
    sync_bytes: int = 0
    """Weight bytes sent by the last sync (a delta's, or the full weights')."""
    full_bytes: int = 0
    """What the last sync would have sent in full (the receiver's dtype)."""
    delta_syncs: int = 0
    """Syncs sent as a delta."""
    delta_fallbacks: int = 0
    """Deltas refused (the receiver held another version, or does not take them) or whose
    result did not match, each followed by full weights."""


class DeltaRefused(RuntimeError):
    """The receiver did not take a delta (raised by a sender's `send_delta`)."""


class DeltaSender:
    """The sender's side for one receiver: a copy of the weights it holds (its dtype) and their
    version; each sync sends, against that version, what changed, or full weights when a delta
    would not be smaller, when the receiver refuses it or ends with another fingerprint (counted
    in `counters.delta_fallbacks`), and every `policy.full_every`-th sync."""

    def __init__(self, policy: DeltaPolicy, counters: DeltaCounters | None = None):
        self.policy = policy
        self.counters = counters if counters is not None else DeltaCounters()
        self.held: dict[str, Tensor] | None = None
        self.held_version: int | None = None
        self.held_fingerprint: str | None = None
        self._since_full = 0

    def send(self, wire: dict[str, Tensor], version: int,
             send_delta: Callable[[dict[str, Tensor], int, int], str],
             send_full: Callable[[dict[str, Tensor]], None], receiver: str) -> None:
        """`wire`: the weights in the receiver's dtype. `send_delta(body, base, version)` returns
        the receiver's fingerprint after applying it, or raises DeltaRefused; `send_full(wire)`
        raises when the receiver refuses full weights (the run stops)."""
        wire_fingerprint = fingerprint(wire.items())
        self.counters.full_bytes = body_bytes(wire)
        if not (self.held is not None and self._since_full + 1 < self.policy.full_every
                and self._delta(wire, wire_fingerprint, version, send_delta, receiver)):
            send_full(wire)
            self.counters.sync_bytes, self._since_full = body_bytes(wire), 0
        self.held, self.held_version, self.held_fingerprint = wire, version, wire_fingerprint

    def _delta(self, wire, wire_fingerprint, version, send_delta, receiver) -> bool:
        body = diff(self.held, wire)
        size = body_bytes(body)
        if size >= self.counters.full_bytes:
            return False
        try:
            theirs = send_delta(body, self.held_version, version)
            if theirs != wire_fingerprint:
                raise DeltaRefused(f"its fingerprint after the delta is {theirs}, not "
                                   f"{wire_fingerprint}")
        except DeltaRefused as e:
            self.counters.delta_fallbacks += 1
            log.warning("%s: delta to weights version %s not taken (%s); sending full weights "
                        "(%d fallbacks so far)", receiver, version, e,
                        self.counters.delta_fallbacks)
            return False
        self.counters.delta_syncs += 1
        self.counters.sync_bytes = size
        self._since_full += 1
        return True

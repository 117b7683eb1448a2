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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

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

"""Named tensors <-> one flat byte buffer, the unit in which weights travel between processes.

A flat uint8 numpy buffer goes through Ray's object store without pickling each tensor (zero-copy
on the reading side) and through `torch.distributed.broadcast` in a few large buckets; the small
metadata list says how to cut it back into named tensors of the right dtype and shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 16  # every tensor starts at a multiple of this, so a byte slice can be viewed as any dtype


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSlot]:
    slots, offset = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots


def buffer_size(slots: list[TensorSlot]) -> int:
    return max((-(-s.nbytes // ALIGN) * ALIGN + s.offset for s in slots), default=0)


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorSlot], torch.Tensor]:
    """(slots, flat uint8 CPU tensor) holding every tensor's exact bytes."""
    items = [(name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
    slots = layout(items)
    flat = torch.empty(buffer_size(slots), dtype=torch.uint8)
    for slot, (_, tensor) in zip(slots, items, strict=True):
        if slot.nbytes:
            flat[slot.offset: slot.offset + slot.nbytes] = tensor.reshape(-1).view(torch.uint8)
    return slots, flat


def unpack(slots: list[TensorSlot], flat: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
    """Named tensors viewing `flat` (a read-only numpy buffer from the object store is copied once)."""
    if isinstance(flat, np.ndarray):
        flat = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
    return {s.name: flat[s.offset: s.offset + s.nbytes].view(s.dtype).reshape(s.shape)
            for s in slots}

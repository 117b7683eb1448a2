"""The collective transport of `weight_sync: broadcast`, run inside the processes that take part
(the policy's rank 0 and the engine actors): a torch.distributed group of their own and a
bucketed broadcast of one flat uint8 buffer. A leaf: torch only, no roles, no Ray."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def join_group(address: tuple[str, int], rank: int, world_size: int, backend: str) -> Any:
    """A process group of its own (rank 0 hosts the rendezvous at `address`), independent of any
    default group this process is in (the policy's FSDP2 ranks)."""
    store = dist.TCPStore(address[0], address[1], world_size, is_master=rank == 0,
                          timeout=GROUP_TIMEOUT)
    store = dist.PrefixStore("reroll-weight-sync", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)


def _buckets(size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(start + bucket_bytes, size)) for start in range(0, size, bucket_bytes)]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def broadcast_buckets(group: Any, flat: torch.Tensor, bucket_bytes: int, backend: str) -> None:
    """Send `flat` (uint8, host memory) from rank 0, one bucket at a time (through the GPU when
    the group is NCCL's)."""
    for start, end in _buckets(flat.numel(), bucket_bytes):
        bucket = flat[start:end]
        _broadcast(group, bucket.cuda() if backend == "nccl" else bucket)


def receive_buckets(group: Any, size: int, bucket_bytes: int, backend: str) -> torch.Tensor:
    """The receiving side of `broadcast_buckets`: the flat buffer in host memory."""
    flat = torch.empty(size, dtype=torch.uint8)
    for start, end in _buckets(size, bucket_bytes):
        if backend == "nccl":
            bucket = torch.empty(end - start, dtype=torch.uint8, device="cuda")
            _broadcast(group, bucket)
            flat[start:end].copy_(bucket)
        else:
            _broadcast(group, flat[start:end])
    return flat

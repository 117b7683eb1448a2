"""Moving an optimizer's state off the accelerator and back, so that a colocated rollout engine
can use the device memory while the policy does not train (`reroll.distributed.colocation`
decides when). A strategy owns its optimizer, so it owns the offload too."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def optimizer_state_tensors(optimizer: torch.optim.Optimizer
                            ) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, value


class OptimizerOffload:
    """Moves an optimizer's state off the accelerator and back, to the very devices it came from."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.homes: list[tuple[dict, str, torch.device]] | None = None  # set while offloaded

    @property
    def offloaded(self) -> bool:
        return self.homes is not None

    def offload(self) -> int:
        """Move every state tensor on an accelerator to host memory (pinned, so `reload` copies
        back fast) and free the device's cached blocks. Returns the bytes moved: 0 on a CPU-only
        machine, where the state already is in host memory and there is nothing to free."""
        self.homes, moved = [], 0
        for state, key, tensor in list(optimizer_state_tensors(self.optimizer)):
            if tensor.device.type == "cpu":
                continue
            self.homes.append((state, key, tensor.device))
            if hasattr(tensor, "device_mesh"):  # an FSDP2 shard (DTensor) keeps its sharding
                state[key] = tensor.to("cpu")
            else:
                state[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                         pin_memory=True).copy_(tensor)
            moved += tensor.numel() * tensor.element_size()
        if moved and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved

    def reload(self) -> None:
        """Move the state back before the optimizer steps."""
        for state, key, device in self.homes or []:
            state[key] = state[key].to(device, non_blocking=True)
        self.homes = None

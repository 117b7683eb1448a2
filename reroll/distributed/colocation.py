"""Colocated roles take turns on their devices: the rollout engine sleeps while the policy trains,
and the policy offloads its optimizer state while the engine generates.

`TakeTurns` is driven by the pipeline at its phase boundaries (`rollout_turn()` before generating,
evaluating and syncing weights; `train_turn()` before scoring and updating); each call is a no-op
when that side already holds the devices. Going to rollout frees the trainer's memory first and
then wakes the engine; going to training puts the engine to sleep first. `Separate` is the same
interface for roles on different devices, where nothing swaps.

What is freed where: on an accelerator, `offload_optimizer_state` moves AdamW's moments to (pinned)
host memory and `sleep()` frees the engine's weights and KV cache. On a CPU-only machine the
"device" memory IS host memory, so there is nothing to free: offload leaves the state where it is
(and says so, 0 bytes moved) and `HFEngine.sleep()` does nothing; the turns are still taken, so
the ordering is the same as on GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from reroll.config.distributed import DistributedConfig
from reroll.config.errors import ConfigError


def optimizer_state_tensors(optimizer: torch.optim.Optimizer
                            ) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, value


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> int:
    """Bytes of optimizer state (on devices of `device_type` only, when given)."""
    return sum(t.numel() * t.element_size() for _, _, t in optimizer_state_tensors(optimizer)
               if device_type is None or t.device.type == device_type)


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


class TakeTurns:
    """`policy` has `offload()`/`reload()`, `engine` has `sleep()`/`wake()`. At first both are
    resident. `metrics()` reports the time spent swapping since its last call."""

    def __init__(self, policy: Any, engine: Any):
        self.policy, self.engine = policy, engine
        self.policy_resident, self.engine_awake = True, True
        self.history: list[str] = []  # the swaps made, in order (`reroll view`-free debugging)
        self._swap_s, self._swaps = 0.0, 0

    def rollout_turn(self) -> None:
        t0 = time.perf_counter()
        if self.policy_resident:
            self.policy.offload()
            self.policy_resident = False
            self._done("policy.offload", t0)
        if not self.engine_awake:
            self.engine.wake()
            self.engine_awake = True
            self._done("engine.wake", t0)

    def train_turn(self) -> None:
        t0 = time.perf_counter()
        if self.engine_awake:
            self.engine.sleep()
            self.engine_awake = False
            self._done("engine.sleep", t0)
        if not self.policy_resident:
            self.policy.reload()
            self.policy_resident = True
            self._done("policy.reload", t0)

    def _done(self, what: str, t0: float) -> None:
        self.history.append(what)
        self._swaps += 1
        self._swap_s += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {"time/colocation_swap_s": self._swap_s, "colocation/swaps": float(self._swaps)}
        self._swap_s, self._swaps = 0.0, 0
        return out


class Separate:
    """Roles on different devices: they may run at the same time; nothing to swap."""

    def rollout_turn(self) -> None:
        pass

    def train_turn(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def take_turns(config: Any, policy: Any, engine: Any) -> TakeTurns | Separate:
    """`TakeTurns` when the placement puts the rollout engine on the policy's devices."""
    from reroll.distributed.placement import colocated_with_policy

    d: DistributedConfig = config.distributed
    if not colocated_with_policy(d, "rollout"):
        return Separate()
    async_training = getattr(config, "async_training", None)
    if async_training is not None and async_training.enabled:
        raise ConfigError("distributed.rollout is colocated with the policy (they take turns), but "
                          "async_training.enabled overlaps rollout with training: give "
                          "distributed.rollout its own CPUs or devices, or disable async_training")
    for name, obj, methods in (("policy", policy, ("offload", "reload")),
                               ("rollout engine", engine, ("sleep", "wake"))):
        if not all(hasattr(obj, m) for m in methods):
            raise ConfigError(f"distributed.rollout.colocate_with: the {name} "
                              f"({type(obj).__name__}) cannot take turns (no {'/'.join(methods)}); "
                              f"give distributed.rollout its own CPUs or devices")
    return TakeTurns(policy, engine)

"""Colocated roles take turns on their devices: the rollout engine sleeps while the policy trains,
and the policy offloads its optimizer state while the engine generates.

`TakeTurns` is driven by the pipeline at its phase boundaries (`rollout_turn()` before generating,
evaluating and syncing weights; `train_turn()` before scoring and updating); each call is a no-op
when that side already holds the devices. Going to rollout frees the trainer's memory first and
then wakes the engine; going to training puts the engine to sleep first. `Separate` is the same
interface for roles on different devices, where nothing swaps.

What is freed where: on an accelerator, the policy's `offload()`
(`reroll.training.offload.OptimizerOffload`) moves AdamW's moments to (pinned)
host memory and `sleep()` frees the engine's weights and KV cache. On a CPU-only machine the
"device" memory IS host memory, so there is nothing to free: offload leaves the state where it is
(and says so, 0 bytes moved) and `HFEngine.sleep()` does nothing; the turns are still taken, so
the ordering is the same as on GPUs.
"""

from __future__ import annotations

import time
from typing import Any

from reroll.config.distributed import DistributedConfig
from reroll.config.errors import ConfigError
from reroll.distributed.placement import colocated_with_policy


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
    d: DistributedConfig = config.distributed
    if not colocated_with_policy(d, "rollout"):
        return Separate()
    if config.async_training.enabled:
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

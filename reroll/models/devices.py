"""Where each role of a run computes, and in which precision: one pure function of the config
and the devices this machine has, so every device decision is testable without a GPU.

`distributed.device` (`auto` | `cpu` | `cuda`) chooses for the local executor, where every role
lives in this process: `auto` is CUDA when there is one. On CUDA the policy, reference, critic
and HF engine all sit on `cuda:0`: the trainer keeps float32 master weights and computes in
bf16 autocast where the GPU supports bf16; the engine holds bf16 weights (`rollout.dtype: auto`);
the reference computes in bf16 autocast too. With the Ray executor a role's devices come from
`distributed.<role>.devices` (Ray makes each worker's GPU its only visible one, `cuda:0` in it):
a role given devices runs on CUDA, one without on CPUs. Explicit settings (`train.bf16_autocast`,
`rollout.dtype`) always win over these defaults.

On a CPU, `auto` is float32: bf16 changes the trained numbers, and on a CPU without native bf16
(no AMX or AVX512-BF16, which is most laptops and many cloud CPUs) a bf16 matmul runs many times
slower than float32 (a 1024x1024 one: 0.8 against 38 GFLOP/s on an AVX2 EPYC). bf16 asked for
explicitly on such a CPU is used, with one warning.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from reroll.config.distributed import DistributedConfig
from reroll.config.errors import ConfigError
from reroll.config.schema import RolloutConfig, TrainConfig

ROLES = ("policy", "reference", "critic", "rollout")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of the x86 instructions that compute bf16 natively."""

log = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass(frozen=True)
class RoleDevice:
    device: str
    """`cpu` or `cuda:0` (inside a Ray worker, its one visible GPU)."""
    autocast_bf16: bool
    """Compute the forward (and backward) in bf16 autocast, weights staying in their dtype."""
    engine_dtype: str = "auto"
    """The rollout engine's weight dtype (`auto`: the trained weights' dtype); rollout only."""


def resolve_device(setting: str, cuda_count: int, field: str = "distributed.device") -> str:
    """`distributed.device` (or the config's `field`) against this machine: `cpu` or `cuda:0`."""
    if setting == "cpu" or (setting == "auto" and cuda_count == 0):
        return "cpu"
    if cuda_count == 0:
        raise ConfigError(f"{field}: cuda, but torch sees no CUDA device "
                          "(torch.cuda.is_available() is False: no GPU, no driver, or a CPU "
                          f"build of torch); set {field}: auto or cpu")
    return "cuda:0"


def plan_devices(d: DistributedConfig, train: TrainConfig, rollout: RolloutConfig,
                 cuda_count: int, bf16_supported: bool) -> dict[str, RoleDevice]:
    """Each role's device and precision for an RL run's sections on a machine with
    `cuda_count` GPUs, `bf16_supported` telling whether they compute in bf16."""
    train_bf16, rollout_dtype = train.bf16_autocast, rollout.dtype
    if d.executor == "ray":
        plan = {}
        for role in ROLES:
            placement = getattr(d, role)
            owner = d.policy if placement.colocate_with == "policy" else placement
            on_gpu = bool(owner.devices)  # the worker's node has them, not necessarily this one
            plan[role] = _role(role, "cuda:0" if on_gpu else "cpu", bf16_supported, train_bf16,
                               rollout_dtype)
        return plan
    device = resolve_device(d.device, cuda_count)
    return {role: _role(role, device, bf16_supported, train_bf16, rollout_dtype)
            for role in ROLES}


def _role(role: str, device: str, bf16_supported: bool, train_bf16: bool | str,
          rollout_dtype: str) -> RoleDevice:
    fast_bf16 = device != "cpu" and bf16_supported
    if role == "rollout":
        dtype = rollout_dtype if rollout_dtype != "auto" or not fast_bf16 else "bfloat16"
        if device == "cpu" and dtype == "bfloat16":
            warn_slow_cpu_bf16("rollout.dtype: bfloat16")
        return RoleDevice(device, False, dtype)
    # Training keeps CPU numerics exactly as configured: bf16 is opt-in there (it changes the
    # trained model's numbers, and is many times slower on a CPU without native bf16).
    autocast = fast_bf16 if train_bf16 == "auto" else bool(train_bf16)
    if device == "cpu" and autocast:
        warn_slow_cpu_bf16("train.bf16_autocast: true")
    return RoleDevice(device, autocast)


def trainer_device(setting: str, train_bf16: bool | str, cuda_count: int,
                   bf16_supported: bool) -> RoleDevice:
    """The trained model's device and precision in the one-process pipelines (SFT, offline
    distillation, DPO, reward models) for their `device` setting (`auto` | `cpu` | `cuda`), as
    the policy's in an RL run with the local executor."""
    return _role("policy", resolve_device(setting, cuda_count, "device"), bf16_supported,
                 train_bf16, "auto")


def machine_devices() -> tuple[int, bool]:
    """(CUDA devices torch sees, whether they compute in bf16)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count, bool(count) and torch.cuda.is_bf16_supported()


def cpu_bf16_support(flags: set[str], onednn_bf16: bool) -> tuple[bool, str]:
    """(whether this CPU computes bf16 fast, a line saying what bf16 costs on it) from its
    /proc/cpuinfo `flags` and oneDNN's own check (`onednn_bf16`: it can run bf16 kernels, natively
    or emulated with AVX-512)."""
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return True, (f"native bf16 ({', '.join(native)}): `train.bf16_autocast: true` makes CPU "
                      "training several times faster (it changes the trained numbers)")
    if onednn_bf16:
        return False, ("no native bf16 (no AMX or AVX512-BF16; oneDNN emulates it with "
                       "AVX-512): no faster than float32; keep float32 (the default)")
    return False, ("no native bf16 (no AMX or AVX512-BF16): bf16 runs many times slower than "
                   "float32 here; keep float32 (the default)")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: oneDNN's check alone decides
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags")
            for flag in line.split(":", 1)[1].split()}


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


@functools.cache
def cpu_bf16() -> tuple[bool, str]:
    """`cpu_bf16_support` of this machine's CPU (read once)."""
    return cpu_bf16_support(_cpu_flags(), _onednn_bf16())


def warn_slow_cpu_bf16(setting: str) -> None:
    """Once per process: bf16 asked for (`setting`) on a CPU that does not compute it fast."""
    fast, detail = cpu_bf16()
    if not fast and setting not in _warned:
        _warned.add(setting)
        log.warning("%s on this CPU, which has %s", setting, detail)

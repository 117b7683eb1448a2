"""Starting (or joining) Ray once per process, quietly.

`ensure_ray()` with no address starts a local Ray instance sized to this machine (no dashboard,
a modest object store); with an address (`distributed.ray_address`, e.g. `ray://head:10001` or
`auto`, or else the `RAY_ADDRESS` environment variable, as Ray's own tools read it) it joins an
existing cluster instead. Calling it again is a no-op.
"""

from __future__ import annotations

import logging
import os

from reroll import settings
from reroll.config.errors import ConfigError

LOCAL_OBJECT_STORE_BYTES = 1 << 30
"""Enough for weight sync of models up to a few hundred million float32 parameters; Ray's default
(30% of RAM) would take memory the trainer needs on a laptop."""


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start a local Ray instance, or connect to `address`, unless this process already did.
    Ray is an extra (`make demo` leaves it out): without it, say how to get it."""
    try:
        import ray  # deferred: heavy to import, only Ray runs get here, and an extra
    except ImportError as e:
        raise ConfigError(f"distributed.executor: ray, but Ray is not installed ({e}); install "
                          "it with `pip install -e '.[ray]'` (`make test` installs it), or set "
                          "distributed.executor: local") from None

    if ray.is_initialized():
        return
    # Worker processes import reroll from the driver's working tree; keep their logs short.
    settings.defaults({"RAY_DEDUP_LOGS": "1"})
    ray.init(**init_kwargs(address, num_cpus))


def init_kwargs(address: str | None, num_cpus: int | None) -> dict:
    """`ray.init`'s arguments: join `address` (or `RAY_ADDRESS`), else start a local instance of
    `num_cpus` CPUs (a cluster's nodes were sized when they started: no sizes when joining)."""
    kwargs: dict = {"include_dashboard": False, "logging_level": logging.WARNING,
                    "log_to_driver": True, "configure_logging": True}
    address = address or settings.read("RAY_ADDRESS")
    if address is None:
        # "local", not None: with None, Ray joins whatever cluster last ran `ray start` on this
        # machine (another user's, another test run's) and then refuses the sizes given here.
        return kwargs | {"address": "local", "num_cpus": num_cpus or os.cpu_count() or 1,
                         "object_store_memory": LOCAL_OBJECT_STORE_BYTES}
    return kwargs | {"address": address}


def quiet_transformers() -> None:
    """No per-load progress bars from worker processes (they interleave with the run's bar)."""
    import transformers  # deferred: only worker processes need it, and it is slow to import

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

"""Sinks for experiment trackers that live outside the run directory's own files: wandb and trackio.

Each imports its library lazily (only when chosen in `tracking:`) and turns a failure to start into
a `TrackerError` naming the config key, so a run never goes on while silently logging nowhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError


class TrackerError(ConfigError):
    """A tracker chosen in the config could not start (exit code 2, like any config problem)."""


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = value
    return out


class _RunSink:
    """A tracker run (`self.run`, set by the subclass) that takes finite numbers per step."""

    run: Any

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class WandbSink(_RunSink):
    """Weights & Biases. Offline mode writes `<run>/wandb/offline-run-*` and needs no network."""

    def __init__(self, run_dir: Path, project: str, name: str, mode: str, entity: str | None,
                 config: dict[str, Any] | None):
        try:
            import wandb

            self.run = wandb.init(project=project, name=name, entity=entity, mode=mode,
                                  dir=str(run_dir), config=config or {}, reinit="create_new",
                                  settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # noqa: BLE001 - any failure to start is reported the same way
            raise TrackerError(
                f"tracking.wandb: wandb failed to start in {mode} mode ({type(e).__name__}: {e}). "
                f"Use tracking.wandb_mode=offline on a machine without network, run `wandb login` "
                f"for online mode, or set tracking.wandb=false") from None


class TrackioSink(_RunSink):
    """trackio: a local SQLite database (see `trackio show`), optionally synced to a Space."""

    def __init__(self, project: str, name: str, space_id: str | None,
                 config: dict[str, Any] | None):
        try:
            import trackio

            self.run = trackio.init(project=project, name=name, space_id=space_id,
                                    config=config or {}, embed=False, auto_log_cpu=False,
                                    auto_log_gpu=False)
        except Exception as e:  # noqa: BLE001
            raise TrackerError(
                f"tracking.trackio: trackio failed to start ({type(e).__name__}: {e}). Check "
                f"tracking.trackio_space_id (a Space needs network and a token), or set "
                f"tracking.trackio=false") from None


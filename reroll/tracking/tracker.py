"""Where metrics go: `metrics.jsonl` (always), tensorboard, wandb, trackio, and a rich progress
bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from reroll.config.schema import TrackingConfig
from reroll.tracking.jsonsafe import dumps
from reroll.tracking.remote import TrackioSink, WandbSink


class JsonlSink:
    """One JSON object per step in `metrics.jsonl`. On resume, lines after the checkpoint's step are
    dropped first, so the file always describes one consistent run."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text(errors="replace").splitlines()
                    if _step_of(line) is not None and _step_of(line) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a blank line or one cut short by a killed run (it
    was written after the checkpoint being resumed from, so dropping it loses nothing)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row.get("step") if isinstance(row, dict) else None


class TensorboardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ProgressBar:
    """A rich progress bar over training steps showing the live reward; silent when not a TTY."""

    def __init__(self, total: int, description: str, start: int = 0, enabled: bool = True):
        self.console = Console(stderr=True)
        enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task(description, total=total, completed=start, status="")
        self.progress.start()

    def update(self, step: int, status: str) -> None:
        self.progress.update(self.task, completed=step, status=status)

    def close(self) -> None:
        self.progress.stop()


class Tracker:
    """Fans one `log(step, metrics)` out to every sink chosen in the `tracking:` config.

    `tracking` is the run's TrackingConfig (a bare bool still means "tensorboard or not");
    `run_config` (the resolved config as a dict) is attached to the wandb and trackio runs.
    """

    def __init__(self, run_dir: Path, tracking: Any, resume_step: int | None = None,
                 run_config: dict[str, Any] | None = None):
        if isinstance(tracking, bool):
            tracking = TrackingConfig(tensorboard=tracking)
        self.sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        try:
            self.sinks += _optional_sinks(run_dir, tracking, run_config or {})
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _optional_sinks(run_dir: Path, tracking: TrackingConfig, run_config: dict[str, Any]) -> list:
    name = str(run_config.get("name") or run_dir.name)
    sinks: list[Any] = []
    if tracking.tensorboard:
        sinks.append(TensorboardSink(run_dir / "tensorboard"))
    if tracking.wandb:
        sinks.append(WandbSink(run_dir, tracking.project, name, tracking.wandb_mode,
                               tracking.wandb_entity, run_config))
    if tracking.trackio:
        sinks.append(TrackioSink(tracking.project, name, tracking.trackio_space_id, run_config))
    return sinks



def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

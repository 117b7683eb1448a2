"""Where metrics go: `metrics.jsonl` (always), tensorboard, wandb, trackio, and a rich progress
bar."""

from __future__ import annotations

import json
import math
import sys
import time
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
    """Progress over training steps with the live status (reward, eval): a rich bar on a
    terminal; elsewhere (a log file, a pipe, a job scheduler) a plain line at the first and last
    step, every tenth of the run and at least every `interval_s` seconds, so a long run is never
    silent until its end."""

    def __init__(self, total: int, description: str, start: int = 0, enabled: bool = True,
                 interval_s: float = 30.0, stream: Any = None):
        self.console = Console(stderr=True)
        self.stream = stream
        self.plain = enabled and not (stream or sys.stderr).isatty()
        self.total, self.start, self.description, self.interval_s = total, start, description, \
            interval_s
        self.started = self.last_line = time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, disable=not enabled or self.plain, transient=False,
        )
        self.task = self.progress.add_task(description, total=total, completed=start, status="")
        self.progress.start()

    def update(self, step: int, status: str) -> None:
        self.progress.update(self.task, completed=step, status=status)
        if self.plain and self._line_due(step):
            print(self.line(step, status), file=self.stream or sys.stderr, flush=True)
            self.last_line = time.perf_counter()

    def _line_due(self, step: int) -> bool:
        tenth = max(1, self.total // 10)
        return (step in (self.start + 1, self.total) or step % tenth == 0
                or time.perf_counter() - self.last_line >= self.interval_s)

    def line(self, step: int, status: str) -> str:
        """`GRPO step 12/40 | reward 0.312 | elapsed 1m05s | eta 2m30s`."""
        elapsed = time.perf_counter() - self.started
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else None
        parts = [f"{self.description} step {step}/{self.total}", status,
                 f"elapsed {_duration(elapsed)}", f"eta {_duration(eta) if eta is not None else '?'}"]
        return " | ".join(part for part in parts if part)

    def close(self) -> None:
        self.progress.stop()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (
        f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


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

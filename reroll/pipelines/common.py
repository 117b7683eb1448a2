"""What every pipeline shares: the run directory, seeding, checkpoints and the summary."""

from __future__ import annotations

import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel

from reroll.config.errors import ConfigError, RunStopped
from reroll.tracking.jsonsafe import dumps

CHECKPOINTS = "checkpoints"
log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int | None) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)


class RunDir:
    """`runs/<name>/`: config.yaml, metrics.jsonl, checkpoints/step_N/, summary.json."""

    def __init__(self, path: Path):
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: BaseModel) -> None:
        data = config.model_dump(mode="json")
        (self.path / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step_{step}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        root = self.path / CHECKPOINTS
        found = []
        for child in root.glob("step_*") if root.is_dir() else []:
            match = re.fullmatch(r"step_(\d+)", child.name)
            if match and (child / "trainer_state.pt").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def resolve_resume(self, resume: bool | str) -> tuple[int, Path] | None:
        """(step, checkpoint dir) to resume from, or None for a fresh run."""
        if resume is False:
            return None
        if resume is True:
            found = self.checkpoints()
            if not found:
                raise ConfigError(f"resume=true: no checkpoint in {self.path / CHECKPOINTS}")
            return found[-1]
        path = Path(resume)
        match = re.fullmatch(r"step_(\d+)", path.name)
        if not match or not (path / "trainer_state.pt").is_file():
            raise ConfigError(f"resume={resume}: not a checkpoint directory (expected "
                              f".../checkpoints/step_N with trainer_state.pt)")
        return int(match.group(1)), path

    def prune_checkpoints(self, keep_last: int) -> None:
        for _, path in self.checkpoints()[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.path / "summary.json"
        path.write_text(dumps(summary, indent=2) + "\n")
        return path


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


class UpdateGuard:
    """Optimizer updates skipped because the loss or the gradient norm came out non-finite
    (`training.local.optimizer_step` leaves the weights untouched then): counted, and `limit`
    in a row stop the run, so a run that cannot learn neither pretends to nor saves NaN weights."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """`metrics` of one `train_step`; raises RunStopped at the limit."""
        if not metrics.get("train/update_skipped"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        source = "loss" if metrics.get("train/nonfinite_loss") else "gradient norm"
        log.warning("step %d: optimizer update skipped, non-finite %s", step, source)
        if self.in_a_row >= self.limit:
            raise RunStopped(
                f"step {step}: {self.in_a_row} optimizer updates in a row skipped, the last for a "
                f"non-finite {source} (train/loss {metrics.get('train/loss')}, train/grad_norm "
                f"{metrics.get('train/grad_norm')}); train.max_skipped_updates is {self.limit}. "
                f"The weights are those of the last finite update; no checkpoint was written "
                f"for this step.")

    def metrics(self) -> dict[str, float]:
        return {"train/skipped_updates": float(self.total)}

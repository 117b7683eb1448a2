"""What every pipeline shares: the run directory, seeding, checkpoints and the summary."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel

from reroll import settings
from reroll.config.errors import ConfigError, RunStopped
from reroll.models.files import safetensors_problem
from reroll.models.lora import is_adapter_dir
from reroll.tracking.jsonsafe import dumps

CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", CHECKPOINTS)
"""What marks a directory as a reroll run directory (which `overwrite: true` may clear)."""

log = logging.getLogger(__name__)


def out_of_space(error: BaseException, path: Path) -> bool:
    """Whether writing under `path` failed for want of space: ENOSPC or EDQUOT anywhere in the
    error's chain, or (torch's serializer says only "file write failed") a write error with
    less than 1 MiB left on the file system."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, (OSError, RuntimeError)) and "write" in str(error).lower():
        with contextlib.suppress(OSError):
            return shutil.disk_usage(path if path.exists() else path.parent).free < 1 << 20
    return False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int | None) -> str | None:
    """Apply `train.num_threads`; unset, torch's default (every core) unless the machine was
    already busy when the process started (`settings.contention`): then the cores left idle.
    Returns the line that says so, or None."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        return None
    chosen = settings.contention()
    if chosen is None:
        return None
    torch.set_num_threads(chosen.threads)
    return chosen.line("train.num_threads: N")


def busy_hint() -> str | None:
    """The hint for a step run while the machine is oversubscribed (its load a core beyond the
    cores) with more than one torch thread, or None: oversubscribed threads wait on one another,
    and one thread was about 3x faster than every core on a busy machine (issue 49)."""
    if torch.get_num_threads() <= 1:
        return None
    cores, load = settings.cores(), settings.load()
    if load is None or not settings.busy(cores, load):
        return None
    return (f"the machine is busy (load {load:.1f} on {cores} cores): train.num_threads: 1 is "
            f"often faster here")


def writable_dir(path: Path, what: str) -> Path:
    """Create `path` and prove it writable (a probe file), so a bad output location is one
    message at start-up, not a traceback after the work is done."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be created or written ({e.strerror or e})"
                          ) from None
    return path


def checkpoint_problem(directory: Path) -> str | None:
    """Why `directory` cannot be resumed from (a file missing or cut short), or None. Cheap: it
    reads only file headers (safetensors header vs file size, the zip directory of .pt files)."""
    if not (directory / "config.json").is_file() and not is_adapter_dir(directory):
        return "config.json is missing (nor is it a LoRA run's adapter_config.json)"
    shards = sorted(directory.rglob("*.safetensors"))
    if not shards:
        return "no *.safetensors weights"
    for path in [*shards, *sorted(directory.rglob("*.pt"))]:
        problem = safetensors_problem(path) if path.suffix == ".safetensors" else (
            None if zipfile.is_zipfile(path) else "is truncated or not a torch file")
        if problem:
            return f"{path.relative_to(directory)} {problem}"
    return None


class RunDir:
    """`runs/<name>/`: config.yaml, metrics.jsonl, checkpoints/step_N/, summary.json."""

    def __init__(self, path: Path):
        self.path = writable_dir(Path(path), "output_dir")

    @classmethod
    def for_run(cls, path: Path, resume: bool | str, overwrite: bool) -> RunDir:
        """The run directory of a new run (refused when it already holds another run, unless
        `overwrite` clears it) or of a resumed one. Leftover partial checkpoints are removed."""
        run_dir = cls(path)
        existing = sorted(p.name for p in run_dir.path.iterdir())
        if existing and resume is False:
            if not overwrite:
                raise ConfigError(
                    f"output_dir {run_dir.path} already holds files ({', '.join(existing[:4])}"
                    f"{', ...' if len(existing) > 4 else ''}); set resume=true to continue that "
                    f"run, or overwrite=true to delete it and start over")
            run_dir.clear()
        run_dir.remove_partial_checkpoints()
        return run_dir

    def clear(self) -> None:
        """Delete the run's files (`overwrite: true`); a directory that is not a run directory
        is never emptied."""
        if not any((self.path / name).exists() for name in RUN_FILES):
            raise ConfigError(f"overwrite=true: {self.path} is not a reroll run directory (no "
                              f"{', '.join(RUN_FILES)}); refusing to delete its files")
        for child in self.path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def write_config(self, config: BaseModel) -> None:
        data = config.model_dump(mode="json")
        (self.path / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step_{step}"

    def staging_dir(self, step: int) -> Path:
        """Where step N's checkpoint is written before `commit` renames it into place, so a
        kill during the write never leaves a `step_N/` that looks complete."""
        staging = self.path / CHECKPOINTS / f"step_{step}{PARTIAL}"
        if staging.exists():
            shutil.rmtree(staging)
        return staging

    @contextlib.contextmanager
    def writing_checkpoint(self, step: int) -> Iterator[Path]:
        """`with run_dir.writing_checkpoint(N) as directory:` write step N's checkpoint into
        `directory`; it becomes `step_N/` when the block ends. A full disk (or quota) stops the
        run (RunStopped, exit 1) saying so, the partial checkpoint removed (it would only hold
        space) and the complete ones kept; other failures propagate as they are."""
        staging = self.staging_dir(step)
        try:
            yield staging
        except Exception as e:
            if not out_of_space(e, staging):
                raise
            shutil.rmtree(staging, ignore_errors=True)
            complete = [p for _, p in self.checkpoints() if checkpoint_problem(p) is None]
            kept = f"the last complete checkpoint, {complete[-1]}, is kept" if complete else \
                "no earlier checkpoint was written"
            raise RunStopped(f"no space left on device, checkpoint step {step} not written "
                             f"({kept}); free space on {self.path} and resume") from None
        self.commit(step)

    def commit(self, step: int) -> Path:
        final = self.checkpoint_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(self.path / CHECKPOINTS / f"step_{step}{PARTIAL}", final)
        return final

    def remove_partial_checkpoints(self) -> None:
        for partial in (self.path / CHECKPOINTS).glob(f"step_*{PARTIAL}"):
            shutil.rmtree(partial, ignore_errors=True)

    def checkpoints(self) -> list[tuple[int, Path]]:
        root = self.path / CHECKPOINTS
        found = []
        for child in root.glob("step_*") if root.is_dir() else []:
            match = re.fullmatch(r"step_(\d+)", child.name)
            if match and (child / "trainer_state.pt").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def resolve_resume(self, resume: bool | str) -> tuple[int, Path] | None:
        """(step, checkpoint dir) to resume from, or None for a fresh run. `resume=true` takes
        the newest checkpoint that is complete, saying which ones it skipped and why."""
        if resume is False:
            return None
        if resume is True:
            for step, path in reversed(self.checkpoints()):
                problem = checkpoint_problem(path)
                if problem is None:
                    return step, path
                log.warning("resume: skipping %s, which is incomplete or unreadable (%s)",
                            path, problem)
            raise ConfigError(f"resume=true: no complete checkpoint in {self.path / CHECKPOINTS}")
        path = Path(resume)
        match = re.fullmatch(r"step_(\d+)", path.name)
        if not match or not (path / "trainer_state.pt").is_file():
            raise ConfigError(f"resume={resume}: not a checkpoint directory (expected "
                              f".../checkpoints/step_N with trainer_state.pt)")
        problem = checkpoint_problem(path)
        if problem:
            raise ConfigError(f"resume={resume}: the checkpoint is incomplete or unreadable "
                              f"({problem})")
        return int(match.group(1)), path

    def finished_summary(self, resume: bool | str, steps: int) -> dict[str, Any] | None:
        """For a resumed run: None when there are steps left to run; the run's summary when its
        checkpoint is already at `steps` (nothing is changed). Fewer steps than done is an error."""
        found = self.resolve_resume(resume)
        if found is None or found[0] < steps:
            return None
        if found[0] > steps:
            raise ConfigError(f"steps={steps}: the run already has {found[0]} steps "
                              f"({found[1]}); resume with steps >= {found[0]}")
        log.warning("run %s already finished at step %d; nothing changed (raise `steps` to "
                    "train further)", self.path, steps)
        summary = self.path / "summary.json"
        try:
            done = json.loads(summary.read_text())
        except (OSError, ValueError):
            done = {"run_dir": str(self.path), "steps": steps, "final_checkpoint": str(found[1])}
        return done | {"already_finished": True}

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

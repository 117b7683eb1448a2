"""What a run is given as Python objects rather than named in its config (`reroll.api`): a
reward, an environment factory, and files (datasets passed as objects, a note of the objects)
written into the run directory at start so the run records what it was given.

The pipelines take a `TaskInputs` next to their config; the config itself stays a plain,
serialisable record (`reward.type: python` with the functions' names, `data.train` pointing at
the dataset saved under the run directory's `inputs/`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardFn

INPUTS = "inputs"
"""The run directory's folder for what was passed as objects."""


@dataclass(frozen=True)
class InputFile:
    path: str
    """Relative to the run directory."""
    text: str
    what: str
    """What the user passed, for the error when a resume passes something else."""


@dataclass(frozen=True)
class TaskInputs:
    reward_factory: Callable[[], RewardFn] | None = None
    """Builds the reward to use instead of the one `config.reward` names (the section then
    gives the limits and records the functions' names). A factory: a pipeline rebuilt after a
    worker died (`supervise`) starts a fresh one, as it does from the config."""
    env_factory: Callable[[], Any] | None = None
    """A fresh environment per episode, instead of `make_env(config.env.id, ...)`."""
    files: tuple[InputFile, ...] = field(default_factory=tuple)

    def reward_fn(self) -> RewardFn | None:
        return self.reward_factory() if self.reward_factory is not None else None

    def write_files(self, run_dir: Path) -> None:
        """Write the files into a new run's directory. A resumed run already has them: a file
        that differs means other objects than the run started with, which is refused (the
        sampler's position and the recorded config would no longer describe the run)."""
        for item in self.files:
            path = run_dir / item.path
            if path.is_file():
                if path.read_text() != item.text:
                    raise ConfigError(f"{item.what}: differs from what the run in {run_dir} was "
                                      f"started with ({path}); resume with the same objects, or "
                                      f"start a new run (another output_dir, or overwrite=true)")
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(item.text)

"""Which steps write a checkpoint and which checkpoints are kept, for every pipeline (RL and SFT).

`checkpoint.every_steps` and the last step write one; `checkpoint.keep_steps` names steps that
are written and never pruned (what `reroll replay RUN --step N` needs is the checkpoint of step
N-1); of the rest, the newest `checkpoint.keep_last` are kept.
"""

from __future__ import annotations

import shutil

from reroll.config.schema import CheckpointConfig
from reroll.pipelines.common import RunDir


def checkpoint_due(config: CheckpointConfig, step: int, steps: int) -> bool:
    """Whether `step` (of `steps`) writes `checkpoints/step_N/`."""
    every = config.every(steps)
    return step == steps or step in config.keep_steps or bool(every and step % every == 0)


def prune_checkpoints(run_dir: RunDir, config: CheckpointConfig) -> list[int]:
    """Delete the checkpoints that neither `keep_steps` nor `keep_last` keeps; returns the steps
    deleted. The newest checkpoint is always among the `keep_last` newest, so resume finds it."""
    found = [(step, path) for step, path in run_dir.checkpoints() if step not in config.keep_steps]
    deleted = []
    for step, path in found[:-config.keep_last]:
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(step)
    return deleted

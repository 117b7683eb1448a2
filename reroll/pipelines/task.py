"""The task protocol: what an RL pipeline asks of the work it trains on.

The RL step (`reroll.pipelines.rl.RLStep`) owns the roles and the training step, the run
(`reroll.pipelines.run.Run`) the loop and the run directory;
a task owns where the step's trajectories come from and how they are rewarded: prompts with a
reward (`rlvr.PromptTask`) or environments (`agentic.EnvTask`). A new kind of work plugs in as
another task, never as a subclass of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from reroll.data.batch import Trajectory, trajectory_row
from reroll.engines.base import Engine, SamplingParams


class Task(Protocol):
    label: str
    """Shown before the algorithm's name on the progress bar ("" for none)."""
    eval_sets: list[EvalSet]
    """The held-out sets of the last `evaluate`, as sampled: the run viewer's
    `rollouts/eval_step_N.jsonl` and `reroll eval`'s pass@k read them."""

    @property
    def evaluates(self) -> bool:
        """Whether the task has held-out data for `evaluate`."""
        ...

    @property
    def eval_what(self) -> str:
        """What `evaluate` runs, for the run's first lines ("8 held-out prompts")."""
        ...

    def start(self, engine: Engine) -> Engine:
        """Begin producing trajectories with `engine` (after the roles are built). Returns the
        engine the policy's weights go to and evaluation samples from (an async source puts its
        producer's facade in front of `engine`)."""
        ...

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        """Step `step`'s rewarded trajectories, `rollout.group_size` per group; the trainer's
        weights are version `step - 1`. Raises RunStopped when the reward keeps failing."""
        ...

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Metrics on the held-out data (at least `eval/reward_mean`); {} without any."""
        ...

    def metrics(self) -> dict[str, float]:
        """The task's metrics after the last `next_batch` (reward errors, env counters, ...)."""
        ...

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        """Up to `count` rows of the step for `rollouts/step_N.jsonl` (`reroll view`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the task (its position in the data, its counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` (read from a checkpoint's trainer state)."""
        ...

    def close(self) -> None:
        ...


@dataclass
class EvalSet:
    """One held-out set as the last `evaluate` sampled it: `groups[i]` holds the
    `eval.samples_per_prompt` trajectories of its prompt (env seed, task row) i, in the set's
    order; `counters`: what else the set's sampling counted (its reward's failures so far, the
    episodes' env counters)."""

    name: str
    groups: list[list[Trajectory]]
    counters: dict[str, float] = field(default_factory=dict)

    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group]


def grouped(trajectories: list[Trajectory], size: int) -> list[list[Trajectory]]:
    """Row-major trajectories (a group contiguous, as `rollout` returns them) as groups."""
    return [trajectories[i:i + size] for i in range(0, len(trajectories), size)]


def reward_failures(rewards) -> dict[str, float]:
    """A reward runner's failed calls so far (each scored 0): `EvalSet.counters` of prompts."""
    c = rewards.counters
    return {"reward_errors": float(c.errors), "reward_timeouts": float(c.timeouts),
            "reward_nonfinite": float(c.nonfinite)}


def held_out(count: int, unit: str, samples: int = 1) -> str:
    """`8 held-out prompts`, `4 held-out episodes x 2 samples`."""
    text = f"{count} held-out {unit}{'s' if count != 1 else ''}"
    return text + (f" x {samples} samples" if samples > 1 else "")


def rollout_row(t: Trajectory) -> dict[str, Any]:
    """One trajectory as a `rollouts/step_N.jsonl` (or `eval_step_N.jsonl`) row (the keys
    `reroll view` reads)."""
    return trajectory_row(t) | {"group_id": t.group_id}

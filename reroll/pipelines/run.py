"""The run loop of every pipeline: RL (a `Task` on prompts or environments), SFT, offline
distillation, DPO and reward models.

`Run` owns what every kind of run shares: the run directory, resume, the tracker, the checkpoint
cadence, progress (from the first second), the summary, and restarts after a dead worker
(`supervise`). What a step trains and how is a `Step`, built by the pipeline's factory named in
the table of pipelines (`reroll.config.pipelines`): `rl.RLStep`, `sft.SFTStep` (distillation is
an SFT step with a teacher's loss) and `preference.PreferenceStep` (DPO and RM objectives).

One step of any run: `next_batch` -> `train` -> evaluation when due -> metrics -> `record` ->
checkpoint when due. A resumed run continues from the newest checkpoint exactly as the
uninterrupted run would have (the step keeps its data position, counters and RNG in it).
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Any, Protocol

from reroll.config.pipelines import kind_of
from reroll.pipelines.checkpoints import checkpoint_due, prune_checkpoints
from reroll.pipelines.common import RunDir, Stopwatch, busy_hint, seed_everything, set_threads
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.supervisor import supervise
from reroll.tracking import ProgressBar, Tracker


class Step(Protocol):
    """What one kind of run trains: built after the run directory, before resume."""

    label: str
    """Names the run's algorithm: the progress bar's and the finish message's ("grpo/ppo")."""
    steps: int
    """The run's optimizer steps (SFT and preference runs may count them from their data)."""
    eval_every: int
    """Evaluate every N steps besides before the first and after the last (0: only then)."""
    eval_what: str
    """What an evaluation runs on ("8 held-out prompts"); "" when the run has nothing held out."""
    phase: str
    """What a step does first, said before step 1 ("generating", "training")."""
    start_row: bool
    """The evaluation before step 1 is also metrics.jsonl's step-0 row (preference runs chart
    it; RL and SFT runs keep it in summary.json only)."""

    def next_batch(self, step: int) -> Any:
        """Step `step`'s batch (RL: its rewarded trajectories; SFT, preference: data rows)."""

    def train(self, batch: Any, step: int) -> dict[str, float]:
        """One training step on `batch`; its metrics (RL: with the weights synced)."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics after step `step` (0: before the first), `eval/...`; {} for none."""

    def record(self, step: int, batch: Any) -> None:
        """Keep what the report and replay read of the step (rollouts, batches)."""

    def status(self, metrics: dict[str, float]) -> str:
        """The progress bar's status after a step."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the weights (data position, counters)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` (with "step", the checkpoint's step)."""

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        """Write the weights (and optimizer, schedule, RNG) with `state` into `directory`."""

    def load(self, directory: Path) -> dict[str, Any]:
        """Load what `save` wrote; returns its `state`."""

    def save_final(self, directory: Path) -> dict[str, Any]:
        """The trained model for use after the run (`final/`); the summary keys naming it."""

    def summary_keys(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        """The kind's headline figures for summary.json, from the first and last evaluation."""

    def close(self) -> None:
        """Stop what the step started (rollout source, reward workers, role processes)."""


def step_factory(name: str):
    """The pipeline's step factory from the table: `config -> (run_dir, inputs) -> Step`; its
    first call checks what must stop the run before its directory is made."""
    module, function = kind_of(name).step.split(":")
    return getattr(importlib.import_module(module), function)


class Run:
    """One run of any pipeline, from its config."""

    def __init__(self, config: Any, inputs: TaskInputs | None = None, step=None):
        """`step`: a step factory other than the table's (a benchmark that times a part)."""
        self.config = c = config
        self.kind = kind_of(c.pipeline)
        self.restarts = 0  # set by `supervise` when this run resumes after a dead worker
        self.hinted = False  # the busy-machine hint is said once per run
        threads = set_threads(c.train.num_threads)
        if threads:
            self.say(threads)
        seed_everything(c.seed)
        build = (step or step_factory(c.pipeline))(c)
        self.run_dir = RunDir.for_run(c.run_dir(), c.resume, c.overwrite)
        (inputs or TaskInputs()).write_files(self.run_dir.path)
        self.say(f"{self.kind.title} run {self.run_dir.path}: loading {c.model.path}")
        self.step: Step = build(self.run_dir.path, inputs)
        self.start_step, self.eval_start = 0, None
        resume = self.run_dir.resolve_resume(c.resume)
        if resume:
            self.restore(*resume)
        self.run_dir.write_config(c)
        self.tracker = Tracker(self.run_dir.path, c.tracking,
                               resume_step=self.start_step if resume else None,
                               run_config=c.model_dump(mode="json"))

    def run(self) -> dict:
        steps, clock = self.step.steps, Stopwatch()
        if self.start_step == steps:  # resumed at its last step: nothing to do
            self.tracker.close()
            self.step.close()
            return self.run_dir.finished_summary(self.config.resume, steps)
        if self.eval_start is None:  # kept in checkpoints: a resumed run reports the first
            self.eval_start = self.evaluate(0)
            if self.eval_start and self.step.start_row:
                self.tracker.log(0, self.eval_start)
        bar = ProgressBar(steps, self.step.label, self.start_step, self.config.tracking.progress)
        eval_end: dict[str, float] = {}
        for n in range(self.start_step + 1, steps + 1):
            timer = Stopwatch()
            self.say_first(n)
            batch = self.step.next_batch(n)
            metrics = self.step.train(batch, n)
            if self.restarts:  # every step after a restart says so
                metrics["fault/restarts"] = self.restarts
            if self.eval_due(n):
                eval_end = self.evaluate(n)
                metrics |= eval_end
            metrics["time/step_s"] = timer.seconds()
            self.hint_busy()
            self.tracker.log(n, metrics)
            self.step.record(n, batch)
            self.checkpoint(n)
            bar.update(n, self.step.status(metrics | eval_end))
        bar.close()
        return self.finish(eval_end, clock.seconds())

    # -- phases ----------------------------------------------------------------------------------

    def evaluate(self, n: int) -> dict[str, float]:
        what = self.step.eval_what
        if not what:
            return {}
        if n == 0:  # later ones: the progress bar is up
            self.say(f"evaluating on {what} before step 1")
        return self.step.evaluate(n)

    def eval_due(self, n: int) -> bool:
        every = self.step.eval_every
        return bool(self.step.eval_what) and (n == self.step.steps or bool(every and n % every == 0))

    def checkpoint(self, n: int) -> None:
        cadence = self.config.checkpoint
        if not checkpoint_due(cadence, n, self.step.steps):
            return
        with self.run_dir.writing_checkpoint(n) as directory:  # step_N/ once complete
            self.step.save(directory, {"step": n, "eval_start": self.eval_start}
                           | self.step.state_dict())
        prune_checkpoints(self.run_dir, cadence)

    def restore(self, n: int, directory: Path) -> None:
        if n > self.step.steps:
            from reroll.config.errors import ConfigError

            raise ConfigError(f"steps={self.step.steps}: the run already has {n} steps "
                              f"({directory}); resume with steps >= {n}")
        state = self.step.load(directory)
        self.step.load_state_dict(state | {"step": n})
        self.start_step, self.eval_start = n, state.get("eval_start")

    def finish(self, eval_end: dict[str, float], wall_time_s: float) -> dict:
        final = self.step.save_final(self.run_dir.path / "final")
        self.tracker.close()
        self.close()
        start = self.eval_start or {}
        summary = {
            "run_dir": str(self.run_dir.path), "pipeline": self.kind.name,
            "algorithm": self.step.label, "steps": self.step.steps,
            "resumed_from_step": self.start_step or None, "restarts": self.restarts,
            **self.step.summary_keys(start, eval_end),
            "eval_start": start, "eval_end": eval_end,
            "wall_time_s": round(wall_time_s, 2), **final,
            "final_checkpoint": str(self.run_dir.checkpoint_dir(self.step.steps)),
        }
        self.run_dir.write_summary(summary)
        return summary

    def close(self) -> None:
        self.step.close()

    # -- progress --------------------------------------------------------------------------------

    def say(self, line: str) -> None:
        """What the run is doing, one line on stderr, before the progress bar can say it (a
        model loading, the first evaluation, the first step's rollouts take minutes)."""
        if self.config.tracking.progress:
            print(f"reroll: {line}", file=sys.stderr, flush=True)

    def hint_busy(self) -> None:
        if not self.hinted:
            hint = busy_hint()
            if hint:
                self.say(hint)
                self.hinted = True

    def say_first(self, n: int) -> None:
        if n == self.start_step + 1:
            self.say(f"step {n} of {self.step.steps}: {self.step.phase}")


def train(config: Any, inputs: TaskInputs | None = None) -> dict:
    """Run `config`'s pipeline to its end; when a worker process dies, restart and resume from
    the last checkpoint, up to `distributed.max_restarts` times. Resuming a finished run
    changes nothing."""
    if config.steps is not None:  # else the step count needs the data: known once it is loaded
        done = RunDir(config.run_dir()).finished_summary(config.resume, config.steps)
        if done is not None:
            return done
    return supervise(functools.partial(Run, inputs=inputs), config)

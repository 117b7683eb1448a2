"""`reroll replay RUN_DIR --step N [key=value ...]`: recompute step N's losses from its recorded
batch (`rollouts/step_N.batch.pt`) and the checkpoint before it (`checkpoints/step_{N-1}`, or the
initial model for step 1), with the same pipeline code a run uses.

Without overrides it is a check that the step reproduces (every logged loss metric equal, and the
updated weights equal to `checkpoints/step_N` when that exists); with overrides
(`algorithm.policy_loss.clip_high=0.4`) it shows what a change would have done to that step.
Nothing in the run directory is written: the replay pipeline runs in a scratch folder.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.tracking.jsonsafe import dumps

IGNORED_PREFIXES = ("time/",)  # wall-clock figures never reproduce


def replay_step(run_dir: str | Path, step: int, overrides: list[str] | None = None,
                atol: float = 1e-6) -> dict[str, Any]:
    """Replay `step` of the run in `run_dir`; returns recorded vs replayed metrics."""
    from reroll.config import load_config
    from reroll.config.pipelines import kind_of
    from reroll.engines.base import fingerprint
    from reroll.pipelines.common import RunDir
    from reroll.pipelines.run import Run
    from reroll.rollout.metrics import rollout_metrics
    from reroll.rollout.recording import batch_path, load_batch

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run}: no config.yaml; is it a run directory written by `reroll train`?")
    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    if not batch_path(run, step).is_file():
        raise ConfigError(f"--step {step}: {batch_path(run, step)} does not exist (batches are "
                          f"stored every tracking.record_batch_every steps). "
                          f"{_replayable_hint(run)}")
    trajectories = load_batch(batch_path(run, step))
    recorded = _recorded_metrics(run, step)
    start = _start_checkpoint(run, step)
    config = load_config(run / "config.yaml", overrides)
    if not kind_of(config.pipeline).rollouts:
        raise ConfigError(f"{run}: replay recomputes RL steps; this is a {config.pipeline} run")
    with tempfile.TemporaryDirectory(prefix="reroll-replay-") as scratch:
        config = _scratch_config(config, scratch, start)
        replayed = Run(config)  # the step restored from `start`, as a resumed run's
        try:
            metrics = replayed.step.update(trajectories, step)
            metrics |= rollout_metrics(trajectories, config.rollout.group_size)
            replayed_weights = fingerprint(replayed.step.policy.state_dict_for_sync())
        finally:
            replayed.tracker.close()
            replayed.close()  # the reward runner or the agentic episodes, and the roles
    after = RunDir(run).checkpoint_dir(step)
    weights_match = (replayed_weights == _checkpoint_fingerprint(after, config.model.dtype)
                     if (after / "trainer_state.pt").is_file() else None)
    return compare(recorded, metrics, atol) | {
        "step": step, "run_dir": str(run), "from_checkpoint": str(start) if start else None,
        "overrides": list(overrides or []), "weights_match_checkpoint": weights_match}


def compare(recorded: dict[str, Any], replayed: dict[str, Any], atol: float) -> dict[str, Any]:
    """Per metric: recorded, replayed, |difference|; `matches` when every shared number agrees
    within `atol` + 1e-5 relative."""
    rows, worst, matches = {}, 0.0, True
    for key in sorted(replayed):
        if key.startswith(IGNORED_PREFIXES) or not _is_number(replayed[key]):
            continue
        new, old = float(replayed[key]), recorded.get(key)
        diff = abs(new - float(old)) if _is_number(old) else None
        rows[key] = {"recorded": old, "replayed": new, "abs_diff": diff}
        if diff is not None:
            worst = max(worst, diff)
            matches &= diff <= atol + 1e-5 * abs(float(old))
    return {"matches": matches, "max_abs_diff": worst, "metrics": rows}


def _recorded_metrics(run: Path, step: int) -> dict[str, Any]:
    path = run / "metrics.jsonl"
    rows = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines()
                                  if path.is_file() else [], start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}; a line cut short by a "
                              f"killed run? remove it)") from None
    merged: dict[str, Any] = {}
    for row in rows:
        if isinstance(row, dict) and row.get("step") == step:
            merged |= row
    return merged


def _start_checkpoint(run: Path, step: int) -> Path | None:
    if step == 1:
        return None
    from reroll.pipelines.common import RunDir

    found = dict(RunDir(run).checkpoints())
    if step - 1 not in found:
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise ConfigError(
            f"--step {step}: replay starts from checkpoints/step_{step - 1}, which is not in "
            f"{run / 'checkpoints'} (checkpoints kept: {have}). {_replayable_hint(run)} To replay "
            f"other steps, list the steps before them in checkpoint.keep_steps when training")
    return found[step - 1]


def replayable_steps(run: Path) -> list[int]:
    """Steps of `run` that replay can recompute: a recorded batch, and the checkpoint of the
    step before (or step 1, which starts from `model.path`)."""
    from reroll.pipelines.common import RunDir

    kept = {step for step, _ in RunDir(run).checkpoints()}
    steps = []
    for path in (run / "rollouts").glob("step_*.batch.pt"):
        step = path.name.removeprefix("step_").removesuffix(".batch.pt")
        if step.isdigit() and (int(step) == 1 or int(step) - 1 in kept):
            steps.append(int(step))
    return sorted(steps)


def _replayable_hint(run: Path) -> str:
    steps = replayable_steps(run)
    return (f"Steps that can be replayed: {', '.join(map(str, steps))}." if steps else
            "No step of this run can be replayed (no recorded batch with the checkpoint before it).")


def _scratch_config(config, scratch: str, start: Path | None):
    tracking = config.tracking.model_copy(update={
        "tensorboard": False, "wandb": False, "trackio": False, "progress": False,
        "record_rollouts": 0, "record_batch_every": 0})
    return config.model_copy(update={"output_dir": scratch, "tracking": tracking,
                                      "resume": str(start.resolve()) if start else False})


def _checkpoint_fingerprint(directory: Path, dtype: str) -> str:
    from reroll.engines.base import fingerprint
    from reroll.models.loading import load_model

    # Through the model class, so the names (tied weights included) are the live policy's.
    return fingerprint(load_model(str(directory), dtype).state_dict().items())


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- command line ---------------------------------------------------------------------------------


def configure_replay(p: argparse.ArgumentParser) -> None:
    """`reroll replay`'s arguments."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `reroll train`")
    p.add_argument("--step", type=int, required=True, help="the step to replay (1-based)")
    p.add_argument("--atol", type=float, default=1e-6,
                   help="absolute tolerance of the comparison (default 1e-6)")
    p.add_argument("overrides", nargs="*",
                   help="config changes to try on that step, e.g. algorithm.policy_loss.clip_high=0.4")
    p.set_defaults(fn=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    result = replay_step(args.run_dir, args.step, args.overrides, args.atol)
    table = Table(title=f"replay of step {args.step}"
                  + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    for column in ("metric", "recorded", "replayed", "|diff|"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key, row in result["metrics"].items():
        table.add_row(key, _fmt(row["recorded"]), _fmt(row["replayed"]), _fmt(row["abs_diff"]))
    console = Console()
    console.print(table)
    verdict = "reproduces the recorded step" if result["matches"] else "differs from the record"
    weights = {True: "; weights equal checkpoints/step_N", False: "; weights differ from "
               "checkpoints/step_N", None: ""}[result["weights_match_checkpoint"]]
    console.print(f"step {args.step} {verdict} (max |diff| {result['max_abs_diff']:.3g}){weights}")
    print(dumps(result))


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)

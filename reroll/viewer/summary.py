"""The headline figures of a run, shared by the text summary that `reroll view` prints and the
cards at the top of the report."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from reroll.config.pipelines import DEFAULT, KINDS
from reroll.viewer.rundata import RunData


@dataclass(frozen=True)
class Figure:
    """One headline figure: a label and its text (`—` when the run does not have it)."""

    label: str
    value: str
    hint: str = ""


def headline(run: RunData) -> list[Figure]:
    """Steps, the pipeline's training figure first/last (reward, NLL, preference accuracy), its
held-out figure start/end, wall time and status."""
    summary = run.summary or {}
    last_step = run.metrics[-1]["step"]
    steps = summary.get("steps", last_step)
    figures = [Figure("run", run.name, run.pipeline), Figure("steps", str(steps))]
    kind = KINDS.get(run.pipeline, DEFAULT)
    train_label, train_key, eval_label, eval_key = kind.headline
    figures += [_first_last(run, train_label, train_key),
                _start_end(run, eval_label, eval_key, *kind.summary)]
    if run.series("eval/success_rate"):  # agentic: the environment's own measure
        figures.append(_eval_start_end(run, "eval success rate", "eval/success_rate"))
    figures.append(_wall_time(run))
    status = "finished" if run.summary is not None else f"no summary.json (last step {last_step})"
    figures.append(Figure("status", status))
    return figures


def print_summary(run: RunData, report: Path, console: Console | None = None) -> None:
    """The headline figures as a small rich table, notes, then where the report was written
    (on a line of its own, never cut, so it can be copied)."""
    console = console or Console()
    table = Table(title=f"Run {run.path}", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for figure in headline(run):
        table.add_row(figure.label, figure.value + (f"  [dim]({figure.hint})[/]" if figure.hint else ""))
    console.print(table)
    for warning in run.warnings:
        console.print(f"[yellow]note:[/] {warning}", highlight=False, soft_wrap=True)
    console.print(f"report written to [bold]{report.resolve()}[/]", highlight=False, soft_wrap=True)


def fmt(value: Any) -> str:
    """A number to 4 significant figures (an integer as is); other values as text."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def _first_last(run: RunData, label: str, key: str) -> Figure:
    points = run.series(key)
    if not points:
        return Figure(label, "—")
    (first_step, first), (last_step, last) = points[0], points[-1]
    return Figure(label, f"{fmt(first)} → {fmt(last)}", f"steps {first_step} → {last_step}")


def _start_end(run: RunData, label: str, key: str, start_key: str, end_key: str) -> Figure:
    """From summary.json when the run finished (its start is measured before step 1), otherwise
    from the eval steps in metrics.jsonl."""
    summary = run.summary or {}
    points = run.series(key)
    start = summary.get(start_key, points[0][1] if points else None)
    end = summary.get(end_key, points[-1][1] if points else None)
    if start is None and end is None:
        return Figure(label, "—")
    hint = "summary.json" if start_key in summary else "eval steps in metrics.jsonl"
    return Figure(label, f"{fmt(start)} → {fmt(end)}", hint)


def _eval_start_end(run: RunData, label: str, key: str) -> Figure:
    """An evaluation metric from before step 1 (summary.json's `eval_start`; a run that has not
    finished: the first eval step) to the last eval step."""
    points = run.series(key)
    start = ((run.summary or {}).get("eval_start") or {}).get(key)
    hint = "summary.json, metrics.jsonl" if start is not None else \
        "eval steps in metrics.jsonl"
    return Figure(label, f"{fmt(points[0][1] if start is None else start)} → "
                         f"{fmt(points[-1][1])}", hint)


def _wall_time(run: RunData) -> Figure:
    seconds = (run.summary or {}).get("wall_time_s")
    hint = ""
    if not isinstance(seconds, int | float):
        step_times = run.series("time/step_s")
        if not step_times:
            return Figure("wall time", "—")
        seconds, hint = sum(v for _, v in step_times), "sum of time/step_s"
    return Figure("wall time", _duration(float(seconds)), hint)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"

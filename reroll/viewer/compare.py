"""`reroll view RUN RUN ...`: several runs in one report, each metric's curves overlaid.

Every run's series is renamed `NAME · metric` (NAME: the run's `name`, or its folder when two
runs share a name), and each chart of the single-run plan draws that metric for every run that
logged it, one colour per line and the legend naming the run; a metric only some runs logged has
only their lines. Headline cards, summaries and configs are shown per run; the rollout table
holds every run's rows, the run's name in front of each group.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.viewer.charts import plan_charts
from reroll.viewer.report import (
    PAGE,
    SCRIPTS,
    _card,
    _summary_table,
    _warnings,
    constant,
    embed_json,
    payload,
)
from reroll.viewer.rundata import RunData, load_run
from reroll.viewer.summary import headline

SEPARATOR = " \u00b7 "


def run_labels(runs: list[RunData]) -> list[str]:
    """One distinct label per run: its name, or its path where names repeat."""
    names = [run.name for run in runs]
    labels = [name if names.count(name) == 1 else str(run.path) for name, run in zip(names, runs, strict=True)]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"reroll view: the same run directory is given twice ({', '.join(labels)})")
    return labels


def compare_payload(runs: list[RunData]) -> dict[str, Any]:
    """The page data of several runs: renamed series, charts over every run, all rollouts."""
    labels = run_labels(runs)
    singles = [payload(run) for run in runs]
    series: dict[str, list] = {}
    for label, single in zip(labels, singles, strict=True):
        series |= {f"{label}{SEPARATOR}{key}": points for key, points in single["series"].items()}
    keys: list[str] = []
    non_finite: dict[str, list[int]] = {}
    for run in runs:
        keys += [k for k in run.numeric_keys() if k not in keys]
    charts = []
    for chart in plan_charts(keys):
        lines = [f"{label}{SEPARATOR}{key}" for key in chart.keys for label in labels
                 if f"{label}{SEPARATOR}{key}" in series]
        for label, run in zip(labels, runs, strict=True):
            for key in chart.keys:
                if key in run.non_finite:
                    non_finite[f"{label}{SEPARATOR}{key}"] = run.non_finite[key]
        chart.keys, chart.band = lines, None  # one band per run would hide the lines
        chart.non_finite = {k: non_finite[k] for k in lines if k in non_finite}
        charts.append(chart.as_json() | {"constant": constant(series, lines)})
    rollouts = [row | {"group_id": f"{label}/{row.get('group_id')}"}
                for label, single in zip(labels, singles, strict=True) for row in single["rollouts"]]
    return {"series": series, "charts": charts, "rollouts": rollouts}


def render_comparison(runs: list[RunData]) -> str:
    labels = run_labels(runs)
    assets = files("reroll.viewer") / "assets"
    title = f"{' vs '.join(labels)} \u2014 reroll runs compared"
    cards = "".join(_card(f"{label}: {f.label}", f.value, f.hint)
                    for label, run in zip(labels, runs, strict=True) for f in headline(run))
    summaries = "".join(f"<h3>{html.escape(label)}</h3>{_summary_table(run.summary)}"
                        for label, run in zip(labels, runs, strict=True))
    configs = "".join(f"<h3>{html.escape(label)}</h3><pre>{html.escape(run.config_text or '')}</pre>"
                      for label, run in zip(labels, runs, strict=True))
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return PAGE.format(
        title=html.escape(title),
        subtitle=html.escape(f"{len(runs)} runs \u00b7 report made {generated}"),
        css=(assets / "report.css").read_text(encoding="utf-8"),
        js="\n".join((assets / name).read_text(encoding="utf-8") for name in SCRIPTS),
        cards=cards, warnings=_warnings([f"{label}: {w}" for label, run in zip(labels, runs, strict=True)
                                         for w in run.warnings]),
        summary=summaries, config=configs, data=embed_json(compare_payload(runs)))


def write_comparison(run_dirs: list[str | Path], out: str | Path | None = None,
                     max_rollouts_per_step: int = 500) -> tuple[list[RunData], Path]:
    """Read every run directory and write their comparison to `out` (default: `compare.html`
    beside the first run directory)."""
    runs = [load_run(d, max_rollouts_per_step) for d in run_dirs]
    target = Path(out).expanduser() if out else runs[0].path.parent / "compare.html"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render_comparison(runs), encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{target}: cannot write the report ({e.strerror})") from None
    return runs, target

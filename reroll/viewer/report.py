"""The report: one self-contained HTML file (styles, script and data inline; nothing is fetched).

The static parts (headline, warnings, summary, config) are written here as HTML; the curves and
the rollout table are drawn in the browser by the scripts in `assets/` from the JSON embedded in
`<script id="run-data" type="application/json">`.
"""

from __future__ import annotations

import html
import json
import math
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.viewer.charts import plan_charts
from reroll.viewer.rundata import RunData, load_run
from reroll.viewer.summary import fmt, headline

GENERATOR = '<meta name="generator" content="reroll view">'
SCRIPTS = ("common.js", "charts.js", "table.js")
START_POINTS = {"eval/reward_mean": "eval_reward_start", "eval/nll": "eval_nll_start"}

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="reroll view">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header><h1>{title}</h1><div class="sub">{subtitle}</div></header>
<nav><a href="#overview">Overview</a><a href="#curves">Curves</a><a href="#rollouts">Rollouts</a>
<a href="#summary">Summary &amp; config</a></nav>
<main>
<section id="overview"><div class="cards">{cards}</div>{warnings}</section>
<section id="curves"><h2>Curves</h2>
<noscript><p class="empty">The curves and the rollout table need JavaScript.</p></noscript>
<div class="charts" id="charts"></div>
<details class="more" id="more"><summary>More metrics (<span id="more-count">0</span>)</summary>
<div class="charts" id="more-charts"></div></details>
<details class="more" id="constant"><summary><span id="constant-count">0</span> constant metrics
(the same value at every step)</summary><div class="charts" id="constant-charts"></div></details>
</section>
<section id="rollouts"><h2>Rollouts</h2>
<p class="empty" id="rollout-none" hidden>No rollouts were recorded
(set <code>tracking.record_rollouts</code> to record some).</p>
<div id="rollout-ui">
<div class="filters">
<label>Step<select id="f-step"><option value="all">all steps</option></select></label>
<label>Samples<select id="f-split"><option value="all">training and held-out</option>
<option value="train">training rollouts</option><option value="eval">held-out (eval)</option></select></label>
<label>Search (all words)<input id="f-text" type="search" placeholder="prompt, response, answer, reward info"></label>
<label>Reward &ge;<input id="f-min" type="number" step="any"></label>
<label>Reward &le;<input id="f-max" type="number" step="any"></label>
<label>Finish reason<select id="f-finish"><option value="all">any</option></select></label>
<button id="f-clear" type="button">Clear</button>
</div>
<div class="following" id="following" hidden>Following one prompt across steps:
<q id="following-prompt"></q> <button id="follow-clear" type="button">Stop following</button></div>
<div class="count" id="rollout-count"></div>
<div class="table-wrap"><table class="rollouts"><thead><tr>
<th class="sortable" data-key="step">Step</th><th class="sortable" data-key="group_id">Group</th>
<th class="sortable" data-key="reward">Reward</th><th class="sortable" data-key="finish_reason">Finish</th>
<th>Prompt</th><th>Response</th><th>Answer</th><th>Reward info</th>
</tr></thead><tbody id="rollout-body"></tbody></table></div>
<p><button class="more-rows" id="more-rows" type="button" hidden>Show more</button></p>
</div>
</section>
<section id="summary" class="two">
<div><h2>Summary</h2>{summary}</div>
<div><h2>Resolved config</h2>{config}</div>
</section>
</main>
<script id="run-data" type="application/json">{data}</script>
<script>
(function () {{
"use strict";
const data = JSON.parse(document.getElementById("run-data").textContent);
{js}
renderCharts();
renderTable();
document.body.dataset.ready = "1";
}})();
</script>
</body>
</html>
"""


def render_report(run: RunData) -> str:
    """The report of `run` as a complete HTML document."""
    title = f"{run.name} \u2014 reroll run report"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    assets = files("reroll.viewer") / "assets"
    return PAGE.format(
        title=html.escape(title),
        subtitle=html.escape(f"{run.path.resolve()} \u00b7 {run.pipeline} \u00b7 report made {generated}"),
        css=(assets / "report.css").read_text(encoding="utf-8"),
        js="\n".join((assets / name).read_text(encoding="utf-8") for name in SCRIPTS),
        cards="".join(_card(f.label, f.value, f.hint) for f in headline(run)),
        warnings=_warnings(run.warnings),
        summary=_summary_table(run.summary),
        config=(f"<pre>{html.escape(run.config_text)}</pre>" if run.config_text is not None
                else '<p class="empty">config.yaml is missing</p>'),
        data=embed_json(payload(run)),
    )


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 max_rollouts_per_step: int = 500, reload_s: float | None = None
                 ) -> tuple[RunData, Path]:
    """Read `run_dir`, write its report to `out` (default `run_dir/report.html`); with
    `reload_s`, a page that reloads itself that often (`reroll view --watch`). The file is
    replaced whole, so a page reloaded while it is rewritten is never half a page."""
    run = load_run(run_dir, max_rollouts_per_step)
    target = Path(out).expanduser() if out else run.path / "report.html"
    text = render_report(run)
    if reload_s is not None:
        text = text.replace(GENERATOR, f'{GENERATOR}\n<meta http-equiv="refresh" '
                                       f'content="{max(1, round(reload_s))}">', 1)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(target)
    except OSError as e:
        raise ConfigError(f"{target}: cannot write the report ({e.strerror})") from None
    return run, target


def payload(run: RunData) -> dict[str, Any]:
    """The data the page's scripts draw: series per metric, chart plan, and flat rollouts."""
    keys = run.numeric_keys()
    series: dict[str, list[list[Any]]] = {}
    for key in keys:
        series[key] = [[row["step"], row[key] if row.get(key) is not None else None]
                       for row in run.metrics if key in row]
    summary = run.summary or {}
    starts = {key: summary.get(start_key) for key, start_key in START_POINTS.items()}
    starts |= summary.get("eval_start") or {}  # an RL run's whole start evaluation
    for key, start in starts.items():  # measured before step 1: drawn at step 0
        if key in series and _finite(start) and not any(s == 0 for s, _ in series[key]):
            series[key].insert(0, [0, float(start)])
    rollouts = [{"step": step, "split": split, **row}
                for split, by_step in (("train", run.rollouts), ("eval", run.eval_rollouts))
                for step, rows in sorted(by_step.items()) for row in rows]
    charts = [c.as_json() | {"constant": constant(series, c.keys)}
              for c in plan_charts(keys, run.non_finite)]
    return {"series": series, "charts": charts, "rollouts": rollouts,
            "specialTokens": special_tokens(run)}


def special_tokens(run: RunData) -> list[str]:
    """The special tokens of the run's tokenizer (its `model.path`'s tokenizer.json, when it
    can be read from here), which the page marks in the text; the page also marks any
    `<|...|>` token."""
    model = (run.config.get("model") or {}).get("path") if isinstance(run.config, dict) else None
    try:
        added = json.loads((Path(str(model)) / "tokenizer.json").read_text())["added_tokens"]
        return sorted({t["content"] for t in added if t.get("special") and t.get("content")})
    except (OSError, ValueError, KeyError, TypeError):
        return []


def constant(series: dict[str, list[list[Any]]], keys: list[str]) -> bool:
    """Whether every metric of a chart holds one value at every step (a fixed learning rate,
    a filter that never fires): such charts fold away under "constant metrics"."""
    values = [v for key in keys for _, v in series.get(key, [])]
    return len(values) > 1 and None not in values and all(v == values[0] for v in values)


def embed_json(value: Any) -> str:
    """JSON that is safe inside a <script> element: no '</script>', '<!--' or stray '&'."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _card(label: str, value: str, hint: str) -> str:
    hint_html = f'<div class="hint">{html.escape(hint)}</div>' if hint else ""
    return (f'<div class="card" data-label="{html.escape(label)}"><div class="label">'
            f'{html.escape(label)}</div><div class="value">{html.escape(value)}</div>{hint_html}</div>')


def _warnings(warnings: list[str]) -> str:
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f'<div class="warnings" id="warnings"><b>Notes on this run directory</b><ul>{items}</ul></div>'


def _summary_table(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return '<p class="empty">summary.json is missing (the run has not finished)</p>'
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_value(v))}</td></tr>"
                   for k, v in summary.items())
    return f'<table class="kv" id="summary-table">{rows}</table>'


def _value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return fmt(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

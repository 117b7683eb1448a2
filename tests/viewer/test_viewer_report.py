"""The HTML report and the `view` subcommand, without a browser."""

from __future__ import annotations

import argparse
import json
import re
from html.parser import HTMLParser

import pytest

from reroll.cli import build_parser
from reroll.config.errors import ConfigError
from reroll.viewer import cmd_view, load_run, render_report, write_report
from reroll.viewer.charts import plan_charts
from reroll.viewer.report import embed_json, payload

pytestmark = pytest.mark.unit


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text of each <script>."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag):
        self._in_script = False if tag == "script" else self._in_script

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def parse(html: str) -> Tags:
    tags = Tags()
    tags.feed(html)
    return tags


def cli(argv: list[str]) -> argparse.Namespace:
    return build_parser(only=["view"]).parse_args(argv)


def test_the_report_is_self_contained(run_dir):
    html = render_report(load_run(run_dir))
    tags = parse(html)
    remote = re.compile(r"^\s*(https?:|//|ftp:)", re.I)
    for tag, attrs in tags.tags:
        for name in ("src", "href", "srcset", "data", "action", "poster"):
            assert not remote.match(attrs.get(name) or ""), f"<{tag} {name}={attrs[name]!r}>"
        assert not (tag == "script" and "src" in attrs), "scripts must be inline"
        assert not (tag == "link" and attrs.get("rel") == "stylesheet"), "styles must be inline"
    hrefs = [a["href"] for t, a in tags.tags if "href" in a]
    assert hrefs and all(h.startswith("#") for h in hrefs)  # only in-page anchors
    assert "@import" not in html and "url(" not in html
    assert not re.search(r"\bfetch\(|XMLHttpRequest|import\(", html)
    assert "http://" not in html and "https://" not in html
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")


def test_the_embedded_data_is_the_payload_and_cannot_break_out_of_its_script(run_dir):
    run = load_run(run_dir)
    html = render_report(run)
    tags = parse(html)
    scripts = [attrs for tag, attrs in tags.tags if tag == "script"]
    data_tags = [i for i, attrs in enumerate(scripts) if attrs.get("type") == "application/json"]
    assert len(data_tags) == 1
    embedded = json.loads(tags.scripts[data_tags[0]])
    assert embedded == json.loads(json.dumps(payload(run)))
    # A response holds '</script><b>x</b>': it stays data, escaped in the page's source.
    assert "</script><b>" not in html and "\\u003c/script\\u003e" in html
    assert embedded["rollouts"][0]["response"].endswith("</script><b>x</b>")
    assert html.count("<script") == 2


def test_payload_series_charts_and_rollouts(run_dir, spec):
    data = payload(load_run(run_dir))
    reward = data["series"]["train/reward_mean"]
    assert [s for s, _ in reward] == list(range(1, spec["steps"] + 1))
    eval_points = data["series"]["eval/reward_mean"]
    assert eval_points[0] == [0, 0.15]  # the start eval from summary.json, drawn at step 0
    assert len(eval_points) == 1 + spec["steps"] // spec["eval_every"]
    assert [spec["non_finite_step"], None] in data["series"]["train/grad_norm"]
    assert data["charts"][0]["id"] == "reward" and data["charts"][0]["band"] == [
        "train/reward_mean", "train/reward_std"]
    assert len(data["rollouts"]) == len(spec["rollout_steps"]) * spec["rows_per_step"]
    assert [r["step"] for r in data["rollouts"][:: spec["rows_per_step"]]] == list(spec["rollout_steps"])


def test_embed_json_escapes_markup_and_rejects_nan():
    text = embed_json({"a": "</script><!-- & -->", "b": "\u2028\x00"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"a": "</script><!-- & -->", "b": "\u2028\x00"}
    with pytest.raises(ValueError):
        embed_json({"x": float("nan")})


def test_static_sections_show_headline_summary_and_escaped_config(run_dir):
    (run_dir / "summary.json").write_text(json.dumps(
        {"steps": 30, "eval_reward_start": 0.15, "eval_reward_end": 0.8, "wall_time_s": 61.5,
         "note": "<b>bold</b>", "nested": {"a": 1}}))
    html = render_report(load_run(run_dir))
    assert '<div class="card" data-label="eval reward">' in html and "0.15 → 0.8" in html
    assert "&lt;b&gt;bold&lt;/b&gt;" in html and "<b>bold</b>" not in html
    assert "{&quot;a&quot;: 1}" in html
    assert "path: models/tiny  # &lt;not a tag&gt;" in html
    assert 'id="warnings"' not in html


def test_notes_and_missing_files_are_shown(run_dir):
    (run_dir / "summary.json").unlink()
    (run_dir / "config.yaml").unlink()
    html = render_report(load_run(run_dir))
    assert 'id="warnings"' in html and "summary.json is missing" in html
    assert "config.yaml is missing" in html


def test_a_run_without_rollouts_still_renders(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/reward_mean": 0.5, "time/step_s": 1}\n')
    run, path = write_report(tmp_path)
    assert path == tmp_path / "report.html" and path.is_file()
    assert payload(run)["rollouts"] == []


def test_cmd_view_writes_the_report_and_prints_the_summary(run_dir, capsys):
    cmd_view(cli(["view", str(run_dir)]))
    report = run_dir / "report.html"
    assert report.is_file() and 'id="run-data"' in report.read_text()
    out = capsys.readouterr().out
    for text in ("steps", "30", "train reward", "eval reward", "0.15 → 0.8", "wall time",
                 "1 min 02 s", "report"):
        assert text in out, text
    assert "report.html" in out.replace("\n", "").replace(" ", "").replace("│", "")


def test_cmd_view_out_option(run_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere" / "r.html"
    args = cli(["view", str(run_dir), "--out", str(target)])
    assert args.fn is cmd_view
    cmd_view(args)
    assert target.is_file() and not (run_dir / "report.html").exists()


def test_cmd_view_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope'}: no such run directory"):
        cmd_view(cli(["view", str(tmp_path / "nope")]))
    with pytest.raises(ConfigError, match="metrics.jsonl: not found"):
        cmd_view(cli(["view", str(tmp_path)]))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="--max-rollouts-per-step 0"):
        cmd_view(cli(["view", str(tmp_path), "--max-rollouts-per-step", "0"]))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(ConfigError, match="cannot write the report"):
        cmd_view(cli(["view", str(tmp_path), "--out", str(blocker / "r.html")]))


def test_constant_charts_fold_and_the_reward_band_is_clipped_to_the_rewards_range(tmp_path):
    from reroll.viewer.report import constant

    series = {"train/lr": [[1, 0.1], [2, 0.1]], "train/loss": [[1, 0.5], [2, 0.4]]}
    assert constant(series, ["train/lr"]) and not constant(series, ["train/loss", "train/lr"])
    assert not constant({"x": [[1, 1.0], [2, None]]}, ["x"])  # a non-finite step is news
    keys = ["train/reward_mean", "train/reward_std", "train/reward_min", "train/reward_max"]
    reward = plan_charts(keys)[0].as_json()
    assert reward["keys"] == ["train/reward_mean"]  # min/max only bound the band
    assert reward["bandRange"] == ["train/reward_min", "train/reward_max"]


def test_every_metric_of_the_start_evaluation_is_drawn_at_step_0(tmp_path):
    """An RL run evaluates before step 1; metrics.jsonl starts at step 1, so the summary's
    `eval_start` holds that evaluation (an agentic run's true success rate beside the learned
    reward's score)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 5, "eval/reward_mean": 4.7, "eval/success_rate": 0.6}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"eval_reward_start": -1.3, "eval_start": {"eval/reward_mean": -1.3,
                                                   "eval/success_rate": 0.3}}))
    series = payload(load_run(tmp_path))["series"]
    assert series["eval/success_rate"] == [[0, 0.3], [5, 0.6]]
    assert series["eval/reward_mean"] == [[0, -1.3], [5, 4.7]]


def test_each_reward_functions_score_is_a_metric_drawn_in_one_chart(tmp_path):
    """Several summed reward functions (`reroll.train(reward_funcs=[...])`) kept each one's score
    in the rollouts' `reward_info["rewards"]` only: no curve showed which of them moved."""
    from reroll.data.batch import Trajectory
    from reroll.rollout.metrics import rollout_metrics

    def sample(correct: float, short: float, bonus: float | None) -> Trajectory:
        scores = {"task:correct": correct, "task:<lambda>": short}
        if bonus is not None:
            scores["other:<lambda>"] = bonus
        return Trajectory([1], [2], [0.0], "stop", 0, reward=correct + short,
                          reward_info={"rewards": scores})

    rows = []
    for step in (1, 2):
        trajectories = [sample(step - 1.0, 0.5, 1.0), sample(1.0, 0.25 * step, None),
                        Trajectory([1], [2], [0.0], "stop", 0, reward_info={"error": "x"})]
        metrics = rollout_metrics(trajectories, group_size=3)
        rows.append({"step": step} | metrics)
    assert rows[0]["train/rewards/correct"] == 0.5 and rows[1]["train/rewards/correct"] == 1.0
    assert rows[0]["train/rewards/lambda_1"] == 0.375 and rows[0]["train/rewards/lambda_2"] == 1.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    charts = {c["id"]: c for c in payload(load_run(tmp_path))["charts"]}
    assert charts["reward-functions"]["keys"] == [
        "train/rewards/correct", "train/rewards/lambda_1", "train/rewards/lambda_2"]
    assert charts["reward-functions"]["title"] == "Reward by function"


def shown_steps(report) -> tuple[int, bool]:
    """(steps in the report's reward series, whether the page reloads itself); (0, False) while
    there is no report."""
    try:
        text = report.read_text()
    except OSError:
        return 0, False
    data = re.search(r'<script id="run-data" type="application/json">(.*?)</script>', text, re.S)
    series = json.loads(data.group(1))["series"].get("train/reward_mean", [])
    return len(series), 'http-equiv="refresh" content="1"' in text


def test_watch_rewrites_the_report_while_the_run_grows_until_it_finishes(tmp_path, capsys):
    """The report was written once; a running run's page went stale. A writer thread plays the
    run: each step is appended only after the report has shown the one before."""
    import threading
    import time

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("pipeline: rlvr\nname: live\nsteps: 3\nmodel: {path: m}\n")

    def append(step):
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "train/reward_mean": step / 10}) + "\n")

    seen, report = [], run / "report.html"

    def play():
        deadline = time.monotonic() + 60
        for step in (1, 2, 3):
            append(step)
            while shown_steps(report)[0] < step and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.append(shown_steps(report))
        (run / "summary.json").write_text(json.dumps({"steps": 3}))

    writer = threading.Thread(target=play)
    writer.start()
    cmd_view(cli(["view", str(run), "--watch", "0.05"]))
    writer.join()
    assert seen == [(1, True), (2, True), (3, True)]  # each step shown while it ran
    assert shown_steps(report) == (3, False)  # finished: the last page stays put
    out = capsys.readouterr().out
    assert "rewritten every 0.05 s until the run finishes" in out and "live" in out


def test_watch_waits_while_the_metrics_file_is_still_empty(tmp_path, capsys):
    """A run creates metrics.jsonl before it writes its first row: `--watch` read the empty file
    as a broken run ("holds no steps yet") and stopped, where it should wait for the row."""
    import threading
    import time

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("pipeline: rlvr\nname: live\nsteps: 1\nmodel: {path: m}\n")
    (run / "metrics.jsonl").write_text("")

    def play():
        time.sleep(0.3)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/reward_mean": 0.5}) + "\n")
        (run / "summary.json").write_text(json.dumps({"steps": 1}))

    writer = threading.Thread(target=play)
    writer.start()
    cmd_view(cli(["view", str(run), "--watch", "0.05"]))
    writer.join()
    assert shown_steps(run / "report.html")[0] == 1
    assert "no steps in metrics.jsonl yet" in capsys.readouterr().out


def test_watch_needs_one_run_and_a_positive_interval(tmp_path, run_dir):
    for argv in (["view", str(run_dir), "--watch", "0"],
                 ["view", str(run_dir), str(run_dir), "--watch", "5"]):
        with pytest.raises(ConfigError, match="--watch"):
            cmd_view(cli(argv))

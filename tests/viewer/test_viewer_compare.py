"""`reroll view RUN RUN`: several runs' curves overlaid in one report."""

from __future__ import annotations

import json

import pytest
import yaml

from reroll.cli import build_parser
from reroll.config.errors import ConfigError
from reroll.viewer.command import cmd_view
from reroll.viewer.compare import compare_payload
from reroll.viewer.rundata import load_run

pytestmark = pytest.mark.unit


def named_run(write_run, root, name: str, drop: str | None = None, scale: float = 1.0):
    path = write_run(root / name)
    config = yaml.safe_load((path / "config.yaml").read_text()) | {"name": name}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop(drop, None)
        if isinstance(row.get("train/reward_mean"), float):
            row["train/reward_mean"] *= scale
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_chart_per_metric_with_a_line_per_run(tmp_path, make_run):
    a = named_run(make_run, tmp_path, "grpo")
    b = named_run(make_run, tmp_path, "dapo", drop="train/grad_norm", scale=0.5)
    data = compare_payload([load_run(a), load_run(b)])
    reward = next(c for c in data["charts"] if c["id"] == "reward")
    assert "grpo · train/reward_mean" in reward["keys"] and "dapo · train/reward_mean" in reward["keys"]
    assert reward["band"] is None
    first = dict(data["series"]["grpo · train/reward_mean"])[3]
    assert dict(data["series"]["dapo · train/reward_mean"])[3] == pytest.approx(first * 0.5)
    grad = next(c for c in data["charts"] if c["id"] == "grad")
    assert grad["keys"] == ["grpo · train/grad_norm"]  # only the run that logged it
    assert set(grad["nonFinite"]) <= set(grad["keys"])
    groups = {r["group_id"].split("/")[0] for r in data["rollouts"]}
    assert groups == {"grpo", "dapo"}


def test_the_cli_writes_one_comparison_and_refuses_a_run_given_twice(tmp_path, capsys, make_run):
    a, b = named_run(make_run, tmp_path, "grpo"), named_run(make_run, tmp_path, "dapo")
    cmd_view(build_parser().parse_args(["view", str(a), str(b)]))
    page = (tmp_path / "compare.html").read_text()
    assert "grpo vs dapo" in page and "dapo \\u00b7 train/reward_mean" in page  # embedded JSON
    assert "compare.html" in capsys.readouterr().out.replace("\n", "").replace(" ", "")
    with pytest.raises(ConfigError, match="twice"):
        cmd_view(build_parser().parse_args(["view", str(a), str(a), "--out",
                                            str(tmp_path / "x.html")]))

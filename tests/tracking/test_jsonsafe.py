"""Every JSON file the project writes is strict JSON: NaN and +-inf are written as null, never as
the bare `NaN`/`Infinity` other readers reject."""

from __future__ import annotations

import json
import math

import pytest
import torch

from reroll.pipelines.common import RunDir
from reroll.tracking.jsonsafe import dumps, finite_or_none
from reroll.tracking.tracker import JsonlSink

pytestmark = pytest.mark.unit


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"bare {name} in JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    value = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, torch.tensor(math.nan)),
             "e": "nan", "f": 3}
    assert finite_or_none(value) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, None],
                                     "e": "nan", "f": 3}
    assert strict_loads(dumps(value))["b"] == [1.0, None, {"c": None}]


def test_metrics_jsonl_and_summary_are_strict_json(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"train/loss": math.nan, "train/grad_norm": math.inf, "train/reward_mean": 0.5,
                 "train/lr": torch.tensor(1e-3)})
    sink.close()
    row = strict_loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 1, "train/loss": None, "train/grad_norm": None,
                   "train/reward_mean": 0.5, "train/lr": pytest.approx(1e-3)}
    path = RunDir(tmp_path).write_summary({"eval_reward_end": math.nan, "steps": 2})
    assert strict_loads(path.read_text()) == {"eval_reward_end": None, "steps": 2}

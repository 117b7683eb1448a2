"""Agentic rows' `segments` become the table's turns; staleness metrics get their chart."""

import pytest

from reroll.viewer.charts import plan_charts
from reroll.viewer.rundata import policy_turns, segments_to_turns

pytestmark = pytest.mark.unit


def test_segments_join_into_alternating_turns():
    turns = segments_to_turns([
        {"text": "a", "policy": True, "turn": 0}, {"text": "b", "policy": True, "turn": 0},
        {"text": "obs", "policy": False, "turn": 0}, {"text": "c", "policy": True, "turn": 1},
        "not a segment", {"text": None, "policy": False, "turn": 1}])
    assert turns == [{"role": "policy", "text": "ab", "turn": 0},
                     {"role": "env", "text": "obs", "turn": 0},
                     {"role": "policy", "text": "c", "turn": 1},
                     {"role": "env", "text": "", "turn": 1}]


def test_async_staleness_and_step_time_are_charted():
    charts = {c.id: c for c in plan_charts(["train/reward_mean", "async/staleness_mean",
                                            "async/staleness_max", "time/step_s"])}
    assert charts["staleness"].keys == ["async/staleness_mean", "async/staleness_max"]
    assert charts["time"].keys == ["time/step_s"]


def test_the_turn_badge_counts_the_policy_turns_not_the_text_pieces():
    """Two policy turns with the env's replies are four pieces of text: the badge said 4."""
    turns = segments_to_turns([
        {"text": "guess 4", "policy": True, "turn": 0}, {"text": "higher", "policy": False, "turn": 0},
        {"text": "guess 6", "policy": True, "turn": 1}, {"text": "correct", "policy": False, "turn": 1}])
    assert len(turns) == 4
    assert policy_turns(turns) == 2
    assert policy_turns([{"role": "policy", "text": "a"}, {"role": "env", "text": "b"}]) == 1

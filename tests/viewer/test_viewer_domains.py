"""A multi-domain run's report: one chart per per-domain metric, a curve per domain."""

import pytest

from reroll.viewer.charts import plan_charts

pytestmark = pytest.mark.unit


def test_domain_metrics_get_charts_with_a_curve_per_domain():
    keys = ["train/reward_mean", "eval/reward_mean"]
    for d in ("math", "rules"):
        keys += [f"train/{d}/reward_mean", f"eval/{d}/reward_mean", f"train/{d}/pass_rate",
                 f"train/{d}/share", f"time/{d}/rollout_s"]
    charts = {c.id: c for c in plan_charts(keys)}
    assert list(charts)[0] == "reward" and charts["reward"].keys == ["train/reward_mean",
                                                                     "eval/reward_mean"]
    assert charts["domain-reward"].keys == ["train/math/reward_mean", "train/rules/reward_mean",
                                            "eval/math/reward_mean", "eval/rules/reward_mean"]
    assert charts["domain-pass"].keys == ["train/math/pass_rate", "train/rules/pass_rate"]
    assert charts["domain-share"].keys == ["train/math/share", "train/rules/share"]
    assert "time/math/rollout_s" in charts["time"].keys
    assert not any(c.extra for c in charts.values())  # nothing left to "More metrics"


def test_a_run_without_domains_has_no_domain_chart():
    assert not any(c.id.startswith("domain-") for c in plan_charts(["train/reward_mean"]))

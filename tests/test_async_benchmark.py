"""The async benchmark's headline is taken at equal work: hand-made runs through `headline`."""

import pytest
from scripts import load_script

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/async_vs_sync.py", importable_dir=True)


def run(loop_s, tokens, reward, rollout_s=1.0, train_s=0.5, prompts=(("a", "b"), ("c", "d"))):
    return {"train_loop_s": loop_s, "trained_tokens": tokens, "eval_end": reward,
            "rollout_s": rollout_s, "train_s": train_s, "prompts": [list(p) for p in prompts]}


def test_the_headline_is_the_run_that_trains_on_syncs_prompts(bench):
    sync = run(30.0, 1000, 0.20, rollout_s=0.6, train_s=0.4)
    short_kept = run(10.0, 400, 0.15)       # fast, on 40% of sync's tokens
    long_kept = run(20.0, 950, 0.26)        # 1.5x on 95% of them
    report = bench.headline(sync, short_kept, long_kept)
    assert report["speedup"] == 1.5 and report["trained_tokens_ratio"] == 0.95
    assert report["same_prompts"]
    assert report["same_tokens"] and report["same_eval_reward"]
    assert report["speedup_short_kept"] == 3.0 and report["trained_tokens_ratio_short_kept"] == 0.4
    assert report["bound"] == pytest.approx(1.0 / 0.6, abs=1e-3)  # (0.6 + 0.4) / max(0.6, 0.4)


def test_fewer_tokens_or_another_reward_is_not_equal_work(bench):
    sync = run(30.0, 1000, 0.20)
    reordered = run(15.0, 850, 0.30, prompts=(("a", "c"), ("b", "d")))
    report = bench.headline(sync, run(10.0, 400, 0.20), reordered)
    assert not report["same_tokens"] and not report["same_eval_reward"]  # 0.85 < 0.9; 0.10 > 0.08
    assert not report["same_prompts"]


def test_balanced_steps_bound_at_two(bench):
    assert bench.bound(run(1, 1, 0, rollout_s=0.5, train_s=0.5)) == 2.0
    assert bench.bound(run(1, 1, 0, rollout_s=1.0, train_s=0.2)) == pytest.approx(1.2)


def test_sync_on_two_threads_is_a_secondary_figure(bench):
    long_kept = run(20.0, 950, 0.26)
    assert bench.sync_2_threads(None, long_kept) == {}
    report = bench.sync_2_threads(run(28.0, 1000, 0.20, rollout_s=0.5, train_s=0.4), long_kept)
    assert report["speedup_vs_sync_2_threads"] == 1.4
    assert report["bound_sync_2_threads"] == pytest.approx(1.8)  # (0.5 + 0.4) / 0.5

"""The credit benchmark's summary: before/after per seed, and a mean curve over the steps every
seed evaluated (hand-made curves through `summarize`)."""


import pytest
from scripts import load_script

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/credit.py")


def test_the_summary_takes_the_first_and_last_evaluation_and_averages_common_steps(bench):
    curves = {"grpo": {0: {0: 0.0, 4: 0.25, 8: 0.5}, 1: {0: 0.0, 4: 0.5, 8: 1.0}},
              # seed 1 lacks step 4 (a run whose eval was skipped): its mean is left out
              "gigpo": {0: {0: 0.25, 4: 0.5, 8: 0.5}, 1: {0: 0.25, 8: 0.0}}}
    summary = bench.summarize(curves)
    assert summary["grpo"]["before"] == {0: 0.0, 1: 0.0}
    assert summary["grpo"]["after"] == {0: 0.5, 1: 1.0}
    assert summary["grpo"]["mean_after"] == 0.75
    assert summary["grpo"]["mean_curve"] == {0: 0.0, 4: 0.375, 8: 0.75}
    assert summary["gigpo"]["mean_curve"] == {0: 0.25, 8: 0.25}
    assert summary["gigpo"]["mean_before"] == 0.25 and summary["gigpo"]["mean_after"] == 0.25


def test_every_method_differs_only_in_its_credit(bench):
    # equal work across arms: the methods' algorithm sections name an estimator and the loss
    # it needs, nothing else (steps, batch, lr, eval come from the same arguments)
    assert set(bench.METHODS) == {"grpo", "gigpo", "ipa_chunk"}
    for section in bench.METHODS.values():
        assert set(section) == {"advantage", "policy_loss"}
    assert bench.METHODS["ipa_chunk"]["policy_loss"]["name"] == "ipa_chunk"


def test_a_rerun_reuses_only_a_finished_run_with_the_same_settings(bench, tmp_path):
    # growing --seeds into the same --out trains only the new seeds; a changed setting retrains
    config = {"seed": 0, "steps": 20, "optimizer": {"lr": 3e-4},
              "env": {"kwargs": {"size": 5}}, "output_dir": str(tmp_path)}
    assert bench.finished(tmp_path, config) is None  # nothing there yet
    (tmp_path / "config.yaml").write_text(
        "seed: 0\nsteps: 20\noptimizer: {lr: 0.0003, betas: [0.9, 0.999]}\n"
        f"env: {{kwargs: {{size: 5}}, max_turns: 8}}\noutput_dir: {tmp_path}\n")
    assert bench.finished(tmp_path, config) is None  # a run that did not finish
    (tmp_path / "summary.json").write_text('{"eval_reward_start": 0.25}')
    assert bench.finished(tmp_path, config) == {"eval_reward_start": 0.25}
    assert bench.finished(tmp_path, {**config, "optimizer": {"lr": 1e-3}}) is None
    assert bench.finished(tmp_path, {**config, "steps": 12}) is None

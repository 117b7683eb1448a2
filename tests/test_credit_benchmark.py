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

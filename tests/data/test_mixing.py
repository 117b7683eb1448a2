"""The domain mixer: each domain's share of the prompts matches its weight, over steps and when
resumed; adaptive weights favour the domain with more to learn."""

import pytest

from reroll.data.mixing import DomainMixer, apportion


def test_apportion_sums_to_n_by_largest_remainder():
    assert apportion([1.5, 2.5], 4) == [2, 2]  # equal remainders: the earlier domain first
    assert apportion([0.4, 1.1, 2.5], 4) == [0, 1, 3]  # floors 0,1,2; .5 is the largest rest
    assert apportion([3.0, 1.0], 4) == [3, 1]


@pytest.mark.parametrize(("weights", "n"), [([1, 2], 4), ([1, 1, 1], 4), ([0.2, 0.8], 3),
                                            ([5, 1], 16)])
def test_cumulative_counts_stay_within_one_of_the_weighted_share(weights, n):
    mixer = DomainMixer(weights)
    total = [0] * len(weights)
    for step in range(1, 51):
        counts = mixer.counts(n)
        assert sum(counts) == n
        total = [t + c for t, c in zip(total, counts, strict=True)]
        for t, w in zip(total, weights, strict=True):
            assert abs(t - step * n * w / sum(weights)) < 1.0 + 1e-9


def test_one_to_two_over_four_prompts_by_hand():
    # quotas 4/3, 8/3 -> 1, 3 (credit 1/3, -1/3); 5/3, 7/3 -> 2, 2; 1, 3 -> 1, 3; and again
    mixer = DomainMixer([1, 2])
    assert [mixer.counts(4) for _ in range(6)] == [[1, 3], [2, 2], [1, 3]] * 2
    mixer = DomainMixer([1, 2])
    assert [mixer.counts(3) for _ in range(3)] == [[1, 2]] * 3


def test_state_round_trip_gives_the_same_counts():
    a = DomainMixer([1, 3], "mean_reward")
    for _ in range(3):
        a.counts(5)
        a.observe(0, 0.9)
    b = DomainMixer([1, 3], "mean_reward")
    b.load_state_dict(a.state_dict())
    assert [a.counts(5) for _ in range(6)] == [b.counts(5) for _ in range(6)]


def test_mean_reward_weighting_favours_the_domain_left_to_learn():
    mixer = DomainMixer([1, 1], "mean_reward", floor=0.1, momentum=0.0)
    assert mixer.shares() == [0.5, 0.5]
    mixer.observe(0, 1.0)  # solved: its factor is the floor
    mixer.observe(1, 0.5)
    shares = mixer.shares()
    assert shares[0] == pytest.approx(0.1 / 0.6) and shares[1] == pytest.approx(0.5 / 0.6)

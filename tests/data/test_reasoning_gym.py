"""reasoning-gym domains: rows generated reproducibly, scored by the library's own
`score_answer`, and an unknown task refused with the close names."""

import asyncio

import pytest

from reroll.config.domains import ReasoningGymSource
from reroll.config.errors import ConfigError
from reroll.data.reasoning_gym import generate_rows
from reroll.rewards.base import RewardSample
from reroll.rewards.reasoning_gym import ReasoningGymReward, extract


def test_rows_are_reproducible_and_eval_is_another_stream():
    spec = ReasoningGymSource(task="basic_arithmetic", size=5, seed=3, eval_size=4)
    train = generate_rows(spec, "train", "data.domains[0].reasoning_gym")
    again = generate_rows(spec, "train", "data.domains[0].reasoning_gym")
    held_out = generate_rows(spec, "eval", "data.domains[0].reasoning_gym")
    assert [r.messages for r in train] == [r.messages for r in again] and len(train) == 5
    assert len(held_out) == 4 and held_out[0].metadata["reasoning_gym"]["seed"] != 3
    assert train[0].prompt_text.endswith("<answer></answer>.")
    assert train[2].source == "reasoning_gym:basic_arithmetic[train 2]"


def test_the_library_scores_the_right_answer_one_and_a_wrong_one_zero():
    spec = ReasoningGymSource(task="basic_arithmetic", size=3, seed=0, eval_size=2)
    reward = ReasoningGymReward(spec.task, spec.size, spec.eval_size, spec.seed, spec.config)
    for split in ("train", "eval"):
        row = generate_rows(spec, split, "x")[1]
        right = RewardSample(row.prompt_text, f"so <answer>{row.answer}</answer>",
                             metadata=row.metadata)
        wrong = RewardSample(row.prompt_text, "<answer>banana</answer>", metadata=row.metadata)
        none = RewardSample(row.prompt_text, row.answer, metadata=row.metadata)
        assert asyncio.run(reward(right)).score == 1.0
        assert asyncio.run(reward(wrong)).score == 0.0
        assert asyncio.run(reward(none)).score == 0.0  # no <answer> tag


def test_extract():
    assert extract("a <answer> 4 </answer> b <answer>5</answer>", "tag") == "5"
    assert extract("no tag", "tag") is None
    assert extract("x \\boxed{7}", "boxed") == "7"


def test_unknown_task_lists_close_matches():
    spec = ReasoningGymSource(task="basic_arithmetc", size=2)
    with pytest.raises(ConfigError, match=r"data.domains\[1\].reasoning_gym.task: .*"
                                          r"'basic_arithmetc'; did you mean basic_arithmetic"):
        generate_rows(spec, "train", "data.domains[1].reasoning_gym")


def test_bad_task_options_are_a_config_error():
    spec = ReasoningGymSource(task="basic_arithmetic", size=2, config={"no_such_option": 1})
    with pytest.raises(ConfigError, match="refused its options"):
        generate_rows(spec, "train", "d")

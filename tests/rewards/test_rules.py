"""Rule rewards: each check against responses judged by hand, composition, format reward, and
row validation naming the file and line."""

import asyncio
import json

import pytest

from reroll.config.errors import ConfigError
from reroll.data.datasets import load_prompts
from reroll.rewards import build_reward
from reroll.rewards.base import RewardSample
from reroll.rewards.rules import (
    CHECKS,
    answer_part,
    check_rows,
    parse_constraint,
    score_rules,
    think_format,
)

CASES = [
    ("word_count", "one two three", {"min": 3, "max": 3}, True),
    ("word_count", "one two three", {"max": 2}, False),
    ("sentence_count", "Hi there. How are you? Fine!", {"min": 3, "max": 3}, True),
    ("sentence_count", "Pi is 3.14 and e is 2.71.", {"max": 1}, True),
    ("sentence_count", "One. Two", {"min": 2, "max": 2}, True),
    ("paragraph_count", "a\n\nb\n\n\nc", {"min": 3, "max": 3}, True),
    ("paragraph_count", "a\nb", {"min": 2}, False),
    ("include_keywords", "The Apple is red", {"keywords": ["apple", "red"]}, True),
    ("include_keywords", "pineapple", {"keywords": ["apple"]}, False),
    ("forbidden_keywords", "no bad words", {"keywords": ["evil"]}, True),
    ("forbidden_keywords", "an Evil plan", {"keywords": ["evil"]}, False),
    ("keyword_frequency", "yes yes no yes", {"keyword": "yes", "min": 3}, True),
    ("keyword_frequency", "yes yes no yes", {"keyword": "yes", "max": 2}, False),
    ("lowercase", "all lower, 123", {}, True),
    ("lowercase", "Not lower", {}, False),
    ("lowercase", "123", {}, False),
    ("uppercase", "SHOUT 1", {}, True),
    ("json_format", '{"a": [1, 2]}', {}, True),
    ("json_format", '```json\n{"a": 1}\n```', {}, True),
    ("json_format", "{a: 1}", {}, False),
    ("bullet_list", "Items:\n- a\n* b\n1. c", {"min": 3, "max": 3}, True),
    ("bullet_list", "no list here", {}, False),
    ("starts_with", "  Dear Sam, hello", {"phrase": "dear sam"}, True),
    ("ends_with", "That is all. Any other questions?", {"phrase": "Any other questions?"}, True),
    ("ends_with", "That is all.", {"phrase": "questions?"}, False),
    ("no_commas", "a b c", {}, True),
    ("no_commas", "a, b", {}, False),
    ("script", "Привет, мир", {"name": "cyrillic"}, True),
    ("script", "Hello мир", {"name": "cyrillic"}, False),
    ("script", "Hello мир", {"name": "cyrillic", "min_share": 0.3}, True),
    ("script", "你好世界", {"name": "han"}, True),
]


@pytest.mark.parametrize(("name", "text", "args", "expected"), CASES)
def test_each_check_against_hand_judged_text(name, text, args, expected):
    assert CHECKS[name](text, **args) is expected


def test_every_check_has_a_hand_judged_case():
    assert {c[0] for c in CASES} == set(CHECKS)


def test_think_format_and_answer_part():
    good = "<think>2+2 is 4</think> The answer is 4."
    assert think_format(good) and answer_part(good) == " The answer is 4."
    assert not think_format("The answer is 4.")
    assert not think_format("<think></think> 4")  # no reasoning
    assert not think_format("<think>x</think>   ")  # no answer
    assert not think_format("<think>x</think> 4 <think>y</think> 5")
    assert answer_part("no think") == "no think"


def test_score_is_the_share_of_checks_passed_mixed_with_format():
    constraints = [{"check": "word_count", "max": 3}, "lowercase", {"check": "ends_with",
                                                                     "phrase": "done"}]
    score, info = score_rules("<think>plan</think>so it is done", constraints)
    # answer "so it is done": 4 words (fails max 3), lowercase (passes), ends with done (passes)
    assert score == pytest.approx(2 / 3)
    assert info["checks"] == {"word_count": False, "lowercase": True, "ends_with": True}
    assert score_rules("so it is done", constraints, credit="all_or_nothing")[0] == 0.0
    mixed, info = score_rules("<think>plan</think>so it is done", constraints,
                              format_weight=0.5)
    assert mixed == pytest.approx(0.5 * 2 / 3 + 0.5) and info["format"] == 1.0


def test_the_same_check_twice_is_scored_twice():
    score, info = score_rules("a b", [{"check": "word_count", "min": 2},
                                      {"check": "word_count", "min": 5}])
    assert score == 0.5 and len(info["checks"]) == 2


def test_parse_constraint_refuses_unknown_names_and_arguments():
    assert parse_constraint("lowercase") == ("lowercase", {})
    with pytest.raises(ValueError, match="unknown check 'word_cnt'.*did you mean word_count"):
        parse_constraint({"check": "word_cnt"})
    with pytest.raises(ValueError, match="check 'word_count'"):
        parse_constraint({"check": "word_count", "maximum": 3})
    with pytest.raises(ValueError, match="script"):
        parse_constraint({"check": "script", "name": "klingon"})
    with pytest.raises(ValueError, match="a constraint is"):
        parse_constraint(3)


def test_bad_rows_name_the_file_and_line(tmp_path):
    path = tmp_path / "rules.jsonl"
    rows = [{"prompt": "say hi", "constraints": ["lowercase"]},
            {"prompt": "say bye", "constraints": [{"check": "lower_case"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: unknown check 'lower_case'"):
        check_rows(load_prompts(path), "constraints", [], "reward")
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:1: no rule to check"):
        check_rows(load_prompts(path), "constraints", [], "reward")
    check_rows(load_prompts(path), "constraints", ["lowercase"], "reward")  # config checks do


def test_rules_reward_from_config_scores_row_and_config_checks():
    from reroll.config.schema import RulesReward

    reward = build_reward(RulesReward(checks=["lowercase"]))
    sample = RewardSample("p", "hello world", metadata={"constraints": [
        {"check": "word_count", "min": 3}]})
    result = asyncio.run(reward(sample))
    assert result.score == 0.5 and result.info["checks"] == {"lowercase": True,
                                                             "word_count": False}

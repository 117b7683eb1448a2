"""Code reward: correct, wrong, crashing and timing-out programs, stdin/stdout and function-call
styles, all-or-nothing and fractional credit — run for real in the bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import json
import pickle
import time

import pytest

from reroll.rewards.base import RewardFn, RewardSample
from reroll.rewards.code import (
    CodeRewardConfig,
    CodeRewardFn,
    extract_code,
    outputs_match,
    parse_tests,
    values_match,
)
from reroll.sandbox import SandboxPool

pytestmark = pytest.mark.unit

STDIO_TESTS = json.dumps(
    {"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30\n", "0\n"]}
)
ADD_CORRECT = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_WRONG_ON_NEGATIVE = "a, b = map(int, input().split())\nprint(abs(a) + b)\n"

CALL_TESTS = json.dumps(
    {"fn_name": "add", "inputs": [[1, 2], [10, 20], [-5, 5]], "outputs": [[3], [30], [0]]}
)
LCB_TESTS = json.dumps(
    [
        {"input": "[1, 2, 3]\n2", "output": "[2, 4, 6]", "testtype": "functional"},
        {"input": "[]\n5", "output": "[]", "testtype": "functional"},
        {"input": "[-1]\n-1", "output": "[1]", "testtype": "functional"},
    ]
)


def score(reward, response, answer, **metadata):
    sample = RewardSample(prompt="p", response=response, answer=answer, metadata=metadata)
    return asyncio.run(reward(sample))


def md(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}```\n\nIt reads the input and prints."


@pytest.fixture(scope="module")
def strict() -> CodeRewardFn:
    return CodeRewardFn(time_limit_s=2)


@pytest.fixture(scope="module")
def fractional() -> CodeRewardFn:
    return CodeRewardFn(credit="fractional", time_limit_s=2)


def test_it_is_a_reward_fn(strict):
    assert isinstance(strict, RewardFn) and strict.name == "code"
    assert pickle.loads(pickle.dumps(strict)).config == strict.config


def test_stdio_correct_program_scores_one(strict, fractional):
    for reward in (strict, fractional):
        result = score(reward, md(ADD_CORRECT), STDIO_TESTS)
        assert result.score == 1.0
        assert result.info["passed"] == 3 and result.info["total"] == 3
        assert result.info["first_failure"] is None and result.info["extracted_from_markdown"]


def test_stdio_wrong_program_all_or_nothing_vs_fractional(strict, fractional):
    strict_result = score(strict, md(ADD_WRONG_ON_NEGATIVE), STDIO_TESTS)
    assert strict_result.score == 0.0
    assert strict_result.info["first_failure"]["reason"] == "wrong_answer"
    assert strict_result.info["first_failure"]["test"] == 2
    assert "expected '0\\n', got '10\\n'" in strict_result.info["first_failure"]["detail"]
    frac = score(fractional, md(ADD_WRONG_ON_NEGATIVE), STDIO_TESTS)
    assert frac.score == pytest.approx(2 / 3)
    assert frac.info["statuses"] == ["passed", "passed", "wrong_answer"]


def test_crashing_program(strict, fractional):
    crash = "a, b = map(int, input().split())\nprint(a + b if a + b else 1 // 0)\n"  # fails on -5 5
    result = score(fractional, md(crash), STDIO_TESTS)
    assert result.score == pytest.approx(2 / 3)
    failure = result.info["first_failure"]
    assert failure["reason"] == "runtime_error" and "ZeroDivisionError" in failure["detail"]
    assert score(strict, md("raise SystemExit(1)\n"), STDIO_TESTS).score == 0.0


def test_timing_out_program_hits_the_per_test_limit(fractional):
    slow = "a, b = map(int, input().split())\nif a == 10:\n    while True:\n        pass\nprint(a + b)\n"
    reward = CodeRewardFn(credit="fractional", time_limit_s=1)
    result = score(reward, md(slow), STDIO_TESTS)
    assert result.score == pytest.approx(2 / 3)
    assert result.info["statuses"][1] == "time_limit"
    assert result.info["first_failure"]["test"] == 1


def test_all_or_nothing_stops_at_the_first_failure_and_kills_running_tests():
    tests = json.dumps({"inputs": ["0", "1", "2", "3"], "outputs": ["0", "1", "2", "3"]})
    program = "import time\nn = int(input())\nif n > 0:\n    time.sleep(30)\nprint(-1)\n"
    reward = CodeRewardFn(time_limit_s=30, parallel_tests=2)
    started = time.perf_counter()
    result = score(reward, md(program), tests)
    assert time.perf_counter() - started < 10  # test 1, already running, was killed
    assert result.score == 0.0
    assert result.info["statuses"] == ["wrong_answer", "skipped", "skipped", "skipped"]


def test_time_limit_from_metadata_overrides_the_default():
    reward = CodeRewardFn(time_limit_s=30)
    sleeper = "import time\ntime.sleep(10)\nprint(3)\n"
    result = score(
        reward, md(sleeper), json.dumps({"inputs": ["1 2"], "outputs": ["3"]}), time_limit_s=0.5
    )
    assert result.score == 0.0 and result.info["first_failure"]["reason"] == "time_limit"


def test_function_call_style_apps(strict, fractional):
    assert score(strict, md("def add(a, b):\n    return a + b\n"), CALL_TESTS).score == 1.0
    wrong = "def add(a, b):\n    print('debug output is ignored')\n    return abs(a) + b\n"
    assert score(strict, md(wrong), CALL_TESTS).score == 0.0
    frac = score(fractional, md(wrong), CALL_TESTS)
    assert frac.score == pytest.approx(2 / 3)
    assert frac.info["first_failure"] == {
        "test": 2,
        "reason": "wrong_answer",
        "detail": "expected [0], got 10",
    }


def test_function_call_style_livecodebench_with_solution_class(fractional):
    solution = (
        "from typing import List\n"
        "class Solution:\n"
        "    def scale(self, nums: List[int], k: int) -> List[int]:\n"
        "        return [x * k for x in nums]\n"
    )
    assert score(fractional, md(solution), LCB_TESTS, func_name="scale").score == 1.0
    crashing = "def scale(nums, k):\n    return [x * k for x in nums] if nums else nums[0]\n"
    result = score(fractional, md(crashing), LCB_TESTS, func_name="scale")
    assert result.score == pytest.approx(2 / 3)
    assert result.info["statuses"] == ["passed", "runtime_error", "passed"]
    assert "IndexError" in result.info["first_failure"]["detail"]
    missing = score(fractional, md("def other():\n    pass\n"), LCB_TESTS, func_name="scale")
    assert missing.score == 0.0 and "not defined" in missing.info["first_failure"]["detail"]


def test_function_call_timeout(fractional):
    looping = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b\n"
    reward = CodeRewardFn(credit="fractional", time_limit_s=1)
    result = score(reward, md(looping), CALL_TESTS)
    assert result.score == pytest.approx(2 / 3) and result.info["statuses"][2] == "time_limit"


def test_humaneval_and_mbpp_styles(strict, fractional):
    humaneval = json.dumps(
        {
            "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n",
            "entry_point": "square",
        }
    )
    assert score(strict, md("def square(x):\n    return x * x\n"), humaneval).score == 1.0
    bad = score(strict, md("def square(x):\n    return x + x\n"), humaneval)
    assert bad.score == 0.0 and "AssertionError" in bad.info["first_failure"]["detail"]
    mbpp = json.dumps(
        {"asserts": ["assert double(1) == 2", "assert double(0) == 0", "assert double(-2) == 4"]}
    )
    assert score(fractional, md("def double(x):\n    return 2 * x\n"), mbpp).score == pytest.approx(
        2 / 3
    )


def test_raw_code_without_markdown_and_missing_code(strict):
    result = score(strict, ADD_CORRECT, STDIO_TESTS)
    assert result.score == 1.0 and not result.info["extracted_from_markdown"]
    empty = score(strict, "```python\n```", STDIO_TESTS)
    assert empty.score == 0.0 and empty.info["first_failure"]["reason"] == "no_code"


def test_shared_pool_can_be_injected():
    async def scenario():
        async with SandboxPool(concurrency=4) as pool:
            reward = CodeRewardFn(sandbox=pool, credit="fractional")
            samples = [
                RewardSample("p", md(ADD_CORRECT), STDIO_TESTS),
                RewardSample("p", md(ADD_WRONG_ON_NEGATIVE), STDIO_TESTS),
            ]
            results = await asyncio.gather(*(reward(s) for s in samples))
            return results, pool.metrics()

    results, metrics = asyncio.run(scenario())
    assert [r.score for r in results] == [1.0, pytest.approx(2 / 3)]
    assert metrics["executions"] == 6


def test_extract_code_prefers_the_last_python_block():
    response = (
        "```text\nnot code\n```\nfirst:\n```python\nprint(1)\n```\nfinal:\n```py\nprint(2)\n```\n"
    )
    assert extract_code(response) == ("print(2)", True)
    assert extract_code("```\nprint(3)\n```") == ("print(3)", True)
    assert extract_code("truncated:\n```python\nprint(4)\nfor") == ("print(4)\nfor", True)
    assert extract_code("print(5)") == ("print(5)", False)


def test_output_and_value_comparison():
    assert outputs_match("3\n", "3")
    assert outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert outputs_match("0.3333333", "0.33333333", tol=1e-6)
    assert not outputs_match("0.34", "0.33", tol=1e-6)
    assert not outputs_match("1 2", "1 2 3")
    assert values_match([1, [2.0000001]], [1, [2]])
    assert not values_match(True, 1) and not values_match([1], [1, 2])


def test_unrecognised_tests_are_an_error():
    with pytest.raises(ValueError, match="needs test cases"):
        parse_tests(None, {})
    with pytest.raises(ValueError, match="unrecognised"):
        parse_tests(json.dumps({"foo": 1}), {})
    with pytest.raises(ValueError, match="function name"):
        parse_tests(LCB_TESTS, {})
    assert CodeRewardConfig(memory_bytes="256M").memory_bytes == 256 << 20

"""`make demo-tools`' pieces without a model: the openai harness offers exactly the schema the
SFT episodes were written with (so the model is served the prompts it was fine-tuned on), its
tool errors go back to the model, and the task rows are the env's questions, held-out apart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from reroll.envs.calculator import CalculatorEnv
from reroll.envs.episodes import expert_rows
from reroll.tools.schema import tool_schema

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(name: str, arguments: str):
    return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))


def test_the_harness_offers_the_calculator_envs_schema():
    harness = _script("harness")
    assert harness.TOOLS == [tool_schema(CalculatorEnv().calculator)]


def test_the_harness_runs_calls_and_returns_errors_to_the_model():
    harness = _script("harness")
    assert harness.run_call(_call("calculator", '{"expression": "1234 * 5678 + 9"}')) == \
        str(1234 * 5678 + 9)
    assert harness.run_call(_call("calculator", "{oops")).startswith("error: ")
    assert "unknown tool 'python'" in harness.run_call(_call("python", "{}"))
    assert harness.run_call(_call("calculator", '{"expr": "1"}')).startswith("error: ")
    assert harness.run_call(_call("calculator", '{"expression": "1 / 0"}')).startswith("error: ")


def test_task_rows_are_the_envs_questions_and_held_out_apart(tmp_path):
    assert _script("make_tasks").main(["--out", str(tmp_path), "--train", "3", "--eval", "2"]) == 0
    train = [json.loads(x) for x in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in train] == [10_000, 10_001, 10_002]
    assert [r["seed"] for r in held] == [10**9, 10**9 + 1]
    env = CalculatorEnv(digits=4)
    for row in train + held:
        prompt, _ = env.reset(row["seed"])
        assert row["prompt"] == prompt and row["answer"] == env.answer


def test_the_careless_expert_answers_some_episodes_from_its_head_and_they_fail():
    # the demo's SFT data: a share of episodes without the tool, so RL has something to lift
    rows = expert_rows("calculator", 40, kwargs={"digits": 4, "careless": 0.5})
    careless = [r for r in rows if not any(m.get("tool_calls") for m in r["messages"])]
    assert 10 <= len(careless) <= 30
    for row in careless:
        env = CalculatorEnv(digits=4)
        env.reset(row["env_seed"])
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert env.step(row["messages"][-1]["content"])[1] == 0.0  # a wrong estimate
    for row in (r for r in rows if r not in careless):  # the tool call, its result, the answer
        env = CalculatorEnv(digits=4)
        env.reset(row["env_seed"])
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert env.step(row["messages"][-1]["content"])[1] == 1.0
    # the questions are the same whatever the share
    plain = expert_rows("calculator", 40, kwargs={"digits": 4})
    assert [r["messages"][0] for r in plain] == [r["messages"][0] for r in rows]
    with pytest.raises(ValueError, match="careless"):
        CalculatorEnv(careless=1.5)

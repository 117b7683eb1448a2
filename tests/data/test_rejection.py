"""`reroll make-sft`: recorded rollouts or eval samples -> SFT rows of the episodes whose reward
is at least R (rejection-sampling fine-tuning), and the calculator expert's tool-use rows."""

from __future__ import annotations

import json

import pytest

from reroll.cli import main
from reroll.data.rejection import rejection_rows
from reroll.envs.episodes import expert_rows

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "",
                                          "parameters": {"type": "object", "properties": {}}}}]


def _episode(reward, finish="stop", answer="\\boxed{3}"):
    return {"prompt": "What is 1 + 2?", "response": "...", "reward": reward,
            "finish_reason": finish, "tools": TOOLS, "messages": [
                {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", '
                                                 '"arguments": {"expression": "1 + 2"}}\n'
                                                 '</tool_call>'},
                {"role": "tool", "tool_call_id": "call_0", "content": "3"},
                {"role": "assistant", "content": answer}]}


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_make_sft_keeps_finished_episodes_at_or_above_the_reward(tmp_path):
    run = tmp_path / "run"
    _write(run / "rollouts" / "step_1.jsonl", [
        _episode(1.0), _episode(0.0, answer="\\boxed{4}"), _episode(1.0, "length"),
        _episode(1.0, "env_error")])
    _write(run / "rollouts" / "step_2.jsonl", [
        _episode(1.0),  # the same conversation again: written once
        {"prompt": "2+2?", "response": "4", "reward": 1.0, "finish_reason": "stop"},
        {"prompt": "2+3?", "response": "6", "reward": 0.0, "finish_reason": "stop"}])
    rows, total = rejection_rows(run, 1.0)
    assert total == 7 and len(rows) == 2
    assert rows[0]["messages"] == _episode(1.0)["messages"] and rows[0]["tools"] == TOOLS
    assert rows[1]["messages"] == [{"role": "user", "content": "2+2?"},
                                   {"role": "assistant", "content": "4"}]
    out = tmp_path / "rft.jsonl"
    assert main(["make-sft", "--from", str(run), "--min-reward", "0", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 4


def test_make_sft_bad_inputs_exit_2(tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    assert main(["make-sft", "--from", str(tmp_path / "empty_run"), "--out", "x.jsonl"]) == 2
    assert "no rollouts/step_N.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.samples.jsonl"
    bad.write_text('{"reward": 1}\n')
    assert main(["make-sft", "--from", str(bad), "--out", "x.jsonl"]) == 2
    assert f"{bad}:1: not a rollout or eval sample row" in capsys.readouterr().err
    _write(tmp_path / "low.samples.jsonl", [_episode(0.0)])
    assert main(["make-sft", "--from", str(tmp_path / "low.samples.jsonl"), "--min-reward",
                 "1", "--out", "x.jsonl"]) == 2


def test_the_calculator_expert_writes_whole_tool_use_episodes():
    rows = expert_rows("calculator", 3, kwargs={"digits": 6})
    assert len(rows) == 3
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        call = row["messages"][1]["tool_calls"][0]["function"]
        expression = json.loads(call["arguments"])["expression"]
        a, _, b, _, c = expression.split()
        assert row["messages"][2]["content"] == str(int(a) * int(b) + int(c))
        assert row["messages"][3]["content"].endswith(f"\\boxed{{{int(a) * int(b) + int(c)}}}.")
        assert row["tools"][0]["function"]["name"] == "calculator"

"""An unmodified `openai` SDK tool-calling harness trained through the gateway: `reroll train`
with `agent: {entrypoint: tool_harness:solve}` on the tiny model with the Qwen3-style template,
taught to call its `add` tool. The harness calls `chat.completions.create` with `tools`, runs the calls, sends
`tool` messages back; the run trains on the engine's own tokens of those calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tool_harness import TASKS, tool_model

from reroll.cli import main

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tool_calling_model(tiny_model, tmp_path_factory):
    """The tiny model with the Qwen3-style template, fitted to call `add` (tool_harness)."""
    return str(tool_model(tiny_model, tmp_path_factory.mktemp("models") / "tool-caller"))


def test_the_openai_sdk_tool_loop_trains_through_the_gateway(tool_calling_model, tmp_path,
                                                             monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # the harness module, as a user's would be
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config = {
        "pipeline": "agentic", "name": "harness", "output_dir": str(tmp_path / "run"),
        "steps": 2, "model": {"path": tool_calling_model},
        "agent": {"entrypoint": "tool_harness:solve", "tasks": str(tasks),
                  "time_limit_s": 120, "max_context_tokens": 768},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 100,
                    "temperature": 0.7},
        "optimizer": {"lr": 1e-4},
        "train": {"micro_batch_size": 2, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4},
    }
    path = tmp_path / "harness.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "gateway/episodes" in r]
    assert len(trained) == 2 and all(r["gateway/episodes"] == 4 for r in trained)
    # Every call's tokens are in the training samples exactly, none of the harnesses failed.
    assert all(r["gateway/faithful_fraction"] == 1.0 for r in trained)
    assert all(r["gateway/crashed"] == r["gateway/timeout"] == 0 for r in trained)
    episodes = [json.loads(line) for step in (1, 2)
                for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    # The model called its tool and got the result back: one trajectory holds the tool call
    # (policy tokens), the tool's response (harness tokens, masked) and the answer after it.
    called = [e for e in episodes if e["reward_info"]["calls"] >= 2]
    assert called, [e["response"][:200] for e in episodes]
    segments = called[0]["segments"]
    assert segments[0]["policy"] and "<tool_call>" in segments[0]["text"]
    assert not segments[1]["policy"] and "<tool_response>" in segments[1]["text"]
    assert any(e["reward"] == 1.0 for e in episodes)
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

"""Tools end to end on the tiny model with the Qwen3-style template (which renders `tools=`):
SFT on the calculator env's scripted tool-use episodes (every assistant turn trained), then an
agentic GRPO run in which the model calls the tool through the agent loop, its calls counted in
the run's metrics and recorded as `tool` messages, and `reroll make-sft` turning the recorded
episodes back into multi-turn SFT rows."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e

ENV = {"id": "calculator", "kwargs": {"digits": 2}, "max_turns": 2}


def _qwen_style_tiny(tiny_model, out):
    from transformers import AutoTokenizer

    from reroll.models.qwen_tokenizer import QWEN3_STYLE_TEMPLATE

    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    tok.save_pretrained(str(out))
    return str(out)


def _yaml(path, config):
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_tool_use_sft_then_agentic_grpo_calls_the_tool(tiny_model, tmp_path):
    model = _qwen_style_tiny(tiny_model, tmp_path / "qwen_style")
    episodes = tmp_path / "calculator.jsonl"
    assert main(["make-episodes", "--env", "calculator", "--kwargs", '{"digits": 2}',
                 "--episodes", "64", "--out", str(episodes)]) == 0
    sft = _yaml(tmp_path / "sft.yaml", {
        "pipeline": "sft", "output_dir": str(tmp_path / "sft"), "seed": 0, "steps": 30,
        "model": {"path": model}, "data": {"train": str(episodes), "max_tokens": 1024},
        "batch_size": 8, "optimizer": {"lr": 5e-3, "warmup_steps": 2},
        "train": {"micro_batch_size": 8, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False}})
    assert main(["sft", sft]) == 0
    rl = _yaml(tmp_path / "rl.yaml", {
        "pipeline": "agentic", "output_dir": str(tmp_path / "rl"), "steps": 1,
        "model": {"path": str(tmp_path / "sft" / "final")},
        "env": {**ENV, "max_context_tokens": 1024, "eval_episodes": 0,
                "history_thinking": "keep"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 80},
        "optimizer": {"lr": 1e-4}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 8}})
    assert main(["train", rl]) == 0
    [metrics] = [json.loads(line) for line in
                 (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["env/errors"] == 0
    assert {"env/tool_errors", "env/tool_parse_errors"} <= set(metrics)
    assert metrics["env/tool_calls"] + metrics["env/tool_parse_errors"] > 0, metrics
    rows = [json.loads(line) for line in
            (tmp_path / "rl" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" for row in rows for m in row["messages"])
    assert all(row["tools"][0]["function"]["name"] == "calculator" for row in rows)
    out = tmp_path / "rft.jsonl"
    assert main(["make-sft", "--from", str(tmp_path / "rl"), "--min-reward", "0",
                 "--out", str(out)]) == 0
    made = [json.loads(line) for line in out.read_text().splitlines()]
    assert made and all(r["messages"][-1]["role"] == "assistant" and r["tools"] for r in made)

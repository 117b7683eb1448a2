"""Tools end to end on the tiny model with the Qwen3-style template (which renders `tools=`):
`reroll train` with `pipeline: agentic` on the calculator env renders the tool in every prompt,
counts the tool metrics, records each episode's conversation and tool schemas, and `reroll
make-sft` turns the recorded episodes into multi-turn SFT rows that `reroll sft` trains on.
(The untrained tiny model rarely writes a well-formed call: the loop's handling of real calls,
errors and results is checked token by token in test_agent_loop_tools.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e


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


def test_agentic_grpo_with_a_tool_env_then_rejection_sampled_sft(tiny_model, tmp_path):
    model = _qwen_style_tiny(tiny_model, tmp_path / "qwen_style")
    rl = _yaml(tmp_path / "rl.yaml", {
        "pipeline": "agentic", "output_dir": str(tmp_path / "rl"), "steps": 1,
        "model": {"path": model},
        "env": {"id": "calculator", "kwargs": {"digits": 2}, "max_turns": 2,
                "max_context_tokens": 800, "eval_episodes": 0, "history_thinking": "keep"},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24},
        "optimizer": {"lr": 1e-4}, "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4}})
    assert main(["train", rl]) == 0
    [metrics] = [json.loads(line) for line in
                 (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["env/errors"] == 0
    assert {"env/tool_calls", "env/tool_errors", "env/tool_parse_errors"} <= set(metrics)
    rows = [json.loads(line) for line in
            (tmp_path / "rl" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row["tools"][0]["function"]["name"] == "calculator"
        assert row["messages"][0] == {"role": "user", "content": row["prompt"]}
        roles = [m["role"] for m in row["messages"]]
        assert roles[1] == "assistant" and set(roles[2:]) <= {"assistant", "user", "tool"}
    out = tmp_path / "rft.jsonl"
    assert main(["make-sft", "--from", str(tmp_path / "rl"), "--min-reward", "0",
                 "--out", str(out)]) == 0
    made = [json.loads(line) for line in out.read_text().splitlines()]
    assert made and all(r["messages"][-1]["role"] == "assistant" and r["tools"] for r in made)
    sft = _yaml(tmp_path / "sft.yaml", {
        "pipeline": "sft", "output_dir": str(tmp_path / "sft"), "steps": 2, "model": {"path": model},
        "data": {"train": str(out), "max_tokens": 1024}, "batch_size": 2,
        "train": {"micro_batch_size": 2, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False}})
    assert main(["sft", sft]) == 0
    nll = [json.loads(line)["sft/nll"] for line in
           (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(nll) == 2 and all(value > 0 for value in nll)

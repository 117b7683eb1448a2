"""SFT on multi-turn rows: every assistant turn (tool calls included) is trained and nothing
else, checked token by token on real tokenizers (Qwen's with the Qwen3-style template, which
renders tools itself, and SmolLM2's, which gets the fallback block)."""

from __future__ import annotations

import json

import pytest

from reroll.config.errors import ConfigError
from reroll.data.batch import collate
from reroll.data.datasets import load_prompts
from reroll.pipelines.sft import sft_example
from reroll.tools import render_messages

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
ROW = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "What is 12345 * 6789?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "12345 * 6789"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "83810205"},
    {"role": "assistant", "content": "The answer is \\boxed{83810205}."},
    {"role": "user", "content": "And halved?"},
    {"role": "assistant", "content": "41905102.5"},
]}
TURNS = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12345 * 6789"}}\n'
         '</tool_call>', "The answer is \\boxed{83810205}.", "41905102.5"]


def _example(tokenizer, tmp_path, row=ROW, train_turns="all"):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [example] = load_prompts(path, None, lambda r: sft_example(tokenizer, r, "response", 4096,
                                                                train_turns))
    return example


def _spans(ids, mask):
    """The runs of consecutive ids whose mask is 1."""
    spans, current = [], []
    for token, flag in zip(ids, mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    return spans + ([current] if current else [])


@pytest.mark.parametrize("name", ["qwen_tokenizer", "smollm2_tokenizer"])
def test_every_assistant_turn_is_trained_and_nothing_else(request, tmp_path, name):
    tok = request.getfixturevalue(name)
    example = _example(tok, tmp_path)
    ids = example.prompt_ids + example.response_ids
    mask = [0] * len(example.prompt_ids) + example.policy_mask
    # the sequence is the template's rendering of the whole row (the tools included) ...
    rendered = render_messages(tok, ROW["messages"], TOOLS, add_generation_prompt=False)
    assert tok.decode(ids) + "\n" == rendered
    assert "# Tools" in tok.decode(example.prompt_ids)
    # ... and the trained tokens are exactly each assistant turn, closed by the stop token
    spans = _spans(ids, mask)
    assert [tok.decode(s) for s in spans] == [turn + tok.eos_token for turn in TURNS]
    assert all(s[-1] == tok.eos_token_id for s in spans)
    assert [tok.encode(turn, add_special_tokens=False) for turn in TURNS] == [s[:-1] for s in spans]
    untrained = tok.decode([t for t, f in zip(ids, mask, strict=True) if not f])
    assert "83810205\n</tool_response>" in untrained and "And halved?" in untrained
    batch, _ = collate([example], tok.pad_token_id)
    assert batch["response_mask"][0, : len(ids)].tolist() == [float(f) for f in mask]


def test_a_row_with_one_final_assistant_message_is_trained_as_before(qwen_tokenizer, tmp_path):
    row = {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}]}
    example = _example(qwen_tokenizer, tmp_path, row)
    assert example.policy_mask is None
    assert example.response_ids == qwen_tokenizer.encode("Hello!", add_special_tokens=False) + [
        qwen_tokenizer.eos_token_id]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(qwen_tokenizer,
                                                                          tmp_path):
    row = {"messages": [{"role": "user", "content": "a"},
                        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
                        {"role": "user", "content": "c"},
                        {"role": "assistant", "content": "d"}]}
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: the chat template renders"):
        _example(qwen_tokenizer, tmp_path, row)


PLAIN = {"messages": [{"role": "user", "content": "Guess 1-8"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "Too low."}, {"role": "assistant", "content": "6"}]}


@pytest.mark.parametrize("train_turns,trained", [("auto", ["6"]), ("last", ["6"]),
                                                 ("all", ["4", "6"])])
def test_train_turns_picks_the_trained_turns_of_a_plain_chat(qwen_tokenizer, tmp_path,
                                                             train_turns, trained):
    """`auto` trains a plain chat's last turn (a per-turn prefix row of `make-episodes`: its
    earlier turns are trained in their own rows) and every turn of a tool conversation."""
    example = _example(qwen_tokenizer, tmp_path, PLAIN, train_turns)
    mask = example.policy_mask or [1] * len(example.response_ids)
    texts = [qwen_tokenizer.decode(span).strip() for span in _spans(example.response_ids, mask)]
    assert [t.removesuffix(qwen_tokenizer.eos_token).strip() for t in texts] == trained
    tool = _example(qwen_tokenizer, tmp_path, ROW, "auto")
    assert tool.policy_mask is not None and sum(tool.policy_mask) < len(tool.response_ids)

"""The tools layer: schemas from callables, the tool-call parsers, the chat rendering of tools
(the Qwen3-style template's own and the fallback block), and running calls (errors and time
limits become counted error results, never exceptions)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest

from reroll.tools import (
    Tool,
    ToolCall,
    as_tools,
    parse_tool_calls,
    render_calls,
    render_messages,
    supports_tools,
    tool_schema,
    tools_block,
)
from reroll.tools.execute import run_calls

pytestmark = pytest.mark.unit


def calculator(expression: str, digits: int = 0, mode: Literal["exact", "float"] = "exact",
               notes: list[str] | None = None) -> str:
    """Evaluate an arithmetic expression.

    Only numbers and + - * / are allowed.

    Args:
        expression: the expression, e.g. `12 * 34`;
            no variables.
        digits: decimal places.
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own input


def test_schema_from_a_callable():
    schema = tool_schema(calculator)
    assert schema == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string",
                           "description": "the expression, e.g. `12 * 34`; no variables."},
            "digits": {"type": "integer", "description": "decimal places."},
            "mode": {"type": "string", "enum": ["exact", "float"]},
            "notes": {"type": "array", "items": {"type": "string"}}}}}}


def test_schema_from_a_dict_and_its_checks():
    inner = {"name": "f", "description": "d", "parameters": {"type": "object",
                                                            "properties": {}}}
    assert tool_schema(inner) == tool_schema({"type": "function", "function": inner}) == \
        {"type": "function", "function": inner}
    with pytest.raises(ValueError, match="needs a function `name`"):
        tool_schema({"description": "no name"})
    with pytest.raises(ValueError, match="unique"):
        as_tools([calculator, calculator])


def test_hermes_parser_reads_several_calls_and_the_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"2*3"}}\n</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"q\\": '
            '\\"x\\"}"}</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me compute."
    assert parsed.calls == [ToolCall("call_0", "calculator", {"expression": "2*3"}),
                            ToolCall("call_1", "search", {"q": "x"})]
    assert parsed.errors == []
    assert parse_tool_calls("just text", "hermes").calls == []


def test_hermes_parser_reports_malformed_calls():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}'
            '</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "cut off", ')
    parsed = parse_tool_calls(text, "hermes")
    assert [c.name for c in parsed.calls] == ["ok"]
    assert len(parsed.errors) == 4
    assert "invalid JSON" in parsed.errors[0] and "invalid JSON" in parsed.errors[3]
    assert "needs a string `name`" in parsed.errors[1]
    assert "must be a JSON object" in parsed.errors[2]


def test_an_unclosed_hermes_call_at_the_end_is_parsed():
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "hermes")
    assert parsed.calls == [ToolCall("call_0", "f", {"a": 1})] and not parsed.errors


def test_llama3_json_parser():
    parsed = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                              '{"name": "g", "arguments": {}}', "llama3_json")
    assert parsed.calls == [ToolCall("call_0", "f", {"a": 1}), ToolCall("call_1", "g", {})]
    assert parsed.content == "" and not parsed.errors
    assert parse_tool_calls("The answer is 4.", "llama3_json").calls == []
    assert parse_tool_calls('{"answer": 4}', "llama3_json").content == '{"answer": 4}'
    bad = parse_tool_calls('{"name": "f", "parameters": {', "llama3_json")
    assert not bad.calls and "invalid JSON" in bad.errors[0]
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_calls("x", "nope")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_rendered_calls_parse_back(parser):
    calls = [ToolCall("call_0", "f", {"a": [1, 2]}), ToolCall("call_1", "g", {"s": "x"})]
    assert parse_tool_calls(render_calls(calls, parser), parser).calls == calls


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "123 * 456"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "56088"},
]


def test_the_qwen3_style_template_renders_tools_itself(qwen_tokenizer):
    assert supports_tools(qwen_tokenizer)
    text = render_messages(qwen_tokenizer, MESSAGES, [calculator])
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tool_schema(calculator)) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "123 * 456"}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # the fallback block is written to match: the same text through a plain ChatML rendering
    assert text == render_messages(qwen_tokenizer, MESSAGES, [calculator], native=False)


def test_a_template_without_tools_gets_the_fallback_block(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert not supports_tools(tok)
    text = render_messages(tok, MESSAGES, [calculator])
    assert "<|im_start|>system\nBe brief.\n\n" + tools_block([tool_schema(calculator)]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "123 * 456"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>" in text
    assert "tool" not in [line.split("\n")[0] for line in text.split("<|im_start|>")]
    plain = [{"role": "user", "content": "hi"}]
    assert render_messages(tok, plain) == tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True)
    llama = render_messages(tok, MESSAGES, [calculator], parser="llama3_json")
    assert '{"name": "calculator", "parameters": {"expression": "123 * 456"}}' in llama


def _run(calls, tools, timeout_s=1.0):
    return asyncio.run(run_calls(calls, as_tools(tools), timeout_s))


def test_calls_run_concurrently_and_failures_become_error_results():
    def slow(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "slept"

    async def hang() -> str:
        """Never returns in time."""
        await asyncio.sleep(60)

    def boom() -> str:
        """Raises."""
        raise KeyError("lost")

    tools = [calculator, slow, hang, boom, {"name": "schema_only"}]
    calls = [ToolCall("call_0", "calculator", {"expression": "6 * 7"}),
             ToolCall("call_1", "slow", {"seconds": 0.5}),
             ToolCall("call_2", "slow", {"seconds": 0.5}),
             ToolCall("call_3", "hang", {}), ToolCall("call_4", "boom", {}),
             ToolCall("call_5", "nowhere", {}), ToolCall("call_6", "calculator", {"x": 1}),
             ToolCall("call_7", "schema_only", {}), ToolCall("call_8", "slow", {"seconds": 30})]
    started = time.perf_counter()
    results = _run(calls, tools)
    assert time.perf_counter() - started < 2.5  # concurrent, and the hung ones abandoned at 1 s
    assert [(r.content, r.error) for r in results[:3]] == [("42", False), ("slept", False),
                                                          ("slept", False)]
    assert [r.error for r in results[3:]] == [True] * 6
    assert "took longer than 1.0s" in results[3].content
    assert "raised KeyError" in results[4].content
    assert "unknown tool 'nowhere'" in results[5].content and "calculator" in results[5].content
    assert "bad arguments for calculator" in results[6].content
    assert "unknown tool 'schema_only'" in results[7].content
    assert "took longer" in results[8].content
    assert results[0].message() == {"role": "tool", "tool_call_id": "call_0",
                                    "name": "calculator", "content": "42"}


def test_a_tool_returns_json_for_non_strings_and_its_own_limit_wins():
    def data() -> dict:
        """Data."""
        return {"a": 1}

    def nap() -> str:
        """Naps."""
        time.sleep(0.3)
        return "ok"

    results = _run([ToolCall("c0", "data", {}), ToolCall("c1", "nap", {})],
                   [data, Tool(tool_schema(nap), nap, timeout_s=0.05)], timeout_s=5)
    assert results[0].content == '{"a": 1}'
    assert results[1].error and "0.05s" in results[1].content


@pytest.mark.bwrap
def test_the_python_tool_runs_code_in_the_sandbox_with_several_tools_per_env():
    from reroll.envs import make_env

    env = make_env("calculator", python=True)
    tools = as_tools(env.tools)
    assert [t.name for t in tools] == ["calculator", "python"]
    results = _run([ToolCall("call_0", "python", {"code": "print(2 ** 100)"}),
                    ToolCall("call_1", "python", {"code": "import socket\n"
                                                          "socket.create_connection(('1.1.1.1', 80), 2)"}),
                    ToolCall("call_2", "calculator", {"expression": "2 * 21"})], tools, 20.0)
    assert results[0].content == str(2 ** 100) and not results[0].error
    assert "Error" in results[1].content  # no network in the sandbox
    assert results[2].content == "42"


def test_a_partial_is_a_tool_named_by_its_function():
    import functools

    def scale(value: float, factor: float) -> float:
        """Scale a value."""
        return value * factor

    double = functools.partial(scale, factor=2.0)
    schema = tool_schema(double)["function"]
    assert (schema["name"], schema["description"]) == ("scale", "Scale a value.")
    assert schema["parameters"]["required"] == ["value"]
    [result] = _run([ToolCall("c0", "scale", {"value": 1.5})], [double])
    assert (result.content, result.error) == ("3.0", False)

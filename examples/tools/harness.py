"""A tool-calling agent on the `openai` SDK, as a user writes one: `make demo-tools` trains it
through reroll's gateway (`agent: {entrypoint: "examples.tools.harness:solve"}`).

It offers the model a `calculator` tool with `chat.completions.create(..., tools=TOOLS)`, runs
the calls the model makes, sends the results back as `tool` messages and stops at a reply
without calls; the reward is 1 when that reply's \\boxed{} answer is right. Nothing in it knows
about reroll: pointed at any OpenAI-compatible server it runs the same.
"""

from __future__ import annotations

import json
import re

import openai

from reroll.envs.countdown import evaluate

# The same schema as the `calculator` env's tool (what `reroll make-episodes --env calculator`
# writes into the SFT rows), so the model is served the prompts it was fine-tuned on.
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string",
        "description": "numbers with + - * / and parentheses, e.g. `(12 + 3) * 45`."}},
        "required": ["expression"]}}}]

BOXED = re.compile(r"\\boxed\{\s*(-?[\d,]+)\s*\}")


def calculator(expression: str) -> str:
    """The tool itself: exact arithmetic on + - * / and parentheses (no `eval`)."""
    value, _ = evaluate(expression)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def run_call(call) -> str:
    """One tool call's result; a malformed call or a failing tool returns its error."""
    try:
        arguments = json.loads(call.function.arguments)
        if call.function.name != "calculator":
            raise ValueError(f"unknown tool {call.function.name!r}")
        return calculator(**arguments)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def solve(task: dict, base_url: str, api_key: str, max_calls: int = 3) -> float:
    """One episode: the tool-calling loop on `task` ({"prompt", "answer"}); its reward."""
    # a slow local server (a loaded CPU serving many episodes at once) may take minutes a call
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=1800.0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_calls):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            found = BOXED.findall(message.content or "")
            return float(bool(found) and found[-1].replace(",", "") == str(task["answer"]))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_call(call)})
    return 0.0  # out of calls without an answer

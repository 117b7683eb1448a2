"""Calculator: arithmetic on numbers too large to do in one's head, with a `calculator` tool.

The env declares its tools in `tools` (the agent loop renders them with the chat template,
parses the model's calls with `env.tool_parser`, runs them and returns the results as `tool`
messages); only a reply without a tool call reaches `step`, as the answer.
"""

from __future__ import annotations

import json
import random
from typing import Any

from reroll.envs.countdown import evaluate
from reroll.envs.parsing import boxed, integer
from reroll.tools.execute import python_tool


class CalculatorEnv:
    """What is `a * b + c`, with operands of `digits` digits? A `calculator` tool evaluates
    expressions; the answer goes in \\boxed{}. The expert calls the tool, then answers with
    its result (in the `hermes` format: `<tool_call>{json}</tool_call>`). A `careless` share
    of its episodes it answers from its head instead, without the tool: a rough estimate
    (a * b on a and b rounded to their two leading digits, plus c), never the right answer.
    That leaves RL something to improve after an SFT on its episodes.

    Args:
        digits: digits of the operands a and b (c has one fewer).
        max_turns: model turns per episode, tool calls and answers together.
        python: also offer a `python` tool, run in the Sandbox (needs bubblewrap).
        careless: share of the scripted expert's episodes answered from its head.
    """

    def __init__(self, digits: int = 5, max_turns: int = 4, python: bool = False,
                 careless: float = 0.0):
        if not 1 <= digits <= 30:
            raise ValueError(f"digits must be in [1, 30], got {digits}")
        if not 0.0 <= careless <= 1.0:
            raise ValueError(f"careless must be in [0, 1], got {careless}")
        self.digits, self.max_turns, self.careless = digits, max_turns, careless
        self.tools: list[Any] = [self.calculator] + ([python_tool()] if python else [])
        self.calls = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / and parentheses, e.g. `(12 + 3) * 45`.
        """
        self.calls += 1
        value, _ = evaluate(expression)  # a ValueError says what is not allowed
        return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        low, high = 10 ** (self.digits - 1), 10 ** self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        c = rng.randint(max(low // 10, 1), max(high // 10, 1))
        self.expression, self.answer = f"{a} * {b} + {c}", a * b + c
        # drawn after the operands: the questions are the same whatever the careless share
        self.careless_episode = rng.random() < self.careless
        self.guess = _rounded(a) * _rounded(b) + c
        if self.guess == self.answer:  # a and b already round: the head would be right
            self.guess += 10 ** (self.digits - 1)
        self.turn, self.expert_turn, self.calls = 0, 0, 0
        return (f"What is {self.expression}? Use the calculator tool, then put the final answer "
                f"in \\boxed{{}}."), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        info = {"success": False, "tool_calls": self.calls}
        if boxed(action) is None:
            return ("Call the calculator tool, or put the final answer in \\boxed{}.", 0.0, False,
                    self.turn >= self.max_turns, info)
        correct = integer(action) == self.answer
        return ("Correct!" if correct else "Wrong."), float(correct), True, False, \
            info | {"success": correct}

    def expert_action(self) -> str:
        self.expert_turn += 1
        if self.careless_episode:
            return f"The answer is \\boxed{{{self.guess}}}."
        if self.expert_turn == 1:
            call = {"name": "calculator", "arguments": {"expression": self.expression}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return f"The answer is \\boxed{{{self.answer}}}."


def _rounded(n: int) -> int:
    """`n` rounded to its two leading digits: what a careless head multiplies."""
    return round(n, 2 - len(str(n)))

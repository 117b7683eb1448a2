"""Countdown: reach the target with +, -, *, / over the given numbers (each at most once).
A wrong expression is answered with its value, so the model can correct itself over turns."""

from __future__ import annotations

import ast
import itertools
import operator
import random
from fractions import Fraction
from typing import Any

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv}


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(value, numbers used) of an arithmetic expression; ValueError if it is anything else."""
    used: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return walk(tree), used


def solve(numbers: list[int], target: int) -> str | None:
    """An expression over a subset of `numbers` that equals `target` (brute force), or None."""
    def search(items: list[tuple[Fraction, str]]) -> str | None:
        for value, text in items:
            if value == target:
                return text
        for (i, a), (j, b) in itertools.permutations(enumerate(items), 2):
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            options = [(a[0] + b[0], f"({a[1]} + {b[1]})"), (a[0] - b[0], f"({a[1]} - {b[1]})"),
                       (a[0] * b[0], f"({a[1]} * {b[1]})")]
            if b[0] != 0:
                options.append((a[0] / b[0], f"({a[1]} / {b[1]})"))
            for option in options:
                found = search(rest + [option])
                if found:
                    return found
        return None

    found = search([(Fraction(n), str(n)) for n in numbers])
    return found[1:-1] if found and found.startswith("(") else found


class CountdownEnv:
    """Reach the target with + - * / over the given numbers; a wrong expression is answered
    with its value.

    Args:
        count: how many numbers are given.
        max_number: largest given number.
        max_turns: expressions per episode.
    """

    def __init__(self, count: int = 3, max_number: int = 9, max_turns: int = 3):
        self.count, self.max_number, self.max_turns = count, max_number, max_turns

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
        a, b, *rest = self.numbers
        value = rng.choice([a + b, a * b, abs(a - b) or a + b])
        for n in rest:
            value = rng.choice([value + n, value * n if value * n <= 100 else value + n])
        self.target, self.turn = value, 0
        return (f"Numbers: {' '.join(map(str, self.numbers))}. Target: {self.target}. "
                f"Reply with an expression."), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        over = self.turn >= self.max_turns
        expression = action.strip().splitlines()[-1].split("=")[0] if action.strip() else ""
        try:
            value, used = evaluate(expression)
        except ValueError as e:
            return f"Invalid: {e}.", 0.0, False, over, {"success": False}
        pool = list(self.numbers)
        for n in used:
            if n not in pool:
                return f"Invalid: {n} is not available.", 0.0, False, over, {"success": False}
            pool.remove(n)
        if value == self.target:
            return "Correct!", 1.0, True, False, {"success": True}
        shown = str(value.numerator) if value.denominator == 1 else f"{float(value):.2f}"
        return f"That gives {shown}, not {self.target}.", 0.0, False, over, {"success": False}

    def expert_action(self) -> str:
        return solve(self.numbers, self.target) or str(self.numbers[0])

"""Guess the number: the env hides an integer in [low, high]; each guess is answered
"higher", "lower" or "correct". The expert bisects; its `noise` share of moves are careless (a
demonstrator that leaves RL something to improve): with `careless: random` a random guess anywhere
in [low, high], with `careless: scan` the lowest number still possible (linear search).
`noise_scope: episode` makes whole episodes careless instead of single moves. Random slips never
change the most likely move, scanning does once `noise` > 0.5: a model that imitates the expert's
likeliest move scans, and RL has to discover that bisecting pays."""

from __future__ import annotations

import random
from typing import Any

from reroll.envs.parsing import integer


class GuessNumberEnv:
    """Guess a hidden integer from higher/lower feedback; reward 1 for finding it.

    Args:
        low: smallest possible number.
        high: largest possible number.
        max_turns: guesses per episode.
        noise: share of the scripted expert's careless moves (or episodes).
        careless: a careless move is `random` (anywhere in range) or `scan` (the lowest number
            still possible).
        noise_scope: `move` (each move careless with probability noise) or `episode` (whole
            episodes careless).
    """

    def __init__(self, low: int = 1, high: int = 16, max_turns: int = 6, noise: float = 0.0,
                 careless: str = "random", noise_scope: str = "move"):
        if not low < high:
            raise ValueError(f"guess_number: low ({low}) must be below high ({high})")
        if careless not in ("random", "scan"):
            raise ValueError(f"guess_number: careless must be 'random' or 'scan', not {careless!r}")
        if noise_scope not in ("move", "episode"):
            raise ValueError(f"guess_number: noise_scope must be 'move' or 'episode', "
                             f"not {noise_scope!r}")
        self.low, self.high, self.max_turns, self.noise = low, high, max_turns, noise
        self.careless, self.noise_scope = careless, noise_scope
        self.rng = random.Random(0)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self.target = self.rng.randint(self.low, self.high)
        self.lo, self.hi, self.turn = self.low, self.high, 0
        self.careless_episode = self.noise_scope == "episode" and self.rng.random() < self.noise
        return (f"Guess my number between {self.low} and {self.high}. Reply with one number.",
                {"target": self.target})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        guess = integer(action)
        info: dict[str, Any] = {"turn": self.turn, "success": False}
        if guess is None:
            obs = "Invalid: reply with a number."
        elif guess == self.target:
            info["success"] = True
            return "Correct!", 1.0, True, False, info
        elif guess < self.target:
            self.lo = max(self.lo, guess + 1)
            obs = f"{guess} is too low. Higher."
        else:
            self.hi = min(self.hi, guess - 1)
            obs = f"{guess} is too high. Lower."
        return obs, 0.0, False, self.turn >= self.max_turns, info

    def expert_action(self) -> str:
        careless = self.careless_episode if self.noise_scope == "episode" \
            else self.rng.random() < self.noise
        if careless:
            if self.careless == "scan":
                return str(self.lo)
            return str(self.rng.randint(self.low, self.high))
        return str((self.lo + self.hi) // 2)

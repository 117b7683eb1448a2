"""Text-grid puzzles: frozen lake and sokoban. Moves are `up`, `down`, `left`, `right`; the
observation is the grid. Each seed generates a solvable level; the expert follows a shortest
solution found by breadth-first search."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from reroll.envs.parsing import word

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
HOW = "Reply with one move: up, down, left or right."


def _bfs(start, neighbours, done) -> list[str] | None:
    """Shortest list of moves from `start` to a state where `done(state)`, or None."""
    parents: dict[Any, tuple[Any, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if done(state):
            path = []
            while parents[state] is not None:
                state, move = parents[state]
                path.append(move)
            return path[::-1]
        for move, nxt in neighbours(state):
            if nxt not in parents:
                parents[nxt] = (state, move)
                queue.append(nxt)
    return None


class FrozenLakeEnv:
    """Walk from S to G on a size x size lake without stepping into a hole H (not slippery).

    Args:
        size: side of the square grid.
        holes: chance that a cell is a hole (levels are regenerated until solvable).
        max_turns: moves per episode.
    """

    def __init__(self, size: int = 4, holes: float = 0.2, max_turns: int = 10):
        self.size, self.holes, self.max_turns = size, holes, max_turns

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        while True:
            cells = [["F"] * self.size for _ in range(self.size)]
            for r in range(self.size):
                for c in range(self.size):
                    if rng.random() < self.holes:
                        cells[r][c] = "H"
            cells[0][0], cells[-1][-1] = "S", "G"
            self.grid, self.pos, self.turn = cells, (0, 0), 0
            if self._solution() is not None:
                break
        return f"{self._render()}\n{HOW}", {}

    def _next(self, pos, move):
        r, c = pos[0] + MOVES[move][0], pos[1] + MOVES[move][1]
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else pos

    def _solution(self) -> list[str] | None:
        def neighbours(pos):
            return [(m, n) for m in MOVES if self.grid[(n := self._next(pos, m))[0]][n[1]] != "H"]
        return _bfs(self.pos, neighbours, lambda p: self.grid[p[0]][p[1]] == "G")

    def _render(self) -> str:
        rows = [["P" if (r, c) == self.pos else ch for c, ch in enumerate(row)]
                for r, row in enumerate(self.grid)]
        return "\n".join("".join(row) for row in rows)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        move = word(action, tuple(MOVES))
        if move is None:
            return f"Invalid move.\n{self._render()}\n{HOW}", 0.0, False, \
                self.turn >= self.max_turns, {"success": False}
        self.pos = self._next(self.pos, move)
        cell = self.grid[self.pos[0]][self.pos[1]]
        if cell == "H":
            return "You fell into a hole.", 0.0, True, False, {"success": False}
        if cell == "G":
            return "You reached the goal!", 1.0, True, False, {"success": True}
        return self._render(), 0.0, False, self.turn >= self.max_turns, {"success": False}

    def expert_action(self) -> str:
        path = self._solution()
        return path[0] if path else "up"


class SokobanEnv:
    """Push the box B onto the target T (player P, walls #). A box on the target shows as *.

    Args:
        size: side of the square grid, walls included.
        max_turns: moves per episode.
        max_solution: longest shortest solution of a generated level (levels are
            regenerated until one fits).
    """

    def __init__(self, size: int = 6, max_turns: int = 12, max_solution: int = 8):
        self.size, self.max_turns, self.max_solution = size, max_turns, max_solution

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        inner = [(r, c) for r in range(1, self.size - 1) for c in range(1, self.size - 1)]
        while True:
            self.player, self.box, self.target = rng.sample(inner, 3)
            self.turn = 0
            path = self._solution()
            if path and len(path) <= self.max_solution:
                break
        return f"{self._render()}\n{HOW}", {}

    def _wall(self, pos) -> bool:
        return not (0 < pos[0] < self.size - 1 and 0 < pos[1] < self.size - 1)

    def _move(self, state, move):
        player, box = state
        d = MOVES[move]
        nxt = (player[0] + d[0], player[1] + d[1])
        if self._wall(nxt):
            return state
        if nxt == box:
            pushed = (box[0] + d[0], box[1] + d[1])
            return state if self._wall(pushed) else (nxt, pushed)
        return nxt, box

    def _solution(self) -> list[str] | None:
        def neighbours(state):
            return [(m, self._move(state, m)) for m in MOVES]
        return _bfs((self.player, self.box), neighbours, lambda s: s[1] == self.target)

    def _render(self) -> str:
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                pos = (r, c)
                row += ("#" if self._wall(pos) else "*" if pos == self.box == self.target
                        else "B" if pos == self.box else "P" if pos == self.player
                        else "T" if pos == self.target else ".")
            rows.append(row)
        return "\n".join(rows)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        move = word(action, tuple(MOVES))
        over = self.turn >= self.max_turns
        if move is None:
            return f"Invalid move.\n{self._render()}\n{HOW}", 0.0, False, over, {"success": False}
        self.player, self.box = self._move((self.player, self.box), move)
        if self.box == self.target:
            return "Solved!", 1.0, True, False, {"success": True}
        if self._solution() is None:  # box stuck in a corner or against a wall
            return f"{self._render()}\nThe box is stuck.", 0.0, True, False, {"success": False}
        return self._render(), 0.0, False, over, {"success": False}

    def expert_action(self) -> str:
        path = self._solution()
        return path[0] if path else "up"

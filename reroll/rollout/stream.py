"""The prompt stream the rollout sources draw from: the sampler's endless order, plus rows handed
back (launched but not used: aborted by over-sampling) that come first next time, so a step
consumes exactly the rows it used, whatever the timing. Its state is checkpointed."""

from __future__ import annotations

from reroll.data.datasets import PromptRow, PromptSampler


class PromptStream:
    def __init__(self, sampler: PromptSampler):
        self.sampler = sampler
        self.carry: list[PromptRow] = []
        self._index = {id(row): i for i, row in enumerate(sampler.rows)}

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> PromptRow:
        if self.carry:
            return self.carry.pop(0)
        return self.sampler.next_batch(1)[0]

    def next_batch(self, size: int) -> list[PromptRow]:
        return [next(self) for _ in range(size)]

    def push_front(self, rows: list[PromptRow]) -> None:
        """Rows to hand out again first, in this order."""
        self.carry[:0] = rows

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "carry": [self._index[id(r)] for r in self.carry]}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "carry"})
        self.carry = [self.sampler.rows[i] for i in state.get("carry", [])]

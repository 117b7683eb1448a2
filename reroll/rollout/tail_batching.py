"""Tail batching (RollPacker): keep long responses out of the regular rounds.

A synchronous round waits for its longest response; with a long-tailed length distribution most
of the round is spent decoding a few stragglers at a tiny batch size. Here a regular round runs
with a length budget: a group with a response that reaches the budget is aborted there and its
prompt deferred; prompts seen to run long on earlier epochs are deferred before they start.
Deferred prompts wait until there are enough of them for a dedicated long round, which runs
them together with the full `max_new_tokens`, so the long decodes share one well-filled batch.
Deferring is not filtering: a regular round runs more waves until its batch is full
(`reroll.rollout.scheduler.SyncSource._regular_round`), so tail batching delivers as many samples as plain rounds.
"""

from __future__ import annotations

from collections.abc import Iterator

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow
from reroll.rollout.groups import Group
from reroll.rollout.stream import PromptStream


class TailBatcher:
    def __init__(self, length_budget: int, use_history: bool = True):
        self.budget = length_budget
        self.use_history = use_history
        self.long_rows: list[PromptRow] = []
        self.longest: dict[str, int] = {}
        """Longest response seen per prompt (keyed by the row's source, file:line)."""
        self.deferred_total = 0

    def long_round_due(self, num_groups: int) -> bool:
        return len(self.long_rows) >= num_groups

    def regular_rows(self, stream: PromptStream) -> Iterator[PromptRow]:
        """The stream's rows, minus those known to run past the budget (deferred on the way)."""
        skipped = 0
        for row in stream:
            if self.use_history and self.known_long(row):
                self.defer(row)
                skipped += 1
                if skipped > len(stream.sampler.rows):
                    raise ConfigError(
                        f"every prompt of data.train ran past tail_batching.length_budget "
                        f"({self.budget} tokens) on an earlier epoch, so a regular round has "
                        f"nothing to run: raise the budget or turn tail_batching off")
                continue
            skipped = 0
            yield row

    def known_long(self, row: PromptRow) -> bool:
        return self.longest.get(row.source, 0) >= self.budget

    def hand_back(self, rows: list[PromptRow], stream: PromptStream) -> None:
        """Rows a long round launched but did not use: the known-long ones wait for the next long
        round (first), the others go back to the stream."""
        self.long_rows[:0] = [row for row in rows if self.known_long(row)]
        stream.push_front([row for row in rows if not self.known_long(row)])

    def long_round_rows(self, stream: Iterator[PromptRow]) -> Iterator[PromptRow]:
        """The deferred rows first (oldest first), then the stream if a long round needs more."""
        while self.long_rows:
            yield self.long_rows.pop(0)
        yield from stream

    def too_long(self, group: Group) -> bool:
        return any(s.finish_reason == "length" and len(s.tokens) >= self.budget
                   for s in group.samples)

    def defer(self, row: PromptRow) -> None:
        self.long_rows.append(row)
        self.deferred_total += 1

    def observe(self, groups: list[Group]) -> None:
        for group in groups:
            longest = max((len(s.tokens) for s in group.samples), default=0)
            self.longest[group.row.source] = longest

    def metrics(self) -> dict[str, float]:
        return {"tail/deferred_waiting": float(len(self.long_rows)),
                "tail/deferred_total": float(self.deferred_total)}

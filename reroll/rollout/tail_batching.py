"""Tail batching (RollPacker): keep long responses out of the regular rounds.

A synchronous round waits for its longest response; with a long-tailed length distribution most
of the round is spent decoding a few stragglers at a tiny batch size. Here a regular round runs
with a length budget: a group with a response that reaches the budget is aborted there and its
prompt deferred; prompts seen to run long on earlier epochs are deferred before they start.
Deferred prompts wait until there are enough of them for a dedicated long round, which runs
them together with the full `max_new_tokens`, so the long decodes share one well-filled batch.
Deferring is not filtering: a regular round runs more waves until its batch is full
(`reroll.rollout.scheduler.SyncSource._regular_round`), so tail batching delivers as many samples as plain rounds.

The asynchronous producer has no rounds (`AsyncTail`): each group runs under the budget, one that
reaches it is set aside with its prompt, and once a step's worth of prompts waits they are
launched one after the other with the full `max_new_tokens`, so their long decodes share the
engine's batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import replace

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow
from reroll.engines.base import SamplingParams
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


class AsyncTail:
    """Tail batching on the asynchronous producer (`reroll.rollout.async_source`). A group runs
    with `max_new_tokens` capped at the budget; one with a response that reaches it is set aside
    (not trained, its launch index skipped) and its prompt waits. A prompt known to run long (an
    earlier epoch) waits without running. Once `per_step` prompts wait, they are launched next,
    under new indices, with the full `max_new_tokens`. Waiting prompts keep their first launch
    index: a checkpoint owes them under it (`waiting_groups`)."""

    def __init__(self, batcher: TailBatcher, per_step: int):
        self.batcher, self.per_step = batcher, per_step
        self.waiting: list[tuple[int, PromptRow]] = []
        """Set-aside prompts (launch index, row), fewer than `per_step`."""
        self.due: deque[tuple[int, PromptRow]] = deque()
        """A step's worth of set-aside prompts, to be launched long next."""
        self.long: set[int] = set()
        """Indices of the groups running with the full `max_new_tokens`."""
        self.long_groups = 0

    def next_long(self) -> PromptRow | None:
        """The next due prompt to launch long (the caller gives it a new index: `launched`)."""
        return self.due.popleft()[1] if self.due else None

    def launched_long(self, index: int) -> None:
        self.long.add(index)
        self.long_groups += 1

    def sets_aside_known(self, index: int, row: PromptRow) -> bool:
        """Whether the prompt is known to run long, and so set aside instead of launched."""
        if not (self.batcher.use_history and self.batcher.known_long(row)):
            return False
        self._set_aside(index, row)
        return True

    def params(self, index: int, params: SamplingParams) -> SamplingParams:
        if index in self.long:
            return params
        return replace(params, max_new_tokens=min(self.batcher.budget, params.max_new_tokens))

    def sets_aside(self, group: Group) -> bool:
        """After the group ran: whether it reached the budget and was set aside."""
        self.batcher.observe([group])
        if group.index in self.long:
            self.long.discard(group.index)
            return False
        if not self.batcher.too_long(group):
            return False
        self._set_aside(group.index, group.row)
        return True

    def _set_aside(self, index: int, row: PromptRow) -> None:
        self.waiting.append((index, row))
        self.batcher.deferred_total += 1
        if len(self.waiting) >= self.per_step:
            self.due.extend(self.waiting)
            self.waiting.clear()

    def waiting_groups(self) -> list[tuple[int, PromptRow]]:
        return [*self.due, *self.waiting]

    def metrics(self) -> dict[str, float]:
        return {"tail/deferred_waiting": float(len(self.waiting) + len(self.due)),
                "tail/deferred_total": float(self.batcher.deferred_total),
                "tail/long_groups": float(self.long_groups)}

"""The prompt stream the rollout sources draw from: the sampler's endless order, plus rows handed
back (launched but not used: aborted by over-sampling) that come first next time, so a step
consumes exactly the rows it used, whatever the timing. Its state is checkpointed. A row becomes
the prompt's token ids with `encode_prompt`."""

from __future__ import annotations

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow, PromptSampler


def encode_prompt(tokenizer, row: PromptRow, max_tokens: int) -> list[int]:
    """Chat-templated prompt ids, ending with the assistant turn's header."""
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if len(ids) > max_tokens:
        raise ConfigError(f"{row.source}: the prompt is {len(ids)} tokens after the chat template, "
                          f"over data.max_prompt_tokens={max_tokens}")
    return ids


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

    def row_id(self, row: PromptRow) -> int:
        """The row's place in the data (what a checkpoint keeps of it)."""
        return self._index[id(row)]

    def row(self, row_id: int) -> PromptRow:
        return self.sampler.rows[row_id]

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "carry": [self.row_id(r) for r in self.carry]}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "carry"})
        self.carry = [self.sampler.rows[i] for i in state.get("carry", [])]

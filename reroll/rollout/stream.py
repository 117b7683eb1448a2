"""The prompt stream the rollout sources draw from: the sampler's endless order, plus rows handed
back (launched but not used: aborted by over-sampling) that come first next time, so a step
consumes exactly the rows it used, whatever the timing. Its state is checkpointed. A row becomes
the prompt's token ids with `encode_prompt` (an `EncodedPrompt` when the model needs more inputs
than tokens: images)."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow, PromptSampler
from reroll.data.mixing import DomainMixer


@dataclass
class EncodedPrompt:
    """A prompt as the model takes it: its token ids and its model inputs beyond tokens (an
    image's `pixel_values`, `image_grid_thw`...: the processor's output for this one prompt, each
    tensor with a first dimension `reroll.data.batch.collate` can concatenate along). They travel
    together: Request, the rollout's group, Trajectory, the batch, the trainer's forward."""

    ids: list[int]
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list = field(default_factory=list)
    """The PIL images the processor took, in order: an engine that runs the processor itself
    (vLLM) takes these, not the pixel values."""

    @classmethod
    def of(cls, prompt: list[int] | EncodedPrompt) -> EncodedPrompt:
        """A text prompt's ids (what `encode_prompt` returns) or an encoded prompt, as one."""
        return prompt if isinstance(prompt, EncodedPrompt) else cls(list(prompt))


def encode_prompt(tokenizer, row: PromptRow, max_tokens: int) -> list[int] | EncodedPrompt:
    """Chat-templated prompt ids, ending with the assistant turn's header; for a row with images,
    an `EncodedPrompt` (`encode_image_prompt`)."""
    if row.has_images:
        return encode_image_prompt(tokenizer, row, max_tokens)
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    _check_length(ids, row, max_tokens)
    return ids


def encode_image_prompt(tokenizer, row: PromptRow, max_tokens: int) -> EncodedPrompt:
    """A row with images through the model's own processor (in the tokenizer's model folder):
    its chat template, the image tokens it expands, and its model inputs (pixel values...),
    each kept with its leading batch dimension of 1, so a batch of prompts concatenates them
    along it (`reroll.data.batch.model_kwargs`)."""
    from reroll.data.images import load_images

    processor = _processor(tokenizer.name_or_path)
    if processor is None:
        raise ConfigError(f"{row.source}: the row has images, and the model "
                          f"{tokenizer.name_or_path} has no image processor (a text-only model)")
    text = processor.apply_chat_template(row.messages, add_generation_prompt=True,
                                         tokenize=False)
    images = load_images(row.messages)
    encoded = processor(text=[text], images=[images], return_tensors="pt")
    ids = encoded["input_ids"][0].tolist()
    _check_length(ids, row, max_tokens)
    return EncodedPrompt(ids, {k: v for k, v in encoded.items()
                               if k not in ("input_ids", "attention_mask")}, images)


@functools.cache
def _processor(path: str):
    """The model folder's processor when it has one that takes images (None otherwise)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError):
        return None
    return processor if hasattr(processor, "image_processor") else None


def save_processor(model_path: str, directory) -> None:
    """The model's image processor beside a checkpoint's tokenizer (nothing for a text model), so
    a checkpoint of a vision-language run encodes image rows as its start did."""
    processor = _processor(model_path)
    if processor is not None:
        processor.save_pretrained(directory)


def _check_length(ids: list[int], row: PromptRow, max_tokens: int) -> None:
    if len(ids) > max_tokens:
        raise ConfigError(f"{row.source}: the prompt is {len(ids)} tokens after the chat template, "
                          f"over data.max_prompt_tokens={max_tokens}")


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


class MixedStream:
    """The async producer's rows over several streams (domains, environments): each block of
    `per_step` groups is split by the mixer as a synchronous step would be, stream by stream, and
    each stream gives its own rows. A row is `(k, the stream's row)`; its id (what a checkpoint
    keeps of an owed group) is `[k, the row's index]`. The trainer's thread updates the mixer
    (`observe`) under `lock` while the producer's draws from it."""

    def __init__(self, streams: list[PromptStream], mixer: DomainMixer, per_step: int):
        self.streams, self.mixer, self.per_step = streams, mixer, per_step
        self.block: list[int] = []
        """The streams of the rest of the current block's groups, in order."""
        self.lock = threading.Lock()

    def __iter__(self) -> MixedStream:
        return self

    def __next__(self) -> tuple[int, Any]:
        with self.lock:
            if not self.block:
                counts = self.mixer.counts(self.per_step)
                self.block = [k for k, n in enumerate(counts) for _ in range(n)]
            k = self.block.pop(0)
        return k, next(self.streams[k])

    def observe(self, k: int, value: float) -> None:
        with self.lock:
            self.mixer.observe(k, value)

    def row_id(self, row: tuple[int, Any]) -> list[int]:
        k, own = row
        return [k, self.streams[k].row_id(own)]

    def row(self, row_id: list[int]) -> tuple[int, Any]:
        k, index = row_id
        return k, self.streams[k].row(index)

    def state_dict(self) -> dict:
        with self.lock:
            return {"block": list(self.block), "mixer": self.mixer.state_dict(),
                    "streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        self.block = list(state["block"])
        self.mixer.load_state_dict(state["mixer"])
        for stream, saved in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(saved)

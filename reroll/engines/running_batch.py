"""The running batch of the transformers engine (`reroll.engines.hf`): its rows and the tensors
they decode over (one left-padded KV cache), and how rows join, leave, repeat and are compacted
between decoding steps."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from reroll.engines.base import Request, SamplingParams

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class Row:
    """One request, from submission to completion."""

    request: Request
    generator: torch.Generator | None = None
    future: asyncio.Future | None = None
    """None in the synchronous path (`generate_batch`)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weights version of each token's logits (in-flight updates change it mid-request)."""
    logits_version: int = 0
    """The version that computed the row's next-token logits, waiting to be sampled."""
    finish: str | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    routing: list[torch.Tensor] = field(default_factory=list)
    """With `record_routing`: the experts routed for each token the model has seen of this row,
    in chunks of [tokens, layers, top_k] (the prompt, then one per fed token)."""


@dataclass
class Batch:
    """Rows decoding together over one KV cache.

    The cache is left-padded: row i's real columns are where `attention[i]` is 1, always a suffix
    (every row appends one column per step). `DynamicCache()` built without a config holds one
    `DynamicLayer` per model layer, whose `keys`/`values` are [B, heads, L, head_dim]."""

    params: SamplingParams
    rows: list[Row]
    cache: DynamicCache
    attention: torch.Tensor
    """[B, L] 1 on a row's real cache columns, 0 on padding."""
    next_position: torch.Tensor
    """[B, 1] the position id of each row's next token."""
    logits: torch.Tensor
    """[B, V] each row's next-token logits, ready to sample."""


def left_padded(prompts: list[tuple[int, ...]], pad_token_id: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention) [N, longest prompt], prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        input_ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[j, width - len(p):] = 1
    return input_ids.to(device), attention.to(device)


def gather_rows(batch: Batch, index: torch.Tensor) -> None:
    """Row i of the batch's tensors becomes its row `index[i]`: drops rows, or repeats one (a
    shared prompt's KV). The caller keeps `batch.rows` in step."""
    batch.cache.batch_select_indices(index)
    batch.attention = batch.attention[index]
    batch.next_position = batch.next_position[index]
    batch.logits = batch.logits[index]


def row_apart(batch: Batch, j: int) -> Batch:
    """Row `j` of the batch in a one-row batch of its own: copies of its real KV columns (a
    suffix), attention, next position and logits."""
    from reroll.engines.kv_cache import growing_cache

    real = int(batch.attention[j].sum())
    cache = growing_cache()
    for i, layer in enumerate(batch.cache.layers):
        cache.update(layer.keys[j:j + 1, :, -real:].clone(),
                     layer.values[j:j + 1, :, -real:].clone(), i)
    return Batch(batch.params, [batch.rows[j]], cache, batch.attention[j:j + 1, -real:].clone(),
                  batch.next_position[j:j + 1].clone(), batch.logits[j:j + 1].clone())


def crop_padding(batch: Batch) -> None:
    """Drop the leading cache columns that are padding for every row. The rows that needed them
    have left; a long-running batch would otherwise keep them (and attend over them) forever."""
    first_real = int(batch.attention.argmax(-1).min())  # argmax: the first 1 of each row
    if first_real == 0:
        return
    for layer in batch.cache.layers:
        layer.keys = layer.keys[:, :, first_real:]
        layer.values = layer.values[:, :, first_real:]
    batch.attention = batch.attention[:, first_real:]


def merge_batches(running: Batch, joining: Batch) -> Batch:
    """The running batch with the joining rows added after its own. The shorter cache is
    left-padded (zero K/V, attention 0) to the longer one's length; positions are per row, so
    the padding shifts nothing."""
    width = max(running.attention.shape[1], joining.attention.shape[1])
    for mine, theirs in zip(running.cache.layers, joining.cache.layers, strict=True):
        mine.stack(theirs, width)
    running.attention = torch.cat([pad_left(running.attention, width, 1),
                                   pad_left(joining.attention, width, 1)])
    running.next_position = torch.cat([running.next_position, joining.next_position])
    running.logits = torch.cat([running.logits, joining.logits])
    running.rows = running.rows + joining.rows
    return running


def pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros prepended along `dim` up to `width`."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

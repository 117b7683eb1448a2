"""Shared-prefix packing: the samples of a GRPO group share their prompt, so forward it once.

A batch of right-padded rows [prompt_i | response_i] in which k rows share the same prompt P is
repacked as one row per group, [P | response_1 | ... | response_k], with

- position ids that restart at len(P) for every response (as if each followed P alone), and
- an attention mask in which a response token sees P and the earlier tokens of its own
  response, never another response's.

Every token's hidden state, and so its logprob, is then the one the padded batch gives (up to
float rounding), while the prompt's forward and backward run once per group instead of k times,
and the padding after short responses disappears. With 8 samples of a 37-token prompt and
~19-token responses (padded to 32), a group costs 189 tokens instead of 552.

The prefix of a row is everything before its first response token, so multi-turn rows (with
environment tokens inside the response) pack too; rows whose prefix no other row shares stay
rows of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reroll.models.attention import GQA_SDPA

MASKED_ATTENTION = {"sdpa": torch.bool, GQA_SDPA: torch.bool, "eager": None}
"""Attention implementations that take an arbitrary 4D mask as-is, with the mask dtype they
want (None: an additive float mask in the model's dtype). Others (flash-attention kernels that
only know padding) fall back to the padded batch."""


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [G, T] one row per group, right-padded
    position_ids: torch.Tensor  # [G, T]
    segments: torch.Tensor  # [G, T] 0: the shared prefix, i >= 1: the i-th response, -1: padding
    source_row: torch.Tensor  # [N] for each scored token: its packed row ...
    source_col: torch.Tensor  # [N] ... and the packed position whose logits predict it
    target_row: torch.Tensor  # [N] where it lives in the original batch: row ...
    target_col: torch.Tensor  # [N] ... and position
    target_ids: torch.Tensor  # [N] the token itself

    def attention_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[G, 1, T, T]: query q sees key k <= q of the prefix or of its own response (and with a
        sliding `window`, only keys fewer than `window` positions back, counted in position ids,
        which are the original rows' positions). Padding queries see themselves (a row of nothing
        would make NaNs that leak into the backward)."""
        seg = self.segments
        width = seg.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        padding = seg < 0
        allowed = causal & same & ~padding[:, None, :] & ~padding[:, :, None]
        if window is not None:
            distance = self.position_ids[:, :, None] - self.position_ids[:, None, :]
            allowed &= distance < window
        allowed |= torch.eye(width, dtype=torch.bool, device=seg.device) & padding[:, :, None]
        allowed = allowed[:, None]
        if dtype == torch.bool:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)


def sliding_window(config) -> int | None:
    """The sliding attention window `config` uses, or None. Mistral declares only
    `sliding_window`; Qwen2/3 set it with `use_sliding_window` (and may turn it off); Gemma 2/3,
    Qwen2/3 say per layer in `layer_types` which layers slide."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether `model` attends with a custom 4D mask exactly as packing needs: an attention
    implementation that takes such a mask, and layers that are full or sliding-window attention
    (the packed mask carries the window, `packed_masks`), nothing else (chunked, linear...)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in MASKED_ATTENTION:
        return False
    kinds = set(getattr(config, "layer_types", None) or ())
    return kinds <= {"full_attention", "sliding_attention"}


def packed_masks(config, packed: PackedBatch, dtype: torch.dtype
                 ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` argument for a packed forward: one 4D mask, or for models whose
    layers mix full and sliding attention one per layer type (transformers takes such a dict
    as-is). A 4D mask replaces the model's own masks, so the window must be in it."""
    window = sliding_window(config)
    if window is None:
        return packed.attention_mask(dtype)
    if getattr(config, "layer_types", None) is None:  # Mistral: every layer slides
        return packed.attention_mask(dtype, window)
    return {"full_attention": packed.attention_mask(dtype),
            "sliding_attention": packed.attention_mask(dtype, window)}


def pack_shared_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         response_mask: torch.Tensor, hidden_size: int = 0, pad_id: int = 0
                         ) -> PackedBatch | None:
    """The packing of a right-padded batch, or None when no two rows share a prefix, or none
    would pack at a saving (`_chunks`, for a model of `hidden_size`; 0 counts attention only).
    Rows without a response token are left out (nothing to score)."""
    device = input_ids.device
    # The bookkeeping below reads the batch token by token: from one copy in host memory, not
    # with a wait for the GPU at every read.
    tokens, attention_mask, response_mask = (t.cpu() for t in (input_ids, attention_mask,
                                                                 response_mask))
    lengths = attention_mask.sum(-1).tolist()
    has_response = response_mask.any(-1).tolist()
    starts = response_mask.float().argmax(-1).tolist()
    groups: dict[tuple, list[int]] = {}
    for row, (start, scored) in enumerate(zip(starts, has_response, strict=True)):
        if scored and start > 0:  # a response needs a token before it to be predicted from
            groups.setdefault(tuple(tokens[row, :start].tolist()), []).append(row)
        elif scored:
            return None
    packs = [(prefix, chunk) for prefix, rows in groups.items()
             for chunk in _chunks(len(prefix), rows, lengths, input_ids.shape[1], hidden_size)]
    if all(len(rows) == 1 for _, rows in packs):
        return None

    packed_rows, position_rows, segment_rows = [], [], []
    source_row, source_col, target_row, target_col = [], [], [], []
    for g, (prefix, rows) in enumerate(packs):
        start = len(prefix)
        ids, positions, segments = list(prefix), list(range(start)), [0] * start
        for member, row in enumerate(rows, start=1):
            length = lengths[row]
            offset = len(ids)  # packed position of this response's first token
            ids += tokens[row, start:length].tolist()
            positions += range(start, length)
            segments += [member] * (length - start)
            # Token t of the row is predicted from t - 1: the prefix's last token for the first
            # response token, the response's own previous token after that.
            target_row += [row] * (length - start)
            target_col += range(start, length)
            source_row += [g] * (length - start)
            source_col += [start - 1] + list(range(offset, offset + length - start - 1))
        packed_rows.append(ids)
        position_rows.append(positions)
        segment_rows.append(segments)

    width = max(len(ids) for ids in packed_rows)

    def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long)

    target_row_t = torch.tensor(target_row, dtype=torch.long, device=device)
    target_col_t = torch.tensor(target_col, dtype=torch.long, device=device)
    return PackedBatch(
        padded(packed_rows, pad_id).to(device), padded(position_rows, 0).to(device),
        padded(segment_rows, -1).to(device),
        torch.tensor(source_row, dtype=torch.long, device=device),
        torch.tensor(source_col, dtype=torch.long, device=device),
        target_row_t, target_col_t, input_ids[target_row_t, target_col_t])


def _chunks(prefix: int, rows: list[int], lengths: list[int], width: int, hidden_size: int
            ) -> list[list[int]]:
    """`rows` (sharing a `prefix`-token prompt) split into packs, in order, each grown while a
    member costs fewer FLOPs packed than as a padded row of `width` tokens.

    Per layer, a token costs ~24 h^2 FLOPs in the linear layers (2 x ~12 h^2 weights) and a
    (query, key) pair ~4 h in attention, which the dense mask makes pay for the whole square of
    the packed row. A member of s response tokens saves width - s tokens (its prompt and
    padding) and adds (T + s)^2 - T^2 - width^2 pairs to a pack of T tokens, so it joins when
    6 h (width - s) >= that. Short responses to a long prompt pack whole; 4k-token responses
    to a short prompt stay rows of their own (and the T x T mask stays small)."""
    chunks: list[list[int]] = []
    packed = 0  # tokens in the last chunk's packed row
    for row in rows:
        response = lengths[row] - prefix
        added_pairs = (packed + response) ** 2 - packed ** 2 - width ** 2
        if chunks and 6 * hidden_size * (width - response) >= added_pairs:
            chunks[-1].append(row)
            packed += response
        else:
            chunks.append([row])
            packed = prefix + response
    return chunks

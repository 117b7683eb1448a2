"""Attention for reroll's transformers models: `GQA_SDPA`, transformers' `sdpa` with grouped
key/value heads shared inside SDPA, and decoding attention per range of rows.

Both the HF engine (`reroll.engines.hf`) and shared-prefix packing (`reroll.models.packing`)
rely on it taking an arbitrary 4D mask as-is.
"""

from __future__ import annotations

import torch

GQA_SDPA = "reroll_sdpa_gqa"


def share_kv_heads_in_sdpa(model: torch.nn.Module) -> None:
    """Switch a model that uses transformers' `sdpa` attention to `GQA_SDPA`: the same, except
    that grouped key/value heads are shared inside SDPA (`enable_gqa`) even under a padding mask.
    transformers copies them to every query head (`repeat_kv`) whenever there is a mask, which
    for a decoding batch is a copy of the whole KV cache per layer and step: ~10x slower
    attention on CPU at 190 rows x 420 columns, 43 ms vs 4 ms."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_SDPA, sdpa_sharing_kv_heads)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)


def sdpa_sharing_kv_heads(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, row_segments: tuple | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (query [B, H, q, D], key/value [B, H_kv, k, D]) -> [B, q, H, D].

    With `row_segments` ((first row, end row, first column), ...: see `decode_row_segments`), a
    decoding step attends over each range of rows separately, from its first used column on."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if row_segments is not None and query.shape[2] == 1:
        outputs = [torch.nn.functional.scaled_dot_product_attention(
            query[a:b], key[a:b, :, s:], value[a:b, :, s:], scale=scaling, enable_gqa=grouped,
            attn_mask=None if attention_mask is None else attention_mask[a:b, :, :, s:])
            for a, b, s in row_segments]
        return torch.cat(outputs).transpose(1, 2).contiguous(), None
    if not grouped or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                      is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=causal, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def decode_row_segments(attention: torch.Tensor, close: int = 32, most: int = 4) -> tuple | None:
    """Contiguous ranges of a decoding batch's rows, each with the first cache column one of its
    rows uses: ((first row, end row, first column), ...), at most `most` of them. None when
    one range over every column would do.

    Rows join in cohorts, right-aligned to the batch's width, so a cohort of short newcomers
    starts far to the right of the long rows it joined; attending per range skips the padding
    columns that every newcomer would otherwise read (a batch's KV reads are most of a decoding
    step on CPU). Rows start a new range when their first column is more than `close` from the
    current range's; the closest neighbouring ranges are merged down to `most`."""
    starts = attention.argmax(-1).tolist()  # each row's first 1
    ranges = [[0, 1, starts[0]]]
    for row, start in enumerate(starts[1:], start=1):
        if abs(start - ranges[-1][2]) <= close:
            ranges[-1][1], ranges[-1][2] = row + 1, min(start, ranges[-1][2])
        else:
            ranges.append([row, row + 1, start])
    while len(ranges) > most:
        i = min(range(len(ranges) - 1), key=lambda j: abs(ranges[j][2] - ranges[j + 1][2]))
        merged = ranges.pop(i + 1)
        ranges[i][1], ranges[i][2] = merged[1], min(ranges[i][2], merged[2])
    if len(ranges) == 1 and ranges[0][2] == 0:
        return None
    return tuple(tuple(r) for r in ranges)

"""The HF engine's KV cache: a transformers `DynamicCache` whose layers grow in place.

Each layer's keys and values are views into zeroed buffers with room to grow: columns at the end,
so a decoding step writes one column instead of copying the whole cache (`torch.cat`), and spare
rows, so requests joining the batch are written into them instead of the whole cache being copied
into a larger one (under asynchronous training, where requests join all the time, that copy was
23% of the engine's time). Buffers start zeroed, so the padding that masked positions read is
always finite. Rows are left-padded: a row's real columns are a suffix of the window.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def growing_cache() -> DynamicCache:
    """A DynamicCache of `GrowingLayer`s."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are the first rows and a window of columns of
    `buffers` ([keys, values], each [rows, heads, columns, head_dim] with room to spare).
    Anything that replaces `keys`/`values` (cropping the front) is picked up at the next update."""

    buffers: list[torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, new = key_states.shape[0], key_states.shape[-2]
        window = self._window()
        if window is None or window[1] + new > self.buffers[0].shape[-2]:
            length = self.get_seq_length()
            # Keep spare rows, but no more than `_spare` would add to the rows in use.
            capacity = rows if window is None else min(self.buffers[0].shape[0], rows + _spare(rows))
            self.buffers = [_grown(current, states, length, length + new, capacity)
                            for current, states in ((self.keys, key_states),
                                                    (self.values, value_states))]
            window = (0, length)
        start, end = window
        for buffer, states in zip(self.buffers, (key_states, value_states), strict=True):
            buffer[:rows, :, end:end + new] = states
        self._show(rows, start, end + new)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (in that order, repeats allowed), moved to the front of the
        buffers when they fit."""
        window = self._window()
        if window is None:
            return super().batch_select_indices(indices)
        start, end = window
        if len(indices) > self.buffers[0].shape[0]:
            self.buffers = [_with_spare_rows(buffer[indices]) for buffer in self.buffers]
        else:
            for buffer in self.buffers:
                buffer[:len(indices), :, start:end] = buffer[indices, :, start:end]
        self._show(len(indices), start, end)

    def stack(self, other: DynamicLayer, width: int) -> None:
        """Append `other`'s rows after this layer's, both right-aligned in `width` columns
        (zeros before). Into the spare rows when the buffers have enough, and room on the left to
        widen to `width` (only `other` is copied); else into new buffers."""
        rows, joining = self.keys.shape[0], other.keys.shape[0]
        pairs = ((self.keys, other.keys), (self.values, other.values))
        window = self._window()
        if window is None or self.buffers[0].shape[0] < rows + joining or window[1] < width:
            self.buffers = [_stacked(mine, theirs, width) for mine, theirs in pairs]
            self._show(rows + joining, 0, width)
            return
        end = window[1]
        for buffer, (_, theirs) in zip(self.buffers, pairs, strict=True):
            own = theirs.shape[2]
            buffer[rows:rows + joining, :, end - width:end - own] = 0
            buffer[rows:rows + joining, :, end - own:end] = theirs
        self._show(rows + joining, end - width, end)

    def _show(self, rows: int, start: int, end: int) -> None:
        """Point keys/values at the first `rows` rows and columns [start, end) of the buffers."""
        self.keys, self.values = (buffer[:rows, :, start:end] for buffer in self.buffers)

    def _window(self) -> tuple[int, int] | None:
        """(start, end) columns of keys/values within the buffers, or None when they are not
        views of them (no buffers yet, or replaced by something else)."""
        if self.buffers is None or not self.keys.numel():
            return None
        starts = set()
        for tensor, buffer in zip((self.keys, self.values), self.buffers, strict=True):
            if (tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
                    or tensor.shape[0] > buffer.shape[0] or tensor.stride() != buffer.stride()):
                return None
            starts.add((tensor.storage_offset() - buffer.storage_offset()) // buffer.stride(2))
        if len(starts) != 1:
            return None
        start = starts.pop()
        return start, start + self.keys.shape[-2]


def _spare(size: int) -> int:
    """Room added when a cache buffer grows to `size` (columns or rows): half again, >= 64."""
    return max(64, size // 2)


def _grown(current: torch.Tensor, incoming: torch.Tensor, length: int, needed: int, rows: int
           ) -> torch.Tensor:
    """A zeroed buffer shaped like `incoming` but with `rows` rows and room for `needed` columns
    and more (`_spare`), holding `current`'s `length` columns at the start (`current` is empty
    before the first update)."""
    buffer = incoming.new_zeros((rows, incoming.shape[1], needed + _spare(needed),
                                 incoming.shape[-1]))
    if length:
        buffer[:current.shape[0], :, :length] = current
    return buffer


def _with_spare_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` ([B, ...]) in a zeroed buffer with spare rows after its own."""
    buffer = tensor.new_zeros((tensor.shape[0] + _spare(tensor.shape[0]), *tensor.shape[1:]))
    buffer[:tensor.shape[0]] = tensor
    return buffer


def _stacked(first: torch.Tensor, second: torch.Tensor, width: int) -> torch.Tensor:
    """[first; second] ([B, H, k, D] each) along the batch, each right-aligned in `width`
    columns (zeros before it), in a zeroed buffer with spare rows and columns (`_spare`)."""
    rows, total = first.shape[0], first.shape[0] + second.shape[0]
    out = first.new_zeros((total + _spare(total), first.shape[1], width + _spare(width),
                           first.shape[3]))
    out[:rows, :, width - first.shape[2]:width] = first
    out[rows:total, :, width - second.shape[2]:width] = second
    return out

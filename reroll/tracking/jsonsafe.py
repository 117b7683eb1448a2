"""Strict JSON for every file the project writes (metrics.jsonl, summary.json, rollouts, eval
results): a non-finite float (NaN, +-inf) is written as `null`, never as the bare `NaN` /
`Infinity` that Python's json module emits by default and other JSON readers reject."""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts, lists and tuples) replaced by None;
    numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (dict, list, tuple, str)):
        try:
            value = value.item()
        except (TypeError, ValueError):  # a tensor of several elements: leave it to json
            pass
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that writes non-finite floats as null (and refuses any it missed)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)

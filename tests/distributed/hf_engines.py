"""Test helpers: the HF engine over a model directory, built by the package's own `build_engine`
(so a factory of it pickles by reference into a Ray actor)."""

from __future__ import annotations

from collections.abc import Callable

from reroll.config.schema import RolloutConfig
from reroll.engines import build_engine, engine_factory
from reroll.engines.base import Engine
from reroll.models.loading import load_tokenizer


def build_hf_engine(model_path: str) -> Engine:
    return build_engine(RolloutConfig(), model_path, pad_token_id=_pad(model_path))


def hf_engine_factory(model_path: str) -> Callable[[], Engine]:
    return engine_factory(RolloutConfig(), model_path, pad_token_id=_pad(model_path))


def _pad(model_path: str) -> int:
    return load_tokenizer(model_path).pad_token_id

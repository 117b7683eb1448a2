"""Load a causal LM and its tokenizer from a local folder (or a hub id, with network)."""

from __future__ import annotations

from pathlib import Path

import torch

from reroll.config.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    _check_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ConfigError(f"model.path {path}: the tokenizer has no chat template")
    return tokenizer


def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    _check_path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False  # training forwards never need the KV cache
    return model


def _check_path(path: str) -> None:
    looks_local = path.startswith((".", "/", "~")) or Path(path).exists() or path.count("/") != 1
    if looks_local and not (Path(path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path {path}: no Hugging Face model there (config.json missing); "
                          f"build one with `reroll make-model --out {path}`")

"""Load a causal LM and its tokenizer from a local folder (or a hub id, with network)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from reroll import settings
from reroll.config.errors import ConfigError
from reroll.models.files import model_dir_problem, shape_mismatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _clear_load_errors(what: str):
    """A load from a broken folder (bad config.json, torn weights, weights of another shape, a
    corrupt tokenizer) becomes one ConfigError naming the folder or the file, not a traceback."""
    def wrap(load):
        @functools.wraps(load)
        def checked(path: str, *args, **kwargs):
            _check_path(path)
            problem = model_dir_problem(Path(path).expanduser()) if Path(path).is_dir() else None
            if problem:
                raise ConfigError(f"model.path {path}: {problem}")
            try:
                return load(path, *args, **kwargs)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - anything from reading the user's files
                raise ConfigError(f"model.path {path}: {_load_failure(path, what, e)}") from None
        return checked
    return wrap


def _load_failure(path: str, what: str, error: Exception) -> str:
    if "mismatch" in str(error):
        with contextlib.suppress(Exception):
            return shape_mismatch(Path(path)) or str(error)
    detail = (str(error).strip().splitlines() or [""])[0][:300]
    return f"cannot load the {what} ({type(error).__name__}: {detail})"


@_clear_load_errors("tokenizer")
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    _check_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ConfigError(f"model.path {path}: the tokenizer has no chat template")
    return tokenizer


@_clear_load_errors("model")
def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    _check_path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.config.use_cache = False  # training forwards never need the KV cache
    return model


def _check_path(path: str) -> None:
    local = Path(path).expanduser()
    if not local.exists() and path.count("/") == 1 and not path.startswith((".", "/", "~")) \
            and settings.allow_hub():
        return  # a hub id, fetched by transformers (opted in with REROLL_ALLOW_HUB=1)
    if not (local / "config.json").is_file():
        hub = (f"; to download the hub model {path!r}, set {settings.ALLOW_HUB}=1"
               if path.count("/") == 1 and not local.exists() else "")
        raise ConfigError(f"model.path {path}: no Hugging Face model there (config.json missing); "
                          f"build one with `reroll make-model --out {path}`{hub}")

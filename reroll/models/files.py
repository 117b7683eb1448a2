"""Checks of a model folder's files before transformers reads them, so a broken folder is one
message naming the file (transformers' own errors for a torn safetensors file or a bad
config.json are tracebacks that do not say which file, or which folder)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from reroll import settings
from reroll.config.errors import ConfigError
from reroll.models.hints import is_run_output, missing_model_hint

ADAPTER_CONFIG = "adapter_config.json"
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def is_adapter_dir(path: str | Path) -> bool:
    """A folder holding a PEFT adapter (a LoRA run's checkpoint) rather than a full model."""
    local = Path(path).expanduser()
    return (local / ADAPTER_CONFIG).is_file() and not (local / "config.json").is_file()


def model_path_problem(path: str) -> str | None:
    """Why `path` is no model to load (None: a model or adapter folder, or a hub id with
    downloads allowed). Reads no weights and imports neither torch nor transformers, so a
    command refuses a wrong path at once, not after a minute of imports (under load)."""
    local = Path(path).expanduser()
    if not local.exists() and path.count("/") == 1 and not path.startswith((".", "/", "~")) \
            and settings.allow_hub():
        return None  # a hub id, fetched by transformers (opted in with REROLL_ALLOW_HUB=1)
    if is_adapter_dir(local):
        return None
    if not (local / "config.json").is_file():
        hub = (f"; if {path!r} is a hub id, set {settings.ALLOW_HUB}=1 to download it"
               if path.count("/") == 1 and not local.parent.exists() and not is_run_output(path)
               else "")
        return f"no Hugging Face model there (config.json missing); {missing_model_hint(path)}{hub}"
    return model_dir_problem(local)


def check_model_path(path: str, field: str = "model.path") -> None:
    """`model_path_problem` as a ConfigError naming `field`."""
    problem = model_path_problem(path)
    if problem:
        raise ConfigError(f"{field} {path}: {problem}")


def share_like_siblings(folder: Path) -> None:
    """Give the files of a model folder just written the mode new files get (0666 less the
    umask): transformers writes `model.safetensors` through a private temporary file, 0600,
    while its siblings (config, tokenizer) are 0644."""
    mask = os.umask(0)
    os.umask(mask)
    for file in Path(folder).iterdir():
        if file.is_file():
            file.chmod(0o666 & ~mask)


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file, or None. Reads the header only: the data
    must end exactly where the header's last tensor ends."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return "is truncated (its header runs past the end of the file)"
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "is not a readable safetensors file"
    expected = 8 + length + end
    return None if expected == size else f"is truncated ({size} of {expected} bytes)"


def read_config(path: Path) -> tuple[dict | None, str | None]:
    """(config.json's contents, None) or (None, why it cannot be read)."""
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    if not isinstance(data, dict):
        return None, "is not a JSON object"
    return data, None


def model_dir_problem(path: Path) -> str | None:
    """The first broken file of a local model folder, as `FILE: what is wrong`, or None."""
    _, problem = read_config(path)
    if problem:
        return f"{path / 'config.json'} {problem}"
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            return f"{weights} {problem}"
    return None


def model_context(path: str | Path) -> int | None:
    """The longest sequence (prompt + response) the model at `path` was built for, from its
    config.json; None when the folder is not local or declares none."""
    data, _ = read_config(Path(path)) if Path(path).is_dir() else (None, None)
    for section in (data or {}, (data or {}).get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


def vocab_size(path: Path) -> int | None:
    """The size of the embedding the model at `path` declares (config.json's `vocab_size`, or
    its text model's), or None."""
    data, _ = read_config(path)
    for section in (data or {}, (data or {}).get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int) and section["vocab_size"] > 0:
            return section["vocab_size"]
    return None


def shape_mismatch(path: Path) -> str | None:
    """The first weight whose shape in the safetensors files differs from the one config.json
    gives it (the model is built on the meta device: no memory), or None."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name in expected and info["shape"] != expected[name]:
                return (f"{shard} holds {name} with shape {info['shape']}, but config.json "
                        f"makes it {expected[name]}")
    return None

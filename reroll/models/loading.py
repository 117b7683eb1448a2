"""Load a causal LM and its tokenizer from a local folder (or a hub id, with network).

Every role loads its model through `load_model`, which makes two choices the same way for all:
- dropout is switched off (the trainer's forward must give the logprobs the engine sampled with;
  GPT-2's 0.1 dropout put them ~2 nats apart), and
- the attention implementation keeps every attention feature the config declares: transformers'
  `sdpa` silently drops Gemma 2's attention logit soft-capping, so `auto` picks `eager` there
  and an explicit choice that would drop a feature is refused (`attention_problems`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from reroll.config.errors import ConfigError
from reroll.models.files import model_path_problem, shape_mismatch, vocab_size
from reroll.models.lora import adapter_base_path, is_adapter_dir, merge_adapter_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Attention features a config can declare, and the implementations that honour each. Sliding
# windows are kept by every implementation transformers has (sdpa and eager through the mask);
# reroll's own packed masks apply them too (models/packing.py).
FEATURE_IMPLEMENTATIONS = {
    "attn_logit_softcapping": {"eager", "flex_attention", "flash_attention_2",
                               "flash_attention_3"},
}


class ModelDirError(ConfigError):
    """What is wrong with a model folder; the loaders name the folder by the config key it was
    given as (`field=`), so the message is made there."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"model.path {path}: {problem}")
        self.path, self.problem = path, problem


def _clear_load_errors(what: str):
    """A load from a broken folder (bad config.json, torn weights, weights of another shape, a
    corrupt tokenizer) becomes one ConfigError naming the folder or the file, not a traceback.

    The loaders take `field=`: the config key the folder was given as (`model.path` unless
    said, e.g. `reward.model` for a judge), which the error names."""
    def wrap(load):
        @functools.wraps(load)
        def checked(path: str, *args, field: str = "model.path", **kwargs):
            try:
                problem = model_path_problem(path)
                if problem:
                    raise ModelDirError(path, problem)
                return load(path, *args, **kwargs)
            except ModelDirError as e:
                raise ConfigError(f"{field} {e.path}: {e.problem}") from None
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - anything from reading the user's files
                raise ConfigError(f"{field} {path}: {_load_failure(path, what, e)}") from None
        return checked
    return wrap


def _load_failure(path: str, what: str, error: Exception) -> str:
    if "mismatch" in str(error):
        with contextlib.suppress(Exception):
            return shape_mismatch(Path(path)) or str(error)
    detail = (str(error).strip().splitlines() or [""])[0][:300]
    return f"cannot load the {what} ({type(error).__name__}: {detail})"


@_clear_load_errors("tokenizer")
def load_tokenizer(path: str, fits_embedding: bool = True):
    """The tokenizer at `path`, with a pad token and a chat template. `fits_embedding`: one with
    more tokens than the model's embedding (of the adapter's base model for an adapter folder)
    is refused, as `reroll check-model` fails it: a token id past the embedding crashes the
    forward at its first use (check-model passes False to report it among its checks)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ModelDirError(path, "the tokenizer has no chat template")
    model_dir = Path(adapter_base_path(path) if is_adapter_dir(path) else path).expanduser()
    embedding = vocab_size(model_dir) if model_dir.is_dir() else None
    if fits_embedding and embedding is not None and len(tokenizer) > embedding:
        raise ModelDirError(path, f"the tokenizer has {len(tokenizer)} tokens, more than the "
                                  f"{embedding} of the model's embedding (vocab_size in "
                                  f"{model_dir / 'config.json'}): it is not this model's "
                                  f"tokenizer (`reroll check-model` checks it)")
    return tokenizer


def declared_attention_features(config) -> list[str]:
    """The attention features `config` turns on that not every implementation honours."""
    return [name for name in FEATURE_IMPLEMENTATIONS if getattr(config, name, None) is not None]


def attention_problems(config, implementation: str) -> list[str]:
    """Why `implementation` would not compute the attention `config` declares (empty: fine)."""
    return [f"{config.model_type} declares {name}={getattr(config, name)}, which "
            f"{implementation!r} ignores (use one of {sorted(FEATURE_IMPLEMENTATIONS[name])})"
            for name in declared_attention_features(config)
            if implementation not in FEATURE_IMPLEMENTATIONS[name]]


def choose_attention(config, requested: str = "auto") -> str:
    """The attention implementation to load with: `requested`, or for `auto` sdpa unless the
    config declares a feature sdpa drops (then eager). A choice that drops one is a ConfigError."""
    if requested == "auto":
        return "sdpa" if not attention_problems(config, "sdpa") else "eager"
    problems = attention_problems(config, requested)
    if problems:
        raise ConfigError(f"model.attn_implementation: {'; '.join(problems)}")
    return requested


def without_dropout(config) -> list[str]:
    """Set every dropout probability of `config` (attention_dropout, resid_pdrop, ...) to 0;
    returns the names that were non-zero."""
    changed = []
    for name, value in list(config.to_dict().items()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and value:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def disable_dropout(model: torch.nn.Module) -> int:
    """p = 0 in every dropout module (some read their rate from places a config does not reach);
    returns how many had p > 0."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            count += 1
    return count


def refuse_unservable(config, path: str) -> None:
    """A ConfigError, with the reason, for a model reroll cannot train as a policy: one that is
    not a decoder-only causal LM transformers knows (encoder-decoders, encoders, classifiers)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        raise ModelDirError(path, f"{config.model_type} is an encoder-decoder model; reroll "
                                  "trains decoder-only causal LMs (the policy generates its "
                                  "response after the prompt in one sequence)")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not is_vision_language(config):
        raise ModelDirError(path, f"transformers has no causal LM for model_type "
                                  f"{config.model_type!r}, so reroll cannot generate from or "
                                  "train it")


@_clear_load_errors("model")
def load_model(path: str, dtype: str = "float32", attn_implementation: str = "auto",
               dropout: bool = False) -> torch.nn.Module:
    """The causal LM at `path` in `dtype`, dropout off unless `dropout`, with an attention
    implementation that keeps its attention features (`choose_attention`). A LoRA adapter
    folder (a LoRA run's checkpoint) loads as its base model with the adapter merged."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    if is_adapter_dir(path):
        base = load_model(adapter_base_path(path), dtype, attn_implementation, dropout)
        return merge_adapter_dir(base, path)
    config = AutoConfig.from_pretrained(path)
    refuse_unservable(config, path)
    if not dropout:
        without_dropout(config)
    implementation = choose_attention(config, attn_implementation)
    auto = AutoModelForCausalLM
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and is_vision_language(config):
        from transformers import AutoModelForImageTextToText as auto
    model = auto.from_pretrained(path, config=config, dtype=DTYPES[dtype],
                                 attn_implementation=implementation)
    if not dropout:
        disable_dropout(model)
    model.config.use_cache = False  # training forwards never need the KV cache
    return model


def is_vision_language(config) -> bool:
    """Whether `config` is a vision-language model transformers generates text with (Idefics3,
    Qwen2-VL...): loaded as `AutoModelForImageTextToText`, its prompts carry images
    (docs/vlm.md)."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


@_clear_load_errors("model")
def load_scalar_model(path: str, dtype: str = "float32", attn_implementation: str = "auto",
                      pad_token_id: int | None = None) -> torch.nn.Module:
    """A causal LM at `path` (or a reward model saved by `reroll rm`) as
    `AutoModelForSequenceClassification` with one output: the backbone's weights, a new scalar
    head when `path` has none. Dropout off; `pad_token_id` recorded in its config, which
    transformers' own forward needs to find a sequence's last token."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    refuse_unservable(config, path)
    without_dropout(config)
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=DTYPES[dtype],
        attn_implementation=choose_attention(config, attn_implementation))
    disable_dropout(model)
    model.config.use_cache = False
    return model

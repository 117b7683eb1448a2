"""Build a small Hugging Face causal LM and its tokenizer locally, with no downloads.

The model is a randomly initialised Qwen2. The tokenizer is a byte-level BPE trained with the
`tokenizers` library and built exactly like transformers' `Qwen2Tokenizer` (same normaliser,
pre-tokeniser regex and decoder): transformers 5.x loads `model_type=qwen2` tokenizers through
that class, which rebuilds the pipeline from vocab and merges, so any other pre-tokeniser would be
silently replaced and the ids would change between saving and loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from reroll.models.files import share_like_siblings

# The split regex of transformers' Qwen2Tokenizer: digits are single tokens, which suits arithmetic.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# ChatML, as Qwen models use; generation stops at <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 1024


PRESETS = {
    # ~1M parameters: trains and samples fast on 2 CPU cores; the default for tests and the demo.
    "tiny": ModelPreset(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4,
                        num_kv_heads=2, intermediate_size=384),
    # ~30M parameters: for benchmarks at a size where compute, not overhead, dominates.
    "small": ModelPreset(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8,
                         num_kv_heads=4, intermediate_size=1408, max_positions=2048),
}


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen2's pre-tokenisation, trained on `corpus`."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def make_tokenizer(corpus: Iterable[str], vocab_size: int):
    """Wrap the trained tokenizer as a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(corpus, vocab_size),
        bos_token=None, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN,
        additional_special_tokens=[BOS_TOKEN], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def architecture_config(architecture: str, sizes: dict, tokens: dict, **extra):
    """A transformers config of `architecture` (a model_type) at the preset's `sizes`, with the
    architecture's own names for them and its own features switched on small enough to matter
    in short sequences (sliding windows of 16 tokens, Gemma 2's soft-capping, MoE routing)."""
    from transformers import AutoConfig

    h, layers, heads, kv = (sizes["hidden_size"], sizes["num_layers"], sizes["num_heads"],
                            sizes["num_kv_heads"])
    common = dict(vocab_size=tokens["vocab_size"], bos_token_id=tokens["bos_token_id"],
                  eos_token_id=tokens["eos_token_id"], pad_token_id=tokens["pad_token_id"],
                  tie_word_embeddings=True)
    llama_like = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=sizes["intermediate_size"],
                      max_position_embeddings=sizes["max_positions"], **common)
    per_architecture = {
        "qwen2": llama_like, "llama": llama_like, "olmo2": llama_like, "phi3": llama_like,
        "qwen3": dict(llama_like, head_dim=h // heads),
        "qwen3_moe": dict(llama_like, head_dim=h // heads, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=sizes["intermediate_size"] // 2),
        "mistral": dict(llama_like, sliding_window=16, head_dim=h // heads),
        "gemma2": dict(llama_like, head_dim=h // heads, sliding_window=16,
                       query_pre_attn_scalar=h // heads),
        "gemma3_text": dict(llama_like, head_dim=h // heads, sliding_window=16,
                            query_pre_attn_scalar=h // heads, sliding_window_pattern=2),
        "gpt2": dict(n_embd=h, n_layer=layers, n_head=heads, n_positions=sizes["max_positions"],
                     n_inner=sizes["intermediate_size"], **common),
        "gpt_neox": dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=sizes["intermediate_size"],
                         max_position_embeddings=sizes["max_positions"], **common),
    }
    if architecture not in per_architecture:
        raise ValueError(f"unknown architecture {architecture!r} "
                         f"(choose from {sorted(per_architecture)})")
    return AutoConfig.for_model(architecture, **per_architecture[architecture], **extra)


def make_model(out: str | Path, preset: str = "tiny", corpus: Iterable[str] | None = None,
               seed: int = 0, architecture: str = "qwen2", config_overrides: dict | None = None,
               **overrides: int) -> Path:
    """Write a random-init causal LM and a locally trained tokenizer to `out` (HF format).

    `corpus` is the tokenizer's training text (default: the built-in arithmetic task's text).
    `architecture` is a transformers model_type (`architecture_config` lists those set up here;
    qwen2 by default). `overrides` replace preset sizes (e.g. hidden_size=256),
    `config_overrides` the architecture's own config fields (e.g. sliding_window=8).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {sorted(PRESETS)})")
    sizes = {**PRESETS[preset].__dict__, **overrides}
    if corpus is None:
        from reroll.data.tasks import tokenizer_corpus

        corpus = tokenizer_corpus(seed=seed)
    tokenizer = make_tokenizer(corpus, sizes["vocab_size"])
    config = architecture_config(architecture, sizes, dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        dtype="float32", **(config_overrides or {}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return save_new_model(model, tokenizer, tokenizer, out)


def save_new_model(model, tokenizer, files, out: str | Path) -> Path:
    """A freshly built model written to `out` with `files` (its tokenizer, or the processor
    that holds it), generation stopping at the tokenizer's eos and padding with its pad token."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    files.save_pretrained(out)
    share_like_siblings(out)
    return out

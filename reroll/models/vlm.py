"""Build a tiny vision-language model and its processor locally, with no downloads.

The model is a randomly initialised Idefics3 (the architecture of SmolVLM): a SigLIP vision
tower, a pixel-shuffle connector and a Llama text model. Its processor is transformers' own
`Idefics3Processor` with the PIL image processor and the locally trained tokenizer of
`reroll.models.factory`, so `AutoProcessor.from_pretrained` loads it as it loads a hub VLM.

Why Idefics3 and not Qwen2-VL: this venv has no torchvision (it would pull another torch), and
transformers' Qwen2-VL processor cannot be built without it (its video processor), while
Idefics3's processor takes the PIL image processor alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from reroll.models.factory import BOS_TOKEN, make_tokenizer, save_new_model

IMAGE_TOKEN, FAKE_IMAGE_TOKEN = "<image>", "<fake_token_around_image>"
VLM_SPECIAL_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 64, 16, 2
"""Images are resized to 64x64 (one crop, no splitting): 16 patches, 4 image tokens."""

# ChatML, with `{"type": "image"}` content parts as the processor's image placeholder.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_vlm(out: str | Path, corpus: Iterable[str] | None = None, seed: int = 0,
             vocab_size: int = 1024, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """Write a random-init Idefics3 (~0.5M parameters at the defaults) and its processor
    (image processor, tokenizer, chat template) to `out` (HF format)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    if corpus is None:
        from reroll.data.tasks import tokenizer_corpus

        corpus = tokenizer_corpus(seed=seed)
    tokenizer = make_tokenizer(corpus, vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [BOS_TOKEN, *VLM_SPECIAL_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    edge = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    image_seq_len = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_len=image_seq_len, chat_template=VLM_CHAT_TEMPLATE)
    tokens = dict(bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden_size,
                         max_position_embeddings=1024, tie_word_embeddings=True, **tokens),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
        scale_factor=SCALE_FACTOR, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=True, dtype="float32", **tokens)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    return save_new_model(model, tokenizer, processor, out)

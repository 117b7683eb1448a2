import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.unit

TEXTS = [
    "Sam has 13 apples. Sam gets 4 more apples. How many? Put the final answer in \\boxed{}.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé, emoji 🙂 and digits 1234567890",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_tokenizer_round_trip_through_auto_tokenizer(tiny_model):
    # transformers maps model_type=qwen2 to Qwen2Tokenizer, which rebuilds the pipeline from
    # vocab+merges: the saved tokenizer.json and AutoTokenizer must still agree token for token.
    raw = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    auto = AutoTokenizer.from_pretrained(tiny_model)
    for text in TEXTS:
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert auto.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345", add_special_tokens=False))
    assert pieces == ["1", "2", "3", "4", "5"]


def test_chat_template_and_special_tokens(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_model_reloads_offline_with_identical_outputs(tiny_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.model_type == "qwen2"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 5, 9, 42]])
    assert torch.equal(model(ids).logits, again(ids).logits)


def test_unknown_preset(tmp_path):
    from reroll.models.factory import make_model

    with pytest.raises(ValueError, match="unknown preset"):
        make_model(tmp_path, "huge")


def test_missing_model_path_is_a_config_error(tmp_path):
    from reroll.config import ConfigError
    from reroll.models.loading import load_model

    with pytest.raises(ConfigError, match="reroll make-model"):
        load_model(str(tmp_path / "absent"))


def test_a_made_models_files_all_get_the_same_mode(tiny_model):
    """model.safetensors was 0600 (transformers' private temporary file), its siblings 0644."""
    from pathlib import Path

    modes = {f.name: f.stat().st_mode & 0o777 for f in Path(tiny_model).iterdir()}
    assert len(set(modes.values())) == 1, modes

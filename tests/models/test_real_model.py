"""A real pretrained model (SmolLM2-135M-Instruct from its package's GGUF) as a first-class
citizen: imported, checked, and refused with the file named when its directory is broken."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open

from reroll.config.errors import ConfigError
from reroll.models.gguf import describe_gguf, import_gguf, resolve_gguf

pytestmark = pytest.mark.e2e


def reroll(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reroll.cli", *args], capture_output=True,
                          text=True, timeout=900)


def test_import_keeps_weights_tokenizer_and_template(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert config.model_type == "llama" and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    with safe_open(f"{smollm2}/model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)


def test_check_model_passes_on_smollm2(smollm2):
    result = reroll("check-model", smollm2, "--no-vllm")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["passed"] and summary["architecture"] == "llama"
    assert {c["name"] for c in summary["checks"] if c["status"] == "pass"} >= {
        "tokenizer", "chat_template", "attention", "engine_greedy", "logprobs_padded",
        "logprobs_packed", "weight_sync"}


@pytest.mark.parametrize("breakage,named", [
    ("no_tokenizer", "no tokenizer files"),
    ("corrupt_weights", "model.safetensors"),
    ("corrupt_config", "config.json"),
])
def test_broken_model_directory_is_exit_2_naming_the_file(tiny_model, tmp_path, breakage, named):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    if breakage == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (broken / name).unlink()
    elif breakage == "corrupt_weights":
        data = (broken / "model.safetensors").read_bytes()
        (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
    else:
        (broken / "config.json").write_text('{"model_type": "qwen2", ')
    result = reroll("check-model", str(broken), "--no-vllm")
    assert result.returncode == 2, result.stdout + result.stderr
    squeezed = "".join(result.stderr.split())  # rich wraps long lines
    assert "".join(named.split()) in squeezed and "Traceback" not in result.stderr


def test_a_gguf_that_cannot_be_read_is_a_clear_error(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        import_gguf(str(junk), tmp_path / "out")
    with pytest.raises(ConfigError, match="no such file"):
        resolve_gguf(str(tmp_path / "missing.gguf"))


def test_the_packaged_gguf_is_described():
    architecture, types = describe_gguf(resolve_gguf("smollm2-135m-instruct"))
    assert architecture == "llama" and "Q4_1" in types

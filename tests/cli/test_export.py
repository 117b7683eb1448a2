"""`reroll export` and `reroll eval` on a LoRA checkpoint (the adapter only, in PEFT's format):
the merged export is a plain transformers model holding exactly the trainer's merged weights."""

import json
import os
import shutil
import stat

import pytest
import torch

from reroll.cli import main
from reroll.config.lora import LoRAConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate
from reroll.models.loading import load_model, load_tokenizer
from reroll.pipelines import objective
from reroll.training.local import LocalStrategy

pytestmark = pytest.mark.unit


@pytest.fixture
def lora_run(tiny_model, tmp_path):
    """A run directory whose step_2 checkpoint holds a trained (non-zero) adapter, and the
    trainer's merged weights at that step."""
    strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(lr=5e-2),
                             TrainConfig(micro_batch_size=4), 10, lora=LoRAConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    rows = [Trajectory(torch.randint(3, 200, (6,), generator=g).tolist(),
                       torch.randint(3, 200, (5,), generator=g).tolist(), [0.0] * 5, "stop",
                       group_id=i) for i in range(4)]
    batch = collate(rows, 0)[0]
    run = tmp_path / "run"
    for n in (1, 2):
        strategy.train_step(batch, objective.sft_loss(batch))
        strategy.save(run / "checkpoints" / f"step_{n}", {"step": n})
        load_tokenizer(tiny_model).save_pretrained(run / "checkpoints" / f"step_{n}")
    return run, dict(strategy.state_dict_for_sync())


def test_export_merge_writes_the_trainers_merged_model(lora_run, tmp_path, capsys):
    run, merged = lora_run
    assert main(["export", "--merge", str(run), "--out", str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["exported"].endswith("step_2") and report["kind"] == "merged model"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    AutoTokenizer.from_pretrained(tmp_path / "out")
    weights = model.state_dict()
    assert not any("lora" in key for key in weights)
    for key, value in merged.items():
        assert torch.allclose(weights[key], value, atol=1e-6), key


def test_a_merged_export_is_readable_like_its_siblings(lora_run, tmp_path):
    """The merged model.safetensors was written 0600 (transformers' private temporary file)
    while config.json and the tokenizer were 0644."""
    run, _ = lora_run
    out = tmp_path / "out"
    assert main(["export", "--merge", str(run), "--out", str(out)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~mask, modes


def test_export_without_merge_copies_the_peft_adapter(lora_run, tmp_path):
    run, _ = lora_run
    assert main(["export", str(run / "checkpoints" / "step_1"), "--out", str(tmp_path / "a")]) == 0
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "trainer_state.pt" not in files


def test_export_refuses_a_folder_that_is_no_model_and_a_full_out_dir(lora_run, tmp_path, capsys):
    run, _ = lora_run
    assert main(["export", "--merge", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["export", "--merge", str(run), "--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert "neither a run directory" in err and "not empty" in err


def test_eval_accepts_an_adapter_checkpoint(lora_run, tmp_path, arithmetic, capsys):
    run, _ = lora_run
    checkpoint = run / "checkpoints" / "step_2"
    merged = tmp_path / "merged"
    assert main(["export", "--merge", str(checkpoint), "--out", str(merged)]) == 0
    results = {}
    for name, model in (("adapter", checkpoint), ("merged", merged)):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", str(model), "--task", arithmetic["eval"],
                     "--max-prompts", "4", "--max-new-tokens", "8", "--threads", "1",
                     "--out", str(out)]) == 0
        results[name] = [json.loads(line)["response"] for line in
                         out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert results["adapter"] == results["merged"]  # greedy: the same model, the same text
    shutil.rmtree(merged)

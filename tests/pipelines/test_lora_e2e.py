"""`model.lora` end to end on the tiny model: GRPO with a LoRA adapter raises the held-out reward
(the engine really samples from the trained adapter), a LoRA run with a KL term (reference =
adapter off) resumes exactly, SFT with LoRA writes a merged final model, and a target module the
model does not have is exit 2 naming it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_recipes_e2e import shared_warm_model

from reroll.config import load_config
from reroll.pipelines.rlvr import train
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def lora_rl_config(tmp_path: Path, warm: dict, **sections) -> dict:
    """test_rlvr_e2e's GRPO run with an adapter: LoRA takes a 10x higher learning rate."""
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 1, "steps": 12,
        "model": {"path": warm["model"], "lora": LORA},
        "data": {"train": warm["eval"], "eval": warm["eval"]},
        "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 24},
        "optimizer": {"lr": 3e-3}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": 6, "temperature": 1.0, "samples_per_prompt": 4},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        "tracking": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def test_grpo_with_lora_raises_the_held_out_reward(tmp_path, warm_model):
    """With the default `model.lora.sync: auto` the HF engine gets the adapter alone each step,
    and its fingerprint (checked every step) is the trainer's adapter's."""
    summary = train(load_config(write(tmp_path / "rl.yaml", lora_rl_config(tmp_path, warm_model))))
    rows = read_metrics(tmp_path / "run")
    assert all(r["weight_sync/adapter_fallbacks"] == 0 for r in rows)  # no step fell back
    full_bytes = (Path(warm_model["model"]) / "model.safetensors").stat().st_size
    assert all(0 < r["weight_sync/bytes"] < full_bytes / 5 for r in rows)  # the adapter alone
    early = sum(r["train/reward_mean"] for r in rows[:3]) / 3
    late = sum(r["train/reward_mean"] for r in rows[-3:]) / 3
    assert late > early + 0.08, (early, late)
    assert summary["eval_reward_end"] > summary["eval_reward_start"] + 0.05, summary
    final = Path(summary["final_checkpoint"])
    assert (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # the base weights are not copied
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_A" in k or "lora_B" in k for k in adapter)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())


def test_lora_run_with_a_kl_term_resumes_exactly(tmp_path, warm_model):
    data = lora_rl_config(tmp_path, warm_model, steps=6, checkpoint={"every_steps": 3},
                          algorithm={"kl": {"coef": 0.05}, "updates_per_batch": 2},
                          rollout={"prompts_per_step": 8, "group_size": 4},
                          train={"micro_batch_size": 16})
    train(load_config(write(tmp_path / "rl.yaml", data)))
    full = read_metrics(tmp_path / "run")
    assert any(r["actor/kl_ref"] > 0 for r in full)  # the adapter-off reference is in use

    interrupted = tmp_path / "interrupted"
    shutil.copytree(tmp_path / "run", interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_6")
    lines = (interrupted / "metrics.jsonl").read_text().splitlines()[:4]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data["output_dir"] = str(interrupted)
    summary = train(load_config(write(tmp_path / "resume.yaml", data), ["resume=true"]))
    assert summary["resumed_from_step"] == 3
    resumed = read_metrics(interrupted)
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if not k.startswith("time/")}, a["step"]


def test_sft_with_lora_lowers_the_nll_and_writes_a_merged_model(tmp_path, tiny_model,
                                                              arithmetic):
    config = write(tmp_path / "sft.yaml", {
        "pipeline": "sft", "output_dir": str(tmp_path / "sft"),
        "model": {"path": tiny_model, "lora": {"rank": 8, "alpha": 32}},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"],
                 "response_key": "solution"},
        "steps": 8, "batch_size": 16, "optimizer": {"lr": 1e-2},
        "train": {"micro_batch_size": 16}, "tracking": {"progress": False, "tensorboard": False}})
    summary = train_sft(load_config(config, expect="sft"))
    assert summary["eval_nll_end"] < summary["eval_nll_start"] - 0.05, summary
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(summary["final_model"])  # plain transformers
    base = load_file(Path(tiny_model) / "model.safetensors")
    weights = merged.state_dict()
    assert not any("lora" in k for k in weights)
    assert any(not torch.equal(base[k], weights[k]) for k in base if k in weights)


def test_unknown_lora_target_module_exits_2_naming_it(tmp_path, warm_model):
    config = write(tmp_path / "rl.yaml", lora_rl_config(tmp_path, warm_model, steps=1))
    result = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "train", str(config),
         "model.lora.target_modules=[q_proj,c_attn]"], capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "c_attn" in result.stderr and "q_proj, up_proj, v_proj" in result.stderr


def test_colocated_lora_policy_worker_reproduces_the_in_process_run(tmp_path, warm_model):
    """The policy behind a worker (colocated with the engine: they take turns) gives the same
    run as the in-process strategy, reference and merged-weight sync included."""
    runs = {}
    for name, distributed in (("plain", {}), ("colocated", {"rollout": {"colocate_with": "policy"}})):
        data = lora_rl_config(tmp_path / name, warm_model, steps=2, distributed=distributed,
                              algorithm={"kl": {"coef": 0.05}}, eval={"every_steps": 0},
                              rollout={"prompts_per_step": 4, "group_size": 4},
                              train={"micro_batch_size": 16})
        (tmp_path / name).mkdir()
        train(load_config(write(tmp_path / name / "rl.yaml", data)))
        runs[name] = [{k: v for k, v in r.items() if not k.startswith(("time/", "colocation/"))}
                      for r in read_metrics(tmp_path / name / "run")]
    assert runs["plain"] == runs["colocated"]

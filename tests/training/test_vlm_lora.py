"""LoRA on a vision-language model: adapters on the language model only by default, the vision
tower and its connector frozen; `model.lora.vision: true` puts them on the vision side too."""

from __future__ import annotations

import pytest

from reroll.config.lora import LoRAConfig
from reroll.data.images import write_count_task
from reroll.models.loading import load_model
from reroll.models.lora import LoRAAdapter, vision_module_names


def adapted(tiny_vlm, **lora) -> tuple:
    model = load_model(tiny_vlm)
    LoRAAdapter(model, LoRAConfig(rank=2, **lora))
    names = {name.rsplit(".lora_", 1)[0] for name, _ in model.named_parameters()
             if ".lora_" in name}
    return model, names


@pytest.mark.unit
def test_the_vision_tower_gets_no_adapter_and_stays_frozen(tiny_vlm):
    model, names = adapted(tiny_vlm)
    vision = [n for n, _ in model.named_parameters() if "vision_model" in n or "connector" in n]
    assert vision and names  # the language model has adapters, the vision side has parameters
    assert not any("vision_model" in n or "connector" in n for n in names), sorted(names)[:5]
    assert any("text_model" in n for n in names)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in vision)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())


@pytest.mark.unit
def test_lora_vision_true_adapts_the_vision_tower_too(tiny_vlm):
    model, names = adapted(tiny_vlm, vision=True)
    assert vision_module_names(load_model(tiny_vlm))
    assert any("vision_model" in n for n in names)


@pytest.mark.e2e
def test_a_lora_grpo_step_runs_on_the_tiny_vlm(tiny_vlm, tmp_path):
    """One GRPO step with an adapter: the engine's and the trainer's logprobs agree (the engine
    got the adapter), the update has a gradient, and the saved adapter is the language model's."""
    import reroll

    paths = write_count_task(tmp_path / "task", train_size=4, eval_size=2, seed=0)
    summary = reroll.train(
        {"name": "vlm-lora", "seed": 0, "steps": 1, "output_dir": str(tmp_path / "run"),
         "model": {"path": tiny_vlm, "lora": {"rank": 4}},
         "data": {"train": str(paths["train"])},
         "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
         "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4},
         "tracking": {"progress": False, "tensorboard": False}},
        reward_funcs=lambda s: float(len(s.response) % 3))
    row = summary.history()[-1]
    assert summary.steps == 1 and row["train/grad_norm"] > 0
    assert row["actor/behaviour_kl_k3"] < 1e-5

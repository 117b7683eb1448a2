"""LoRA on the policy (`model.lora`): only the adapter trains, the reference is the base model
with the adapter off, the engine gets (and the fingerprint check verifies) the merged weights,
checkpoints hold the PEFT adapter and resume exactly."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from reroll.config.errors import ConfigError
from reroll.config.lora import LoRAConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate
from reroll.distributed.weight_sync import InProcessSync
from reroll.engines.base import Request, SamplingParams, fingerprint
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs, forward_logprobs
from reroll.models.lora import linear_module_names
from reroll.pipelines import objective
from reroll.training.local import LocalStrategy
from reroll.training.protocols import AdapterOffReference

pytestmark = pytest.mark.unit


def lora_strategy(path: str, **lora) -> LocalStrategy:
    return LocalStrategy(load_model(path), OptimizerConfig(lr=5e-2), TrainConfig(micro_batch_size=4),
                         total_steps=10, lora=LoRAConfig(**({"rank": 4} | lora)))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [Trajectory(torch.randint(3, 200, (5 + i % 3,), generator=g).tolist(),
                       torch.randint(3, 200, (6,), generator=g).tolist(), [0.0] * 6, "stop",
                       group_id=i) for i in range(8)]
    return collate(rows, pad_token_id=0)[0]


def step(strategy: LocalStrategy, seed: int = 0) -> dict:
    b = batch(seed)
    return strategy.train_step(b, objective.sft_loss(b))


def test_only_adapter_parameters_get_gradients_and_optimizer_state(tiny_model):
    strategy = lora_strategy(tiny_model)
    before = {k: v.clone() for k, v in strategy.model.state_dict().items()}
    step(strategy)
    step(strategy, 1)
    trainable = {n for n, p in strategy.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for group in strategy.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in strategy.model.parameters() if p.requires_grad}
    assert set(map(id, strategy.optimizer.state)) <= optimized
    after = strategy.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)  # B starts at 0: the adapter is now non-zero


def test_reference_with_the_adapter_off_is_the_base_model(tiny_model):
    strategy = lora_strategy(tiny_model)
    step(strategy)
    b = batch(3)
    base = load_model(tiny_model)
    expected = batched_logprobs(base, b["input_ids"], b["attention_mask"], 4,
                                response_mask=b["response_mask"])
    reference = AdapterOffReference(strategy).logprobs(b)
    assert torch.equal(reference, expected)
    trained = strategy.forward_logprobs(b)
    assert not torch.allclose(trained, expected, atol=1e-4)  # the adapter does change the policy


def test_sync_gives_the_engine_the_merged_model(tiny_model, tokenizer):
    strategy = lora_strategy(tiny_model)
    for seed in range(3):
        step(strategy, seed)
    merged = dict(strategy.state_dict_for_sync())
    plain = load_model(tiny_model)
    assert sorted(merged) == sorted(plain.state_dict())
    engine = HFEngine(load_model(tiny_model), max_batch_size=8,
                      pad_token_id=tokenizer.pad_token_id)
    InProcessSync(strategy, engine)(1)  # raises WeightSyncError on a fingerprint mismatch
    assert engine.weights_fingerprint() == fingerprint(merged.items())
    assert engine.weights_fingerprint() != fingerprint(plain.state_dict().items())

    plain.load_state_dict(merged)  # the trainer's merged model, as transformers holds it
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)

    async def generate():
        return await asyncio.gather(*(engine.generate(Request(prompt, params, seed=s))
                                      for s in range(4)))

    for out in asyncio.run(generate()):
        ids = torch.tensor([out.prompt_ids + out.token_ids])
        response = slice(len(out.prompt_ids), ids.shape[1])
        engine_lp = torch.tensor(out.logprobs)
        merged_lp, _ = forward_logprobs(plain, ids, torch.ones_like(ids))
        assert torch.allclose(merged_lp[0, response], engine_lp, atol=1e-5)
        with torch.no_grad():  # the trainer's own (unmerged) forward agrees up to float noise
            lora_lp, _ = forward_logprobs(strategy.model.eval(), ids, torch.ones_like(ids))
        assert torch.allclose(lora_lp[0, response], engine_lp, atol=1e-4)


def test_unknown_target_module_is_an_error_listing_the_real_ones(tiny_model):
    with pytest.raises(ConfigError) as error:
        lora_strategy(tiny_model, target_modules=["q_proj", "query_key_value"])
    message = str(error.value)
    assert "'query_key_value'" in message and "model.lora.target_modules" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message
    assert "lm_head" not in message  # tied to the embeddings: not a valid target


def test_named_targets_adapt_only_those_layers(tiny_model):
    strategy = lora_strategy(tiny_model, target_modules=["q_proj", "self_attn.v_proj"])
    adapted = {n.split(".lora_")[0] for n, p in strategy.model.named_parameters()
               if p.requires_grad}
    assert adapted == {n for n in linear_module_names(load_model(tiny_model))
                       if n.endswith(("q_proj", "v_proj"))}


def test_checkpoint_is_a_peft_adapter_and_resume_is_exact(tiny_model, tmp_path):
    strategy = lora_strategy(tiny_model)
    step(strategy, 0)
    strategy.save(tmp_path / "ck", {"step": 1})
    files = {p.name for p in (tmp_path / "ck").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= files
    assert "model.safetensors" not in files
    base = json.loads((tmp_path / "ck" / "adapter_config.json").read_text())
    assert base["base_model_name_or_path"] == str(Path(tiny_model).resolve())
    continued = [step(strategy, s) for s in (1, 2)]

    resumed = lora_strategy(tiny_model)
    assert resumed.load(tmp_path / "ck") == {"step": 1}
    again = [step(resumed, s) for s in (1, 2)]
    assert continued == again
    for (name, a), (_, b) in zip(strategy.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_resuming_an_adapter_checkpoint_without_model_lora_is_a_config_error(tiny_model,
                                                                            tmp_path):
    """Issue 49: `model.lora=null` on a LoRA run's resume was a ValueError traceback."""
    lora_strategy(tiny_model).save(tmp_path / "ck", {})
    full = LocalStrategy(load_model(tiny_model), OptimizerConfig(), TrainConfig(), total_steps=1)
    with pytest.raises(ConfigError, match=r"model.lora is null, but checkpoint .*ck holds a "
                                          r"LoRA adapter"):
        full.load(tmp_path / "ck")


def test_adapter_checkpoint_loads_as_the_merged_model(tiny_model, tmp_path):
    strategy = lora_strategy(tiny_model)
    step(strategy, 0)
    strategy.save(tmp_path / "ck", {})
    strategy.save_model(tmp_path / "merged")
    merged = dict(strategy.state_dict_for_sync())
    for folder in ("ck", "merged"):  # adapter folder merged on load; merged folder as saved
        loaded = load_model(str(tmp_path / folder)).state_dict()
        assert sorted(loaded) == sorted(merged)
        for key, value in merged.items():
            assert torch.allclose(loaded[key], value, atol=1e-6), (folder, key)

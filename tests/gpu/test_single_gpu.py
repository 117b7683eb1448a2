"""The `gpu` tier: one CUDA device (two for NCCL). Skipped where torch sees no GPU; every
device decision behind these runs is also tested on CPU (tests/models/test_devices.py)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from reroll.config.schema import RLConfig
from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs
from reroll.pipelines import rlvr

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def grpo_config(tmp_path, model: str, data: dict, **sections) -> RLConfig:
    return RLConfig.model_validate({
        "name": "gpu", "output_dir": str(tmp_path / "run"), "steps": 3, "seed": 0,
        "model": {"path": model}, "data": {"train": data["train"], "eval": data["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "algorithm": {"kl": {"coef": 0.01}},
        "tracking": {"tensorboard": False}, **sections})


def test_single_gpu_grpo_puts_every_role_on_cuda(tmp_path, tiny_model, arithmetic):
    pipeline = rlvr.rlvr_pipeline(grpo_config(tmp_path, tiny_model, arithmetic))
    try:
        assert next(pipeline.step.policy.model.parameters()).is_cuda
        assert next(pipeline.step.roles.engine.model.parameters()).is_cuda
        assert next(pipeline.step.reference.cluster.executor.workers[0].model.parameters()).is_cuda
        summary = pipeline.run()
    finally:
        pipeline.close()
    assert summary["steps"] == 3
    assert torch.isfinite(torch.tensor(summary["eval_reward_end"]))


def test_hf_engine_on_cuda_matches_generate_and_the_trainer(tiny_model, tokenizer):
    model = load_model(tiny_model).cuda()
    engine = HFEngine(load_model(tiny_model).cuda(), 8, tokenizer.pad_token_id)
    prompt = tokenizer("1 + 2 =")["input_ids"]
    completion = asyncio.run(engine.generate(Request(prompt, SamplingParams(12, 0.0))))
    expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert list(completion.token_ids) == expected[0, len(prompt):].tolist()[:len(completion.token_ids)]
    ids = torch.tensor([prompt + list(completion.token_ids)])
    response = torch.zeros_like(ids, dtype=torch.float32)
    response[0, len(prompt):] = 1
    trainer = batched_logprobs(model, ids, torch.ones_like(ids), 1, 1.0, response)
    got = torch.tensor(completion.logprobs)
    assert torch.allclose(trainer[0, len(prompt):], got, atol=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2 GPUs")
def test_fsdp2_and_the_broadcast_sync_over_nccl(tmp_path, tiny_model, arithmetic):
    config = grpo_config(tmp_path, tiny_model, arithmetic, distributed={
        "executor": "ray", "weight_sync": "broadcast",
        "policy": {"num_workers": 2, "devices": [0, 1]},
        "rollout": {"num_workers": 1, "devices": [1]}})
    summary = rlvr.train(config)
    assert summary["steps"] == 3


def test_vllm_on_cuda_runs_grpo(tmp_path, tiny_model, arithmetic):
    pytest.importorskip("vllm")
    summary = rlvr.train(grpo_config(tmp_path, tiny_model, arithmetic,
                                     rollout={"prompts_per_step": 4, "group_size": 4,
                                              "max_new_tokens": 16, "engine": "vllm"}))
    assert summary["steps"] == 3


def test_on_policy_distillation_scores_on_the_gpu(tmp_path, tiny_model, arithmetic):
    """The teacher sits on the reference's device: the GPU, in bf16 autocast."""
    config = grpo_config(tmp_path, tiny_model, arithmetic, algorithm={
        "kl": {"coef": 0.0}, "distill": {"teacher": {"path": tiny_model}, "mode": "mixed"}})
    pipeline = rlvr.rlvr_pipeline(config)
    try:
        teacher = pipeline.step.learner.teacher.cluster.executor.workers[0]
        assert next(teacher.model.parameters()).is_cuda
        summary = pipeline.run()
    finally:
        pipeline.close()
    assert summary["steps"] == 3
    assert pipeline.step.learner.teacher_tokens > 0


def one_process_config(kind, tmp_path, model: str, data: dict, **extra):
    """SFT, distillation, DPO and reward-model runs of a few steps, `device: auto` (the default)."""
    return kind.model_validate({
        "output_dir": str(tmp_path / "run"), "seed": 0, "model": {"path": model}, "steps": 4,
        "batch_size": 8, "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8},
        "tracking": {"tensorboard": False, "progress": False}, **data, **extra})


def test_sft_distill_dpo_and_reward_model_train_on_cuda(tmp_path, tiny_model, arithmetic):
    """The one-process pipelines put the trained model (and a teacher or reference) on the GPU,
    with bf16 autocast, like the RL policy; before, they trained on the CPU beside the GPU."""
    from reroll.config.distill import DistillConfig
    from reroll.config.preference import DPOConfig, RMConfig
    from reroll.config.schema import SFTConfig
    from reroll.data.preferences import write_arithmetic_preferences
    from reroll.pipelines.run import Run

    sft_data = {"data": {"train": arithmetic["train"], "eval": arithmetic["eval"],
                         "response_key": "solution"}}
    sft = Run(one_process_config(SFTConfig, tmp_path / "sft", tiny_model, sft_data))
    assert next(sft.step.policy.model.parameters()).is_cuda and sft.step.policy.autocast_bf16
    trained = sft.run()["final_model"]

    distill = Run(one_process_config(
        DistillConfig, tmp_path / "distill", tiny_model, sft_data, pipeline="distill",
        teacher={"path": trained}, distill={"top_k": 8}))
    assert next(distill.step.loss.teacher.model.parameters()).is_cuda
    assert distill.run()["steps"] == 4

    paths = write_arithmetic_preferences(tmp_path / "pairs", train_size=64, eval_size=16, seed=0)
    pairs = {"data": {"train": str(paths["train"]), "eval": str(paths["eval"])}}
    for kind, name in [(DPOConfig, "dpo"), (RMConfig, "rm")]:
        pipeline = Run(one_process_config(kind, tmp_path / name, trained, pairs, pipeline=name))
        assert next(pipeline.step.objective.strategy.model.parameters()).is_cuda
        summary = pipeline.run()
        assert summary["steps"] == 4
        assert torch.isfinite(torch.tensor(summary["eval_accuracy_end"]))


def test_the_trainer_steps_with_fused_adamw_and_resumes_from_its_checkpoint(tmp_path, tiny_model,
                                                                           arithmetic):
    """On a GPU the trainer's AdamW is the fused kernel; a run resumed from its step-2
    checkpoint (the optimizer's moments and step count restored) ends where the whole run ends."""
    from safetensors.torch import load_file

    from reroll.config.schema import SFTConfig
    from reroll.pipelines.run import Run

    def run(**extra) -> dict:
        config = one_process_config(SFTConfig, tmp_path / "sft", tiny_model, {"data": {
            "train": arithmetic["train"], "response_key": "solution"}},
            checkpoint={"every_steps": 2, "keep_last": 4}, **extra)
        pipeline = Run(config)
        assert pipeline.step.policy.optimizer.defaults["fused"] is True
        return pipeline.run()

    whole = run()
    final = load_file(f"{whole['final_model']}/model.safetensors")
    run_dir = tmp_path / "sft" / "run"
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    resumed = run(resume=True)
    assert resumed["resumed_from_step"] == 2
    again = load_file(f"{resumed['final_model']}/model.safetensors")
    assert all(torch.allclose(again[k], final[k], rtol=1e-3, atol=1e-5) for k in final)


def test_a_judge_and_a_reward_model_compute_on_cuda(tmp_path, tiny_model):
    """`reward.device: auto` puts a judge's hf engine and a reward model on the GPU this process
    sees; the reward model scores as on CPU (float32 on both)."""
    from reroll.models.loading import load_scalar_model, load_tokenizer
    from reroll.pipelines.judge import reward_factory
    from reroll.rewards.base import RewardSample

    tokenizer = load_tokenizer(tiny_model)
    load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    section = {"steps": 1, "model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    judge = reward_factory(RLConfig.model_validate(section | {"reward": {
        "type": "judge", "model": tiny_model, "verdict": "score", "score_pattern": r"(\d)",
        "score_min": 0, "score_max": 9, "max_new_tokens": 4, "retries": 0}}).reward)()
    rm = {"type": "model", "path": str(tmp_path / "rm")}
    on_gpu = reward_factory(RLConfig.model_validate(section | {"reward": rm}).reward)()
    on_cpu = reward_factory(RLConfig.model_validate(
        section | {"reward": rm | {"device": "cpu"}}).reward)()
    samples = [RewardSample("What is 2 + 3?", f"It is {n}.") for n in range(4)]
    try:
        reply = asyncio.run(judge.generate(judge.judge_prompt(samples[0]), 0))
        assert isinstance(reply, str)
        assert next(on_gpu.model.parameters()).is_cuda
        assert not next(on_cpu.model.parameters()).is_cuda
        assert torch.allclose(torch.tensor(on_gpu.score(samples)),
                              torch.tensor(on_cpu.score(samples)), atol=1e-3)
    finally:
        for fn in (judge, on_gpu, on_cpu):
            fn.close()

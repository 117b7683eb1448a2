"""2-rank FSDP2 (gloo, 2 Ray actors) on the tiny VLM with image prompts: one optimizer step
equals the one-process step, and the sharded forward reads the images."""

from __future__ import annotations

import pytest
import torch
from test_fsdp2_step import assert_same_step, two_ranks

from reroll.config.algorithm import AlgorithmConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import RLBatch, Trajectory, collate
from reroll.data.datasets import load_prompts
from reroll.data.images import write_count_task
from reroll.distributed.cluster import Dispatch
from reroll.distributed.groups import PolicyGroup
from reroll.models.loading import load_model, load_tokenizer
from reroll.pipelines.objective import build, make_rl_loss
from reroll.rollout.stream import encode_prompt
from reroll.training.local import LocalStrategy

pytestmark = pytest.mark.ray


def image_batch(model_path: str, data_dir, size: int = 4, blank: bool = False,
                text_rows: int = 0) -> RLBatch:
    """`size` counting-task prompts encoded the way a run encodes them (the processor's pixel
    values in each sample's model inputs), each with a 5-token response; `blank` whitens every
    image's pixels, all else equal; the first `text_rows` prompts are the question alone."""
    tokenizer = load_tokenizer(model_path)
    rows = load_prompts(write_count_task(data_dir, size, 1, seed=0)["train"])[:size]
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for i, row in enumerate(rows):
        prompt = encode_prompt(tokenizer, row, 1024)
        ids, inputs = prompt.ids, dict(prompt.model_inputs)
        if i < text_rows:
            question = [{"role": "user", "content": "How many red squares are there?"}]
            ids = tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                                tokenize=True)
            ids, inputs = list(getattr(ids, "input_ids", ids)), None
        elif blank:
            inputs["pixel_values"] = torch.ones_like(inputs["pixel_values"])
        response = torch.randint(10, 200, (5 - i % 2,), generator=generator).tolist()
        trajectories.append(Trajectory(ids, response, [0.0] * len(response), "stop",
                                       group_id=i // 2, reward=float(i % 2), model_inputs=inputs))
    tensors, _ = collate(trajectories, pad_token_id=tokenizer.pad_token_id)
    mask = tensors["response_mask"]
    tensors["advantages"] = torch.randn(size, 1, generator=generator).expand_as(mask) * mask
    old = LocalStrategy(load_model(model_path), OptimizerConfig(), TrainConfig(),
                        1).forward_logprobs(tensors)
    tensors["old_logprobs"] = tensors["behaviour_logprobs"] = old
    return RLBatch.derived(tensors)


def test_two_rank_fsdp2_step_on_a_vlm_equals_the_single_process_step(ray_session, tiny_vlm,
                                                                      tmp_path):
    optimizer, train = OptimizerConfig(lr=1e-2, grad_clip=0.5), TrainConfig(micro_batch_size=1)
    batch = image_batch(tiny_vlm, tmp_path / "data")
    blank = image_batch(tiny_vlm, tmp_path / "data", blank=True)
    mask = batch["response_mask"]  # padding positions are not defined
    assert not torch.allclose(blank["old_logprobs"] * mask, batch["old_logprobs"] * mask,
                              atol=1e-4)
    loss_fn = make_rl_loss(build(AlgorithmConfig(), max_new_tokens=5), batch)
    local = LocalStrategy(load_model(tiny_vlm), optimizer, train, total_steps=1)
    local_metrics = local.train_step(batch, loss_fn)

    cluster = two_ranks(tiny_vlm, optimizer, train)
    try:
        group = PolicyGroup(cluster)
        # The sharded forward reads each rank's rows' pixels: other images, other logprobs.
        assert torch.allclose(group.forward_logprobs(batch) * mask, batch["old_logprobs"] * mask,
                              atol=1e-4)
        assert torch.allclose(group.forward_logprobs(blank) * mask, blank["old_logprobs"] * mask,
                              atol=1e-4)
        # Rank 0's rows text-only, rank 1's with images: the vision tower runs on one rank
        # only, so no collective may hang on it (it is in the root's unit: see shard_model).
        mixed = image_batch(tiny_vlm, tmp_path / "data", text_rows=2)
        assert torch.allclose(group.forward_logprobs(mixed) * mixed["response_mask"],
                              mixed["old_logprobs"] * mixed["response_mask"], atol=1e-4)
        sharded_metrics = group.train_step(batch, loss_fn)
        after = group.forward_logprobs(batch)
        sharded = dict(group.state_dict_for_sync())
        fingerprints = cluster.call("weights_fingerprint", dispatch=Dispatch.ALL)
    finally:
        cluster.shutdown()
    assert fingerprints[1] is None and fingerprints[0] is not None
    names = assert_same_step(tiny_vlm, local, local_metrics, sharded, sharded_metrics)
    assert any("vision" in n for n in names)  # the vision tower is trained and synced too
    assert torch.allclose(after * mask, local.forward_logprobs(batch) * mask, atol=1e-4)

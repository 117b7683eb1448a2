"""One optimizer step of 2-rank FSDP2 (gloo, 2 Ray actors) equals the one-process step."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from reroll.config.algorithm import AlgorithmConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import RLBatch
from reroll.distributed.cluster import Cluster, Dispatch, RayExecutor, WorkerSpec
from reroll.distributed.groups import PolicyGroup, combine_rank_metrics
from reroll.models.loading import load_model
from reroll.pipelines.objective import build, make_rl_loss
from reroll.training.local import LocalStrategy
from reroll.workers.policy import PolicyWorker

pytestmark = pytest.mark.ray


def rl_batch(model: torch.nn.Module, size: int = 8, length: int = 14, response: int = 6):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (size, length), generator=generator)
    attention = torch.ones(size, length, dtype=torch.long)
    attention[: size // 2, -2:] = 0  # some responses end early
    mask = torch.zeros(size, length)
    mask[:, -response:] = 1
    mask = mask * attention
    batch = TensorDict({"input_ids": ids, "attention_mask": attention, "response_mask": mask,
                        "advantages": torch.randn(size, 1, generator=generator).expand(-1, length)
                        * mask}, batch_size=[size])
    old = LocalStrategy(model, OptimizerConfig(), TrainConfig(), 1).forward_logprobs(batch)
    batch["old_logprobs"] = old
    batch["behaviour_logprobs"] = old
    batch["rewards"], batch["group_ids"] = torch.zeros(size), torch.arange(size)
    return RLBatch.derived(batch)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum"])
def test_two_rank_fsdp2_step_equals_the_single_process_step(ray_session, tiny_model, loss_agg):
    optimizer, train = OptimizerConfig(lr=1e-2, grad_clip=0.5), TrainConfig(micro_batch_size=2)
    batch = rl_batch(load_model(tiny_model))
    loss_fn = make_rl_loss(build(AlgorithmConfig(loss_agg=loss_agg), max_new_tokens=6), batch)

    local = LocalStrategy(load_model(tiny_model), optimizer, train, total_steps=1)
    local_metrics = local.train_step(batch, loss_fn)

    cluster = two_ranks(tiny_model, optimizer, train)
    try:
        group = PolicyGroup(cluster)
        mask = batch["response_mask"]  # padding positions are not defined
        assert torch.allclose(group.forward_logprobs(batch) * mask, batch["old_logprobs"] * mask,
                              atol=1e-4)
        sharded_metrics = group.train_step(batch, loss_fn)
        sharded = dict(group.state_dict_for_sync())
        fingerprints = cluster.call("weights_fingerprint", dispatch=Dispatch.ALL)
    finally:
        cluster.shutdown()
    assert fingerprints[1] is None and fingerprints[0] is not None  # rank 0 holds the full weights
    assert_same_step(tiny_model, local, local_metrics, sharded, sharded_metrics)


def two_ranks(model_path: str, optimizer: OptimizerConfig, train: TrainConfig) -> Cluster:
    """The policy on 2 Ray actors of one CPU each (FSDP2 over gloo), for one step."""
    spec_kwargs = dict(model_path=model_path, dtype="float32", optimizer=optimizer, train=train,
                       total_steps=1)
    return Cluster(WorkerSpec(PolicyWorker, spec_kwargs, role="policy"), 2,
                   RayExecutor([{"num_cpus": 1}] * 2))


def assert_same_step(model_path: str, local: LocalStrategy, local_metrics: dict,
                     sharded: dict, sharded_metrics: dict) -> list[str]:
    """The sharded step's update (`sharded`: its synced weights) equals the one-process one, and
    so do the loss, gradient norm and clip fraction; the names compared. The updates are
    compared as a whole: Adam's first step is about lr * sign(grad), so an element whose
    gradient is ~0 may flip sign on float noise without meaning anything."""
    initial = load_model(model_path).state_dict()
    names = [n for n in sharded if n in initial]
    local_update = torch.cat([(local.model.state_dict()[n] - initial[n]).flatten() for n in names])
    sharded_update = torch.cat([(sharded[n] - initial[n]).flatten() for n in names])
    assert float(local_update.norm()) > 0
    relative = float((sharded_update - local_update).norm() / local_update.norm())
    assert relative < 1e-3, relative
    for key in ("train/loss", "train/grad_norm", "actor/clip_frac"):
        if key in local_metrics:
            assert sharded_metrics[key] == pytest.approx(local_metrics[key], rel=1e-4, abs=1e-6), key
    return names


def test_rank_metrics_sum_the_loss_and_average_the_rest():
    combined = combine_rank_metrics([{"train/loss": 0.25, "train/grad_norm": 2.0, "actor/x": 1.0},
                                     {"train/loss": 0.5, "train/grad_norm": 2.0, "actor/x": 3.0}])
    assert combined == {"train/loss": 0.75, "train/grad_norm": 2.0, "actor/x": 2.0}


def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(ray_session, tiny_model):
    """Rank 1's loss is NaN while every gradient stays finite: both ranks skip (they agree on the
    flag), so the sharded weights stay whole and unchanged."""
    optimizer, train = OptimizerConfig(lr=1e-2), TrainConfig(micro_batch_size=2)
    batch = rl_batch(load_model(tiny_model))
    batch["poison"] = torch.tensor([0.0] * 4 + [1.0] * 4)  # the second half: rank 1's shard
    rl_loss = make_rl_loss(build(AlgorithmConfig(), max_new_tokens=6), batch)

    def loss_fn(model, micro):
        loss, metrics = rl_loss(model, micro)
        return loss + (float("nan") if float(micro["poison"].sum()) else 0.0), metrics

    cluster = two_ranks(tiny_model, optimizer, train)
    try:
        group = PolicyGroup(cluster)
        metrics = group.train_step(batch, loss_fn)
        weights = dict(group.state_dict_for_sync())
    finally:
        cluster.shutdown()
    assert metrics["train/update_skipped"] == 1.0 and metrics["train/nonfinite_loss"] == 1.0
    initial = load_model(tiny_model).state_dict()
    assert all(torch.equal(weights[n], initial[n]) for n in weights if n in initial)


def replay_record(model: torch.nn.Module, batch: RLBatch) -> torch.Tensor:
    """A routing record [B, L, layers, k] of random distinct experts per token (-1 on padding),
    far from what the router picks, so that replaying it changes the step."""
    from reroll.models.routing import NO_RECORD, routers

    found = routers(model)
    experts, k = int(found[0].num_experts), int(found[0].top_k)
    size, length = batch["input_ids"].shape
    generator = torch.Generator().manual_seed(1)
    noise = torch.rand(size, length, len(found), experts, generator=generator)
    record = noise.argsort(-1)[..., :k].to(torch.int16)
    return record.masked_fill(~batch["attention_mask"].bool()[..., None, None], NO_RECORD)


def test_two_rank_fsdp2_step_replays_routing_as_the_single_process_step(ray_session, tiny_moe):
    """`algorithm.routing_replay` with a sharded policy: each rank replays its rows' part of the
    record (before: the forward ignored it and such configs were refused), and pi_old's routing
    is recorded on the shards as in one process."""
    from reroll.models.routing import agreement

    optimizer, train = OptimizerConfig(lr=1e-2, grad_clip=0.5), TrainConfig(micro_batch_size=2)
    batch = rl_batch(load_model(tiny_moe))
    batch["routed_experts"] = replay_record(load_model(tiny_moe), batch)
    loss_fn = make_rl_loss(build(AlgorithmConfig(), max_new_tokens=6), batch)

    local = LocalStrategy(load_model(tiny_moe), optimizer, train, total_steps=1)
    old_routing = local.routing(batch)  # pi_old's, for `routing_replay: old_policy`
    replayed = local.forward_logprobs(batch)
    mask = batch["response_mask"]
    assert not torch.allclose(replayed * mask, batch["old_logprobs"] * mask, atol=1e-3)
    local_metrics = local.train_step(batch, loss_fn)

    cluster = two_ranks(tiny_moe, optimizer, train)
    try:
        group = PolicyGroup(cluster)
        assert torch.allclose(group.forward_logprobs(batch) * mask, replayed * mask, atol=1e-4)
        assert agreement(group.routing(batch), old_routing) > 0.99
        sharded_metrics = group.train_step(batch, loss_fn)
        sharded = dict(group.state_dict_for_sync())
    finally:
        cluster.shutdown()
    assert sharded_metrics["actor/routing_replayed"] == pytest.approx(
        local_metrics["actor/routing_replayed"])
    assert_same_step(tiny_moe, local, local_metrics, sharded, sharded_metrics)

"""`weight_sync: broadcast`: the policy's rank 0 broadcasts the weights to the engine actor in
buckets over a gloo group of their own, beside the policy's 2-rank FSDP2 group."""

from __future__ import annotations

import asyncio

import pytest
from hf_engines import hf_engine_factory

from reroll.config.distributed import DistributedConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.distributed.cluster import Cluster, Dispatch, RayExecutor, WorkerSpec
from reroll.distributed.engine_actor import start_engine_actor
from reroll.distributed.groups import PolicyGroup
from reroll.distributed.weight_sync import BroadcastSync, actor_weight_sync
from reroll.engines.base import Request, SamplingParams
from reroll.models.loading import load_model
from reroll.pipelines.objective import build, make_rl_loss
from reroll.workers.policy import PolicyWorker

pytestmark = pytest.mark.ray


def policy_fingerprint(cluster: Cluster) -> str:
    """Gathering FSDP2 shards is collective: every rank takes part, rank 0 gets the weights."""
    return cluster.call("weights_fingerprint", dispatch=Dispatch.ALL)[0]


def test_broadcast_sync_delivers_the_policy_weights_in_buckets(ray_session, tiny_model):
    from test_fsdp2_step import rl_batch  # pytest puts this test folder on sys.path

    from reroll.config.algorithm import AlgorithmConfig

    kwargs = dict(model_path=tiny_model, dtype="float32", optimizer=OptimizerConfig(lr=1e-2),
                  train=TrainConfig(micro_batch_size=2), total_steps=2)
    cluster = Cluster(WorkerSpec(PolicyWorker, kwargs, role="policy"), 2,
                      RayExecutor([{"num_cpus": 0.5}] * 2))
    engine = start_engine_actor(hf_engine_factory(tiny_model), num_cpus=0.5)
    try:
        policy = PolicyGroup(cluster)
        config = DistributedConfig(executor="ray", policy={"num_workers": 2},
                                   weight_sync="broadcast", bucket_mb=1)
        sync = actor_weight_sync(policy, engine, config)
        assert isinstance(sync, BroadcastSync) and sync.backend == "gloo"
        batch = rl_batch(load_model(tiny_model))
        policy.train_step(batch, make_rl_loss(build(AlgorithmConfig(), max_new_tokens=6), batch))
        trained = policy_fingerprint(cluster)
        assert engine.weights_fingerprint() != trained
        metrics = sync(version=1)  # the tiny model's ~3.4 MB travel in 4 buckets of 1 MiB
        assert engine.weights_fingerprint() == trained and metrics["time/weight_sync_s"] > 0
        policy.train_step(batch, make_rl_loss(build(AlgorithmConfig(), max_new_tokens=6), batch))
        sync(version=2)  # the group is reused
        assert engine.weights_fingerprint() == policy_fingerprint(cluster)
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        assert asyncio.run(engine.generate(Request([1, 5], params))).policy_version == 2
    finally:
        cluster.shutdown()
        engine.shutdown()


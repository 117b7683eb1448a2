"""The role builder returns the weight sync that fits the executor it built for, and
`scheduler.engine_process` puts the engine the builder made into its own process (the rollout
source uses that engine; it starts none of its own)."""

from __future__ import annotations

import pytest

from reroll.config.schema import RLConfig
from reroll.distributed.engine_actor import ActorEngine
from reroll.distributed.weight_sync import InProcessSync, PublishedSync
from reroll.engines.base import fingerprint
from reroll.pipelines.rlvr import build_source
from reroll.pipelines.roles import build_roles, weight_sync_to


def config(tiny_model: str, **sections) -> RLConfig:
    return RLConfig(model={"path": tiny_model}, data={"train": "unused"}, steps=2,
                    rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
                    optimizer={"lr": 1e-2}, train={"micro_batch_size": 2, "num_threads": 1},
                    **sections)


def perturb(policy) -> None:
    """A weight change the engine does not have yet."""
    for p in policy.model.parameters():
        p.data.add_(0.01)
        break


def test_local_roles_sync_in_memory_and_a_facade_gets_its_own_sync(tiny_model):
    roles = build_roles(config(tiny_model), total_steps=2, pad_token_id=0)
    try:
        assert isinstance(roles.weight_sync, InProcessSync)
        assert weight_sync_to(roles, roles.engine) is roles.weight_sync
        perturb(roles.policy)
        assert roles.engine.weights_fingerprint() != fingerprint(roles.policy.state_dict_for_sync())
        roles.weight_sync(version=1)
        assert roles.engine.weights_fingerprint() == fingerprint(roles.policy.state_dict_for_sync())

        class Facade:  # what an asynchronous source puts in front of the engine
            publishes_weights = True

        assert isinstance(weight_sync_to(roles, Facade()), PublishedSync)
    finally:
        roles.shutdown()


@pytest.mark.ray
def test_engine_process_runs_the_builders_engine_in_an_actor_that_the_source_uses(tiny_model,
                                                                                   tokenizer):
    import ray

    started = not ray.is_initialized()
    c = config(tiny_model, scheduler={"engine_process": True})
    roles = build_roles(c, total_steps=2, pad_token_id=tokenizer.pad_token_id)
    try:
        assert isinstance(roles.engine, ActorEngine)
        source = build_source(c, roles.engine, None, tokenizer, None)
        assert source.engine is roles.engine
        perturb(roles.policy)
        metrics = roles.weight_sync(version=1)  # the actor client packs the weights itself
        assert roles.engine.weights_fingerprint() == fingerprint(roles.policy.state_dict_for_sync())
        assert metrics["policy_version"] == 1
    finally:
        roles.shutdown()
        if started:
            ray.shutdown()

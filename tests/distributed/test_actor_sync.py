"""Weights that move less to Ray engine actors: a LoRA run's adapter alone (merged by the engine
into its own base weights, generating what the trainer's merged model generates), deltas
against the version an actor holds, and the faults: an actor that holds another version refuses
a delta (counted, full weights follow, nothing applied), an actor holding another version than
its client sent fails the fingerprint check, and an adapter an actor cannot take falls back to
merged weights (counted)."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from hf_engines import build_hf_engine, hf_engine_factory

from reroll.distributed.engine_actor import ActorEngine, start_engine_actor
from reroll.distributed.engine_pool import EnginePool
from reroll.distributed.packing import pack
from reroll.distributed.weight_sync import InProcessSync
from reroll.engines.base import Request, SamplingParams, fingerprint
from reroll.engines.delta import DeltaPolicy, body_bytes, diff
from reroll.models.loading import load_model
from tests.engines.test_adapter_sync import trained_lora

pytestmark = pytest.mark.ray


def generate(engine, n: int = 4):
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    requests = [Request([1, 5 + i, 7], params, seed=40 + i, request_id=f"q{i}")
                for i in range(n)]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    return asyncio.run(run())


def assert_same_samples(actual, expected) -> None:
    assert [c.token_ids for c in actual] == [c.token_ids for c in expected]
    for a, e in zip(actual, expected, strict=True):
        assert a.logprobs == pytest.approx(e.logprobs, abs=1e-5)


def in_process(tiny_model, weights: dict[str, torch.Tensor], version: int):
    engine = build_hf_engine(tiny_model)
    engine.load_weights(weights.items(), version)
    return engine


def test_engine_actors_take_the_adapter_alone_and_sample_the_merged_model(ray_session,
                                                                        tiny_model):
    strategy = trained_lora(tiny_model)
    pool = EnginePool([start_engine_actor(hf_engine_factory(tiny_model), num_cpus=0.5)
                       for _ in range(2)])
    try:
        sync = InProcessSync(strategy, pool, "auto")
        assert sync.adapter_only  # before: Ray engine actors took merged weights only
        metrics = sync(1)
        adapter = strategy.adapter_for_sync()
        merged = dict(strategy.state_dict_for_sync())
        assert metrics["weight_sync/adapter_fallbacks"] == 0
        assert metrics["weight_sync/bytes"] == body_bytes(adapter)
        assert metrics["weight_sync/bytes"] < 0.2 * body_bytes(merged)
        assert pool.weights_fingerprint() == fingerprint(adapter.items())
        assert_same_samples(generate(pool), generate(in_process(tiny_model, merged, 1)))
    finally:
        pool.shutdown()


@pytest.fixture(scope="module")
def actor(ray_session, tiny_model):
    engine = start_engine_actor(hf_engine_factory(tiny_model), num_cpus=0.5)
    yield engine.actor
    engine.shutdown()


def nudged(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A few elements of two tensors changed (what a small update leaves after the cast)."""
    out = {name: t.clone() for name, t in state.items()}
    g = torch.Generator().manual_seed(seed)
    for name in list(out)[1:3]:
        flat = out[name].reshape(-1)
        flat[torch.randint(0, flat.numel(), (5,), generator=g)] += 0.5
    return out


def test_a_delta_goes_against_the_version_the_actor_holds_and_is_refused_on_another(
        actor, tiny_model):
    base = load_model(tiny_model).state_dict()
    client = ActorEngine(actor, DeltaPolicy(full_every=10))
    v1, v2 = nudged(base, 1), nudged(base, 2)
    client.load_weights(v1.items(), 1)  # the first sync is full: nothing held to diff against
    assert client.sender.counters.delta_syncs == 0
    assert client.weights_fingerprint() == fingerprint(v1.items())
    client.load_weights(v2.items(), 2)
    metrics = client.sync_metrics()
    assert metrics["weight_sync/delta_syncs"] == 1 and metrics["weight_sync/delta_fallbacks"] == 0
    assert metrics["weight_sync/bytes"] < 0.01 * metrics["weight_sync/full_bytes"]
    assert client.weights_fingerprint() == fingerprint(v2.items())
    assert_same_samples(generate(client), generate(in_process(tiny_model, v2, 2)))

    # someone else loads version 7 on the actor (a restarted trainer, another client)
    v7 = nudged(base, 7)
    ActorEngine(actor).load_weights(v7.items(), 7)
    held = ray.get(actor.weights_fingerprint.remote())
    slots, flat = pack(diff(v2, nudged(base, 3)).items())
    reply = ray.get(actor.load_delta.remote(slots, flat.numpy(), 2, 3))
    assert "holds weights version 7, not the delta's base 2" in reply["refused"]
    broken = {name: t for name, t in diff(v7, nudged(base, 8)).items() if name.endswith("::idx")}
    slots, flat = pack(broken.items())  # indices without their values
    assert "do not pair up" in ray.get(actor.load_delta.remote(slots, flat.numpy(), 7, 8))["refused"]
    assert ray.get(actor.weights_fingerprint.remote()) == held  # nothing applied

    v3 = nudged(base, 3)
    client.load_weights(v3.items(), 3)  # its delta is against version 2: refused, then full
    metrics = client.sync_metrics()
    assert metrics["weight_sync/delta_fallbacks"] == 1
    assert metrics["weight_sync/bytes"] == metrics["weight_sync/full_bytes"]
    assert client.weights_fingerprint() == fingerprint(v3.items())
    client.load_weights(nudged(base, 4).items(), 4)  # deltas again from the full version 3
    assert client.sync_metrics()["weight_sync/delta_syncs"] == 2


def test_an_actor_holding_another_version_than_its_client_sent_fails_the_check(actor,
                                                                              tiny_model):
    weights = nudged(load_model(tiny_model).state_dict(), 5)
    client = ActorEngine(actor)
    client.load_weights(weights.items(), 5)
    assert client.weights_fingerprint() == fingerprint(weights.items())
    ActorEngine(actor).load_weights(weights.items(), 9)  # the same weights, as version 9
    # before: the weights' fingerprint, and the sync's check passed on the wrong version
    assert client.weights_fingerprint() == "engine actor holds weights version 9, not 5"


def test_an_adapter_the_actor_cannot_take_falls_back_to_merged_weights_counted(actor,
                                                                             tiny_model):
    strategy = trained_lora(tiny_model)
    client = ActorEngine(actor)
    client.load_weights(load_model(tiny_model).state_dict().items(), 1)  # full: no base held
    metrics = InProcessSync(strategy, client, "auto")(2)
    assert metrics["weight_sync/adapter_fallbacks"] == 1
    merged = dict(strategy.state_dict_for_sync())
    assert client.weights_fingerprint() == fingerprint(merged.items())
    assert_same_samples(generate(client), generate(in_process(tiny_model, merged, 2)))

"""The engine in a Ray actor behaves like the engine in-process."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_engines import build_hf_engine, hf_engine_factory

from reroll.distributed.engine_actor import start_engine_actor
from reroll.engines.base import Engine, Request, SamplingParams

pytestmark = pytest.mark.ray


def _requests(params: SamplingParams, n: int = 6) -> list[Request]:
    return [Request([1, 5 + i, 7, 9], params, seed=100 + i, request_id=f"r{i}") for i in range(n)]


async def _generate_all(engine: Engine, requests: list[Request]):
    return await asyncio.gather(*(engine.generate(r) for r in requests))


@pytest.fixture(scope="module")
def actor_engine(ray_session, tiny_model):
    engine = start_engine_actor(hf_engine_factory(tiny_model), num_cpus=1, num_threads=1)
    yield engine
    engine.shutdown()


def test_actor_generates_what_the_in_process_engine_generates(actor_engine, tiny_model):
    assert isinstance(actor_engine, Engine)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    local = asyncio.run(_generate_all(build_hf_engine(tiny_model), _requests(params)))
    remote = asyncio.run(_generate_all(actor_engine, _requests(params)))
    assert [c.token_ids for c in remote] == [c.token_ids for c in local]
    for r, c in zip(remote, local, strict=True):
        assert r.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    stats = actor_engine.stats()
    assert stats["generated_tokens"] >= sum(len(c.token_ids) for c in remote)
    assert stats["busy_s"] > 0


def test_abort_stops_a_request(actor_engine):
    params = SamplingParams(max_new_tokens=200, temperature=1.0)
    request = Request([1, 5, 7], params, seed=3, request_id="to-abort")

    async def run():
        task = asyncio.ensure_future(actor_engine.generate(request))
        await asyncio.sleep(0.05)
        actor_engine.abort("to-abort")
        return await task

    completion = asyncio.run(run())
    assert completion.finish_reason == "abort"
    assert len(completion.token_ids) < 200


def test_load_weights_changes_the_fingerprint(actor_engine, tiny_model):
    from reroll.models.loading import load_model

    model = load_model(tiny_model)
    assert actor_engine.weights_fingerprint() == build_hf_engine(tiny_model).weights_fingerprint()
    before = actor_engine.weights_fingerprint()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    actor_engine.load_weights(model.state_dict().items(), version=4)
    after = actor_engine.weights_fingerprint()
    assert after != before
    engine = build_hf_engine(tiny_model)
    engine.load_weights(model.state_dict().items(), 4)
    assert after == engine.weights_fingerprint()
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    completion = asyncio.run(actor_engine.generate(Request([1, 5], params)))
    assert completion.policy_version == 4

"""Several engines behind one (`distributed.rollout.num_workers` > 1): requests spread over
them, the samples are those of one engine (each request has its own seed), weights go to all,
and engines that disagree on their weights stop the run. Real in-process HF engines here; the
multinode tier runs the same pool over engine actors on two nodes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_engines import build_hf_engine

from reroll.distributed.engine_pool import EnginePool
from reroll.engines.base import Engine, Request, SamplingParams, WeightSyncError

pytestmark = pytest.mark.unit


def requests(n: int = 8) -> list[Request]:
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    return [Request([1, 5 + i, 7, 9], params, seed=100 + i, request_id=f"r{i}") for i in range(n)]


async def generate_all(engine, batch: list[Request]):
    return await asyncio.gather(*(engine.generate(r) for r in batch))


def test_a_pool_spreads_requests_and_samples_what_one_engine_samples(tiny_model):
    torch.set_num_threads(1)
    single = asyncio.run(generate_all(build_hf_engine(tiny_model), requests()))
    engines = [build_hf_engine(tiny_model), build_hf_engine(tiny_model)]
    pool = EnginePool(engines)
    assert isinstance(pool, Engine)
    pooled = asyncio.run(generate_all(pool, requests()))
    assert [c.token_ids for c in pooled] == [c.token_ids for c in single]
    for a, b in zip(pooled, single, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert all(e.stats().generated_tokens > 0 for e in engines)  # both engines took requests
    assert pool.stats()["generated_tokens"] == sum(len(c.token_ids) for c in pooled)
    assert pool._in_flight == [0, 0] and not pool._where


def test_weights_reach_every_engine_and_a_disagreement_stops_the_run(tiny_model):
    engines = [build_hf_engine(tiny_model), build_hf_engine(tiny_model)]
    pool = EnginePool(engines)
    before = pool.weights_fingerprint()
    named = [(n, p.detach() + 0.01) for n, p in engines[0].model.named_parameters()]
    pool.load_weights(named, version=1)
    after = pool.weights_fingerprint()
    assert after != before and all(e.weights_fingerprint() == after for e in engines)
    engines[1].load_weights([(n, t + 0.01) for n, t in named], version=2)  # one engine only
    with pytest.raises(WeightSyncError, match="the 2 engines hold different weights"):
        pool.weights_fingerprint()

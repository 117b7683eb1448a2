"""Delta weight sync to a serving endpoint (issue 48, item 2): only the elements that changed in
the endpoint's dtype travel, against the version it holds; a delta against another version is
refused and full weights follow; a body that does not fit changes nothing; the result is checked
by fingerprint. Against reroll's real server on loopback around the tiny model, held in bf16."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save

from reroll.engines.base import fingerprint
from reroll.engines.delta import body_bytes, diff, patch
from reroll.engines.elastic import DeltaPolicy, ElasticEngine, ServingObjective
from reroll.engines.hf import HFEngine
from reroll.engines.server import CompletionServer
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit


def test_a_delta_takes_the_base_to_the_new_weights_bit_for_bit():
    torch.manual_seed(0)
    base = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(32),
            "same": torch.ones(8), "grown": torch.zeros(3)}
    new = {"w": (base["w"].float() + 1e-4 * torch.randn(64, 32)).to(torch.bfloat16),
           "b": base["b"].clone(), "same": base["same"].clone(), "grown": torch.zeros(5)}
    new["b"][3] = float("nan")
    new["b"][4] = -0.0 if base["b"][4] == 0 else -base["b"][4]
    body = diff(base, new)
    assert "same::idx" not in body and "same::full" not in body  # unchanged: not sent
    assert set(body["b::idx"].tolist()) == {3, 4} and "grown::full" in body
    changed = int((base["w"].view(torch.int16) != new["w"].view(torch.int16)).sum())
    assert 0 < changed < base["w"].numel() / 2  # a small update leaves most bf16 weights as they were
    assert body["w::idx"].numel() == changed
    out = base | patch(base, body)
    assert fingerprint(out.items()) == fingerprint(new.items())
    assert body_bytes(body) < body_bytes(new)


def test_a_delta_that_does_not_fit_is_refused_before_any_change():
    base = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="go past its 4 elements"):
        patch(base, {"w::idx": torch.tensor([7], dtype=torch.int32), "w::val": torch.ones(1)})
    with pytest.raises(ValueError, match="does not hold"):
        patch(base, {"v::idx": torch.tensor([0], dtype=torch.int32), "v::val": torch.ones(1)})
    with pytest.raises(ValueError, match="do not pair up"):
        patch(base, {"w::idx": torch.tensor([0, 1], dtype=torch.int32), "w::val": torch.ones(1)})
    assert base["w"].sum() == 0


@pytest.fixture
def bf16_endpoint(tiny_model, tokenizer):
    server = CompletionServer(HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id,
                                       dtype=torch.bfloat16), "tiny")
    yield server
    server.close()


def updated(state: dict, step: float) -> dict:
    """A small update: a few weights in twenty move by `step`. Tied weights (the tiny model's
    embedding and head share their storage) move together."""
    generator = torch.Generator().manual_seed(int(step * 1e6))
    out, by_storage = {}, {}
    for name, t in state.items():
        key = t.untyped_storage().data_ptr()
        if key not in by_storage:
            by_storage[key] = t + step * torch.randn(t.shape, generator=generator) * (
                torch.rand(t.shape, generator=generator) < 0.05)
        out[name] = by_storage[key]
    return out


def lender(tiny_model, tokenizer, url: str, full_every: int) -> ElasticEngine:
    """An ElasticEngine around a float32 dedicated engine, sending deltas to `url`."""
    dedicated = HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id)
    return ElasticEngine(dedicated, url, ServingObjective(ttft_p99_s=60, tpot_p99_s=60),
                         model="tiny", delta=DeltaPolicy(enabled=True, full_every=full_every))


def test_an_endpoint_gets_deltas_and_full_weights_every_nth_sync(
        bf16_endpoint, tiny_model, tokenizer):
    engine = lender(tiny_model, tokenizer, bf16_endpoint.url, full_every=3)
    state = load_model(tiny_model).state_dict()
    try:
        sent = []
        for version in range(1, 5):
            state = updated(state, 1e-2)
            engine.load_weights(state.items(), version)
            sent.append(engine.counters.sync_bytes / engine.counters.full_bytes)
            # the dedicated engine holds the trainer's weights, the endpoint their bf16 bits
            assert engine.weights_fingerprint() == fingerprint(state.items())
            bf16 = {n: t.to(torch.bfloat16) for n, t in state.items()}
            assert bf16_endpoint.engine.weights_fingerprint() == fingerprint(bf16.items())
        # full, delta, delta, full (every 3rd); a delta is a fraction of the weights
        assert sent[0] == 1.0 and sent[3] == 1.0 and max(sent[1:3]) < 0.5
        assert engine.counters.delta_syncs == 2 and engine.counters.delta_fallbacks == 0
    finally:
        engine.close()


def test_an_endpoint_holding_another_version_refuses_the_delta_and_gets_full_weights(
        bf16_endpoint, tiny_model, tokenizer):
    engine = lender(tiny_model, tokenizer, bf16_endpoint.url, full_every=10)
    state = load_model(tiny_model).state_dict()
    try:
        engine.load_weights(updated(state, 1e-2).items(), 1)
        # someone else loads version 7 on the endpoint (a restart, another trainer)
        other = {n: t.to(torch.bfloat16) for n, t in updated(state, 3e-2).items()}
        assert httpx.post(f"{bf16_endpoint.url}/weights", content=save(other),
                          headers={"X-Reroll-Version": "7"}).status_code == 200
        held = bf16_endpoint.engine.weights_fingerprint()
        base = {n: t.to(torch.bfloat16) for n, t in state.items()}
        stale = diff(base, other)
        reply = httpx.post(f"{bf16_endpoint.url}/weights_delta", content=save(stale),
                           headers={"X-Reroll-Version": "8", "X-Reroll-Base-Version": "1"})
        assert reply.status_code == 409 and "not the delta's base 1" in reply.text
        reply = httpx.post(f"{bf16_endpoint.url}/weights_delta", content=save(stale)[:100],
                           headers={"X-Reroll-Version": "8", "X-Reroll-Base-Version": "7"})
        assert reply.status_code == 400 and "not a whole safetensors" in reply.text
        assert bf16_endpoint.engine.weights_fingerprint() == held  # nothing applied

        new = updated(state, 2e-2)
        engine.load_weights(new.items(), 2)  # its delta is against version 1: refused
        assert engine.counters.delta_fallbacks == 1 and engine.counters.sync_bytes == \
            engine.counters.full_bytes
        assert engine.weights_fingerprint() == fingerprint(new.items())
    finally:
        engine.close()

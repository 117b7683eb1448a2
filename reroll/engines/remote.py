"""Rollouts from OpenAI-compatible completion endpoints (`vllm serve`, `reroll.engines.server`, or
serving GPUs shared with production): a pool with least-loaded routing, a per-endpoint cap on
requests in flight, back-off and retry on errors and time-outs, and endpoints that can be added
or removed while running.

Token ids go in as the `prompt` (a list of ids) and come back from vLLM's completion extensions
(`return_token_ids`, `return_tokens_as_token_ids`), with the sampled tokens' logprobs. The same
client serves LLM-as-judge rewards (`RemoteEngine.generate` with a judge prompt's ids).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reroll import settings
from reroll.engines.base import Completion, EngineStats, LoadMeter, Request, WeightSyncError
from reroll.engines.loop import BackgroundLoop


class RemoteEngineError(RuntimeError):
    """No endpoint answered a request within its retries."""


class MalformedReply(RemoteEngineError):
    """An endpoint answered, but not with a completion (not JSON, or without `choices`): its
    server is up, so it is not backed off as a dead one, and the request's error says so."""


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    failures: int = 0
    """Consecutive failures; reset by a success."""
    down_until: float = 0.0
    """perf_counter time before which the endpoint gets no new requests (back-off)."""


@dataclass(frozen=True)
class RemoteOptions:
    """The `rollout.engine` section of type `remote`, minus the endpoint list."""

    model: str | None = None
    max_in_flight: int = 64
    timeout_s: float = 300.0
    max_retries: int = 3
    backoff_s: float = 1.0
    api_key_env: str | None = None
    request_kind: str | None = None
    """Sent as `reroll_kind` in each request body: reroll's own server counts `rollout` requests
    apart from its serving traffic (`reroll.engines.elastic`)."""


class RemoteEngine:
    """Engine over a pool of OpenAI-compatible `/v1/completions` endpoints."""

    def __init__(self, endpoints: Iterable[str], options: RemoteOptions = RemoteOptions()):
        import httpx

        self.options = options
        self.endpoints: dict[str, Endpoint] = {}
        self.version = 0
        self.meter = LoadMeter()
        self._loop = BackgroundLoop("reroll-remote")
        self._tasks: dict[str, asyncio.Task] = {}
        token = settings.read(options.api_key_env) if options.api_key_env else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        async def make_client():
            return httpx.AsyncClient(headers=headers, timeout=options.timeout_s,
                                     limits=httpx.Limits(max_connections=None))

        self._client = self._loop.run(make_client())
        self._slot_freed = self._loop.run(_make_condition())
        for url in endpoints:
            self.add_endpoint(url)

    # -- the pool --------------------------------------------------------------------------------

    def add_endpoint(self, url: str) -> None:
        url = url.rstrip("/")
        self._loop.call_soon(self.endpoints.setdefault, url, Endpoint(url))
        self._loop.run(self._notify())

    def remove_endpoint(self, url: str) -> None:
        """Stop routing to `url`; requests already there finish (or fail over) normally."""
        self._loop.call_soon(self.endpoints.pop, url.rstrip("/"), None)

    def check_reachable(self) -> None:
        """Raise RemoteEngineError naming every endpoint that does not answer `GET /models`."""
        dead = [url for url, err in self._loop.run(self._probe_all()).items() if err]
        if dead:
            raise RemoteEngineError(f"endpoint(s) unreachable: {', '.join(dead)}")

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        # The completions API takes token ids alone: the images would be dropped, silently. A
        # run refuses image data with a serving endpoint at start (pipelines.validation).
        if request.model_inputs:
            raise ValueError("the remote engine does not take image prompts yet (model "
                                      "inputs beyond tokens)")
        return await self._loop.wait(self._generate(request))

    def abort(self, request_id: str) -> None:
        """Cancel the HTTP request (the server aborts it on disconnect). A non-streaming
        completion returns nothing until it ends, so the aborted request comes back with no
        tokens and finish reason `abort`."""
        def cancel():
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
        self._loop.call_soon(cancel)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise WeightSyncError(
            "the remote engine cannot push weights to its endpoints; for on-policy training use "
            "rollout.engine: hf or vllm, and keep remote endpoints for evaluation, judges and "
            "teachers")

    def weights_fingerprint(self) -> str:
        return "remote"

    def sleep(self) -> None:
        """Nothing to free locally: the endpoints own their memory."""

    def wake(self) -> None:
        """See `sleep`."""

    def stats(self) -> EngineStats:
        return self.meter.stats()

    def close(self) -> None:
        if not self._client.is_closed:
            self._loop.run(self._client.aclose())
        self._loop.close()

    shutdown = close

    # -- internals --------------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Completion:
        self.meter.started()
        task = asyncio.create_task(self._with_retries(request))
        self._tasks[request.request_id] = task
        completion = None
        try:
            completion = await task
        except asyncio.CancelledError:
            completion = Completion(request.request_id, request.prompt_ids, [], [], "abort",
                                    self.version)
        finally:
            self._tasks.pop(request.request_id, None)
            self.meter.finished(len(completion.token_ids) if completion else 0)
        return completion

    async def _with_retries(self, request: Request) -> Completion:
        errors = []
        for _attempt in range(self.options.max_retries + 1):
            endpoint = await self._acquire()
            try:
                completion = await self._post(endpoint, request)
            except MalformedReply as e:
                errors.append(f"{endpoint.url}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - network errors, time-outs, bad replies
                endpoint.failures += 1
                endpoint.down_until = time.perf_counter() + \
                    self.options.backoff_s * 2 ** (endpoint.failures - 1)
                errors.append(f"{endpoint.url}: {type(e).__name__}: {e}")
                continue
            finally:
                endpoint.in_flight -= 1
                await self._notify()
            endpoint.failures = 0
            return completion
        raise RemoteEngineError(f"request {request.request_id} failed after "
                                f"{self.options.max_retries + 1} attempts: " + "; ".join(errors))

    async def _acquire(self) -> Endpoint:
        """The least-loaded endpoint that is up and under its cap; waits for one."""
        async with self._slot_freed:
            while True:
                now = time.perf_counter()
                ready = [e for e in self.endpoints.values()
                         if e.in_flight < self.options.max_in_flight and e.down_until <= now]
                if ready:
                    endpoint = min(ready, key=lambda e: e.in_flight)
                    endpoint.in_flight += 1
                    return endpoint
                if not self.endpoints:
                    raise RemoteEngineError("the remote engine has no endpoints")
                wake_at = min((e.down_until for e in self.endpoints.values()), default=now)
                try:
                    await asyncio.wait_for(self._slot_freed.wait(), max(0.01, wake_at - now))
                except TimeoutError:
                    pass

    async def _notify(self) -> None:
        async with self._slot_freed:
            self._slot_freed.notify_all()

    async def _post(self, endpoint: Endpoint, request: Request) -> Completion:
        response = await self._client.post(f"{endpoint.url}/completions",
                                           json=await self._body(endpoint, request))
        if response.status_code != 200:
            raise RemoteEngineError(f"HTTP {response.status_code}: {response.text[:300]}")
        try:
            choice = response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise MalformedReply(f"malformed reply, not an OpenAI completion "
                                 f"({type(e).__name__}: {e}): {response.text[:200]!r}") from None
        return parse_completion(request, choice, self.version)

    async def _body(self, endpoint: Endpoint, request: Request) -> dict:
        p = request.params
        model = self.options.model or await self._first_model(endpoint)
        return {
            "model": model, "prompt": list(request.prompt_ids), "max_tokens": p.max_new_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k or -1,
            "seed": request.seed, "n": 1, "logprobs": 0, "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        } | ({"reroll_kind": self.options.request_kind} if self.options.request_kind else {})

    async def _first_model(self, endpoint: Endpoint) -> str:
        response = await self._client.get(f"{endpoint.url}/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def _probe_all(self) -> dict[str, str | None]:
        async def probe(url: str) -> str | None:
            try:
                (await self._client.get(f"{url}/models", timeout=10)).raise_for_status()
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
            return None
        urls = list(self.endpoints)
        return dict(zip(urls, await asyncio.gather(*(probe(u) for u in urls)), strict=True))


async def _make_condition() -> asyncio.Condition:
    return asyncio.Condition()


def parse_completion(request: Request, choice: dict, version: int) -> Completion:
    """A Completion from one `choices[i]` of an OpenAI-style completion reply with vLLM's token
    extensions: ids from `token_ids`, or from `logprobs.tokens` written as `token_id:N`."""
    logprobs = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = [int(t.split(":", 1)[1]) for t in logprobs.get("tokens") or []]
    values = [float(v) for v in logprobs.get("token_logprobs") or []]
    if len(values) != len(token_ids):
        raise RemoteEngineError(f"the endpoint returned {len(token_ids)} tokens but "
                                f"{len(values)} logprobs; it must support `logprobs`")
    reason = choice.get("finish_reason")
    reason = reason if reason in ("stop", "length", "abort") else "length"
    return Completion(request.request_id, request.prompt_ids, list(token_ids), values, reason,
                      version)

"""A small OpenAI-compatible completion server around any reroll engine (the HF engine by default).

It speaks the subset of `/v1/completions` that the remote engine uses, with vLLM's token
extensions: `prompt` as token ids, `return_token_ids`, `logprobs`, `seed`, `top_k`,
`stop_token_ids`. Use it to serve a checkpoint to remote rollouts or judges where vLLM is not
installed, and in tests. Run: `python -m reroll.engines.server MODEL_DIR --port 8000`. It is a Starlette app on
uvicorn (`reroll.engines.http`); a bad request gets an OpenAI-style JSON error: 400 naming the
bad or unsupported parameter, `context_length_exceeded` for a prompt that leaves no room in the
model's context.

Because reroll owns this server, it can also lend its spare capacity to training (ROSE, see
`reroll.engines.elastic`): a request whose body says `"reroll_kind": "rollout"` is a rollout, any
other is the endpoint's own (serving) traffic. `GET /v1/load?window_s=S` reports each kind's
p99 time to first token and time per output token over the last S seconds and the requests in
flight (`wait_idle_s=T`: first wait up to T seconds for the serving requests running to end);
`POST /v1/weights` (a safetensors body, header `X-Reroll-Version`) loads new policy
weights between two decoding steps; `POST /v1/adapter` (a LoRA adapter's safetensors, a few MB,
same header) merges an adapter into the server's copy of the base weights instead;
`POST /v1/weights_delta` (headers `X-Reroll-Version` and `X-Reroll-Base-Version`) applies a delta
against the version the server holds, only the elements that changed (`reroll.engines.delta`;
a 409 when it holds another version: the sender then sends full weights);
`GET /v1/weights_fingerprint` lets the trainer verify them (`?version=N`: a 409 unless the server
holds version N) and names the dtype the weights are held in.
With `yield_to_serving` (`--yield-to-serving`), a serving request that arrives aborts every
rollout request running here: they return what they generated (finish reason `abort`) and the
trainer finishes them elsewhere, and a rollout request that arrives while a serving request
runs is turned away at once (no tokens, finish reason `abort`), so the users' requests never
share a batch with rollouts beyond the decoding step under way when they arrive.
`rollouts_beside_serving` K (`--rollouts-beside-serving K`) softens that for an endpoint whose
latency objective leaves room for a few more sequences in a batch: the K rollouts that started
first keep running beside the users (only the others are aborted). No rollout starts while users
are served, even with fewer than K running: its prompt's prefill would stall their decoding (4
rollouts' prompts of 48-140 tokens took 0.27-0.9 s to prefill on one core of this machine, 5-18
of the users' decoding steps). K is the most it keeps: `POST /v1/beside` (`{"keep": k}`) sets how many
it keeps now, from 0 to K (the lender's controller lowers it when the users' latency nears
their objective); lowered while users are served, the rollouts past the new number are aborted
at once.

`pause_rollouts` P (`--pause-rollouts P`, for an engine that can pause, like the HF engine) pauses
those rollouts instead of aborting them, up to P at once (the rest are aborted as before): a
paused rollout keeps its KV cache and tokens on the endpoint and does no work while the users are
served, and goes on where it stopped when the last of them leaves, with no prefill again (an
aborted one is prefilled again, prompt and tokens, wherever it continues). `POST /v1/reclaim`
(`{"n": n}`) gives back the n latest paused at once (aborted, with their tokens), for a lender
whose own engine has room for them; `GET /v1/load` reports `paused`, and `pauses` so far.
"""

from __future__ import annotations

import argparse
import collections
import math
import threading
import time

from reroll.engines.base import AdapterSyncError, Completion, Engine, Request, SamplingParams
from reroll.engines.delta import BehindError, held_weights, patch_engine
from reroll.engines.http import (
    OpenAIError,
    ServerThread,
    bad_param,
    check_params,
    context_exceeded,
    json_body,
    make_app,
)
from reroll.engines.loop import BackgroundLoop

KINDS = ("serving", "rollout")


class LatencyLog:
    """Finished requests' latencies per kind, for the latency objective of the endpoint's own
    traffic: (finish time, time to first token, time per output token)."""

    def __init__(self, keep_s: float = 600.0):
        self.keep_s = keep_s
        self.done: collections.deque = collections.deque()
        self.in_flight = dict.fromkeys(KINDS, 0)
        self._lock = threading.Lock()
        self._users_done = threading.Condition(self._lock)

    def started(self, kind: str) -> None:
        with self._lock:
            self.in_flight[kind] += 1

    def finished(self, kind: str, latency_s: float, out: Completion) -> None:
        """TTFT is the engine's own measure when it has one, else the whole latency (an upper
        bound); TPOT spreads the rest over the tokens after the first."""
        tokens = len(out.token_ids)
        ttft = out.first_token_s if out.first_token_s is not None else latency_s
        tpot = (latency_s - ttft) / (tokens - 1) if tokens > 1 else 0.0
        now = time.perf_counter()
        with self._lock:
            self.in_flight[kind] -= 1
            self.done.append((now, kind, ttft, max(tpot, 0.0)))
            while self.done and self.done[0][0] < now - self.keep_s:
                self.done.popleft()
            if self.in_flight["serving"] == 0:
                self._users_done.notify_all()

    def wait_idle(self, timeout_s: float) -> None:
        """Return once no serving request runs, or after `timeout_s`."""
        with self._lock:
            self._users_done.wait_for(lambda: self.in_flight["serving"] == 0, timeout_s)

    def report(self, window_s: float) -> dict:
        since = time.perf_counter() - window_s
        with self._lock:
            recent = [d for d in self.done if d[0] >= since]
            in_flight = dict(self.in_flight)
        out = {}
        for kind in KINDS:
            mine = [d for d in recent if d[1] == kind]
            out[kind] = {"requests": len(mine), "in_flight": in_flight[kind],
                         "ttft_p99_s": p99([d[2] for d in mine]),
                         "tpot_p99_s": p99([d[3] for d in mine])}
        return out


def p99(values: list[float]) -> float | None:
    """The 99th percentile (nearest rank); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class CompletionServer:
    """Serves `engine` on host:port in a background thread (port 0: any free port)."""

    def __init__(self, engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 yield_to_serving: bool = False, rollouts_beside_serving: int = 0,
                 pause_rollouts: int = 0, max_context_tokens: int | None = None):
        if rollouts_beside_serving < 0:
            raise ValueError(f"rollouts_beside_serving must be >= 0, not {rollouts_beside_serving}")
        if pause_rollouts < 0:
            raise ValueError(f"pause_rollouts must be >= 0, not {pause_rollouts}")
        if pause_rollouts and not hasattr(engine, "pause"):
            raise ValueError(f"pause_rollouts needs an engine that can pause; "
                             f"{type(engine).__name__} cannot")
        self.engine, self.model_name = engine, model_name
        self.max_context_tokens = max_context_tokens
        """The model's context (prompt + completion); a longer prompt is refused with
        `context_length_exceeded`, a completion is cut at it. None: not checked."""
        self.yield_to_serving = yield_to_serving
        self.rollouts_beside_serving = rollouts_beside_serving
        self.beside = rollouts_beside_serving
        """How many rollouts it keeps beside its users now (`keep_beside`), at most the K above."""
        self.pause_rollouts = pause_rollouts
        """Most rollouts paused at once for the users (the others past `beside` are aborted)."""
        self.pauses = 0
        """Rollouts paused for the users so far."""
        self._paused: dict[str, None] = {}  # rollouts paused now, in the order they were paused
        self.latency = LatencyLog()
        self.refused = 0
        """Rollout requests turned away at once because users were being served (yielding)."""
        self._rollouts: dict[str, None] = {}  # rollout requests running here, oldest first
        self._rollouts_lock = threading.Lock()
        self._loop = BackgroundLoop("reroll-server")
        self._http = ServerThread(_app(self), host, port)

    @property
    def url(self) -> str:
        return f"{self._http.base}/v1"

    def complete(self, body: dict) -> dict:
        """One `/v1/completions` body; an `OpenAIError` for a bad one."""
        request = self._request(body)
        prompt = request.prompt_ids
        kind = "rollout" if body.get("reroll_kind") == "rollout" else "serving"
        with self._rollouts_lock:
            refused = kind == "rollout" and self.yield_to_serving \
                and self.latency.in_flight["serving"] > 0
            if refused:  # users are being served: the rollout goes back untouched
                self.refused += 1
            elif kind == "rollout":
                self._rollouts[request.request_id] = None
            elif self.yield_to_serving:  # the oldest K stay: they are the furthest along
                self._abort_rollouts_past(self.beside)
            if not refused:
                self.latency.started(kind)
        if refused:
            out = Completion(request.request_id, prompt, [], [], "abort",
                             getattr(self.engine, "version", 0))
            return self._reply(out, prompt)
        start = time.perf_counter()
        out = None
        try:
            out = self._loop.run(self.engine.generate(request))
        finally:
            with self._rollouts_lock:
                self._rollouts.pop(request.request_id, None)
                self._paused.pop(request.request_id, None)
                if out is not None:
                    self.latency.finished(kind, time.perf_counter() - start, out)
                if kind == "serving" and self.latency.in_flight["serving"] == 0:
                    self._resume_paused()  # the last user left
        return self._reply(out, prompt)

    def _request(self, body: dict) -> Request:
        check_params(body, COMPLETION_PARAMS)
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise bad_param("prompt", "must be a non-empty list of token ids (this server "
                                      "does not tokenize text)")
        if body.get("stream"):
            raise bad_param("stream", "streaming is not supported here")
        if body.get("n", 1) != 1:
            raise bad_param("n", "only n=1 is supported")
        try:
            max_tokens = int(body.get("max_tokens", 16))
            temperature, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
            top_k, seed = max(0, int(body.get("top_k", 0))), int(body.get("seed") or 0)
        except (TypeError, ValueError) as e:
            raise OpenAIError(400, f"a sampling parameter is not a number: {e}") from None
        for name, value, ok in (("max_tokens", max_tokens, max_tokens >= 1),
                                ("temperature", temperature, temperature >= 0),
                                ("top_p", top_p, 0 < top_p <= 1)):
            if not ok:
                raise bad_param(name, f"{value} is out of range")
        if self.max_context_tokens is not None:
            room = self.max_context_tokens - len(prompt)
            if room < 1:
                raise context_exceeded(len(prompt), self.max_context_tokens)
            max_tokens = min(max_tokens, room)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, stop_token_ids=tuple(body.get("stop_token_ids") or ()))
        return Request(prompt, params, seed=seed)

    def keep_beside(self, keep: int) -> dict:
        """Keep `keep` rollouts beside the users from now on (clipped to 0..K); while users are
        served, the rollouts past that number (the latest started) are aborted at once."""
        with self._rollouts_lock:
            self.beside = max(0, min(int(keep), self.rollouts_beside_serving))
            if self.yield_to_serving and self.latency.in_flight["serving"] > 0:
                self._abort_rollouts_past(self.beside)
        return {"keep": self.beside, "rollouts_beside_serving": self.rollouts_beside_serving}

    def reclaim(self, n: int) -> dict:
        """Give back (abort) the `n` rollouts paused last; they return with their tokens."""
        with self._rollouts_lock:
            given = list(self._paused)[::-1][:max(0, int(n))]
            for rollout_id in given:
                self._paused.pop(rollout_id)
                self.engine.abort(rollout_id)
        return {"reclaimed": len(given)}

    def _abort_rollouts_past(self, keep: int) -> None:
        """Every running rollout but the `keep` that started first (paused ones not counted)
        stops: paused while fewer than `pause_rollouts` are, else aborted (lock held)."""
        running = [r for r in self._rollouts if r not in self._paused]
        for rollout_id in running[keep:]:
            if len(self._paused) < self.pause_rollouts:
                self.engine.pause(rollout_id)
                self._paused[rollout_id] = None
                self.pauses += 1
            else:
                self.engine.abort(rollout_id)

    def _resume_paused(self) -> None:
        """Every paused rollout decodes again (lock held)."""
        for rollout_id in self._paused:
            self.engine.resume(rollout_id)
        self._paused.clear()

    def _reply(self, out: Completion, prompt: list[int]) -> dict:
        return {
            "id": f"cmpl-{out.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": "", "token_ids": out.token_ids,
                         "finish_reason": out.finish_reason,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in out.token_ids],
                                      "token_logprobs": out.logprobs}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out.token_ids)},
        } | ({"reroll_first_token_s": out.first_token_s} if out.first_token_s is not None else {})

    def load_weights(self, data: bytes, version: int) -> dict:
        """New weights (safetensors bytes), loaded on the engine's loop between decoding steps."""
        from safetensors.torch import load

        tensors = load(data)

        async def apply():
            self.engine.load_weights(tensors.items(), version)
        self._loop.run(apply())
        return {"version": version, "fingerprint": self.engine.weights_fingerprint()}

    def held_weights(self) -> dict | None:
        """The engine's weights as it holds them (its dtype); None when it does not expose them."""
        return held_weights(self.engine)

    def load_delta(self, data: bytes, base: int, version: int) -> dict:
        """A delta against weights version `base` (`reroll.engines.delta.patch_engine`), applied
        to the engine's weights between decoding steps. A server holding another version refuses
        it (BehindError: the sender sends full weights); so does an engine that does not expose
        its weights. A body that does not parse or does not fit changes no weight (ValueError)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            body = load(data)
        except SafetensorError as e:
            raise ValueError(f"the body is not a whole safetensors file ({len(data)} bytes: "
                             f"{e})") from None
        state, changed = patch_engine(self.engine, body, base)  # raises before any change

        async def apply():
            self.engine.load_weights(state.items(), version)
        self._loop.run(apply())
        return {"version": version, "fingerprint": self.engine.weights_fingerprint(),
                "changed_tensors": changed}

    def load_adapter(self, data: bytes, version: int) -> dict:
        """A LoRA adapter (safetensors bytes of `LoRAAdapter.adapter_tensors`), merged on the
        engine's loop between decoding steps. A body that does not parse, or an adapter that
        does not fit, is a ValueError before any weight changes."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(data)
        except SafetensorError as e:  # a truncated or damaged body
            raise ValueError(f"the body is not a whole safetensors file ({len(data)} bytes: "
                             f"{e})") from None

        async def apply():
            self.engine.load_adapter(tensors.items(), version)
        self._loop.run(apply())
        return {"version": version, "fingerprint": self.engine.weights_fingerprint()}

    def close(self) -> None:
        self._http.close()
        self._loop.close()


COMPLETION_PARAMS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                     "n", "logprobs", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                     "return_token_ids", "return_tokens_as_token_ids", "reroll_kind", "stream",
                     "user"}
"""What `/v1/completions` takes (vLLM's token extensions included); any other key is a 400
naming it, rather than a parameter silently ignored."""


def _integer(body: dict, name: str) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(name, f"must be an integer, not {value!r}")
    return value


def _version(request) -> int:
    try:
        return int(request.headers.get("X-Reroll-Version", 0))
    except ValueError:
        raise bad_param("X-Reroll-Version", "must be an integer") from None


def _app(server: CompletionServer):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "owned_by": "reroll"}]})

    async def load(request):
        try:
            window = float(request.query_params.get("window_s", "10"))
            wait = min(float(request.query_params.get("wait_idle_s", "0")), 60.0)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="window_s") from None
        if wait > 0:
            await run_in_threadpool(server.latency.wait_idle, wait)
        return JSONResponse(server.latency.report(window) | {
            "yield_to_serving": server.yield_to_serving,
            "rollouts_beside_serving": server.rollouts_beside_serving,
            "beside": server.beside, "refused": server.refused,
            "pause_rollouts": server.pause_rollouts,
            "paused": len(server._paused), "pauses": server.pauses})

    async def fingerprint(request):
        held = server.engine.version
        asked = request.query_params.get("version")
        if asked is not None and asked != str(held):
            raise OpenAIError(409, f"this server holds weights version {held}, not {asked}",
                              param="version")
        weights = server.held_weights()
        dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.") if weights else None
        return JSONResponse({"fingerprint": server.engine.weights_fingerprint(), "version": held,
                             "dtype": dtype})

    async def completions(request):
        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(server.complete, body))

    async def beside(request):
        return JSONResponse(server.keep_beside(_integer(await json_body(request), "keep")))

    async def reclaim(request):
        return JSONResponse(server.reclaim(_integer(await json_body(request), "n")))

    return make_app([
        Route("/v1/models", models), Route("/v1/load", load),
        Route("/v1/weights_fingerprint", fingerprint),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/beside", beside, methods=["POST"]),
        Route("/v1/reclaim", reclaim, methods=["POST"]), *_weight_routes(server)])


def _weight_routes(server: CompletionServer) -> list:
    """The routes that change the served weights: whole, as a delta, or an adapter."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def weights(request):
        version = _version(request)
        data = await request.body()
        try:
            return JSONResponse(await run_in_threadpool(server.load_weights, data, version))
        except (ValueError, TypeError, KeyError) as e:  # not safetensors, or not these weights
            raise OpenAIError(400, f"the weights cannot be loaded: {e}") from None

    async def delta(request):
        version = _version(request)
        try:
            base = int(request.headers.get("X-Reroll-Base-Version", ""))
        except ValueError:
            raise bad_param("X-Reroll-Base-Version", "must be an integer") from None
        data = await request.body()
        try:
            return JSONResponse(await run_in_threadpool(server.load_delta, data, base, version))
        except BehindError as e:
            raise OpenAIError(409, str(e), param="X-Reroll-Base-Version") from None
        except ValueError as e:
            raise OpenAIError(400, f"the delta cannot be applied: {e}") from None

    async def adapter(request):
        version = _version(request)
        data = await request.body()
        try:
            return JSONResponse(await run_in_threadpool(server.load_adapter, data, version))
        except (ValueError, AdapterSyncError) as e:  # not safetensors, or not this model's
            raise OpenAIError(400, f"the adapter cannot be loaded: {e}") from None

    return [Route("/v1/weights", weights, methods=["POST"]),
            Route("/v1/adapter", adapter, methods=["POST"]),
            Route("/v1/weights_delta", delta, methods=["POST"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder in Hugging Face format")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--yield-to-serving", action="store_true",
                        help="a serving request aborts the rollout requests running here")
    parser.add_argument("--rollouts-beside-serving", type=int, default=0, metavar="K",
                        help="with --yield-to-serving: the K oldest rollouts keep running beside "
                             "the users' requests (default 0)")
    parser.add_argument("--pause-rollouts", type=int, default=0, metavar="P",
                        help="with --yield-to-serving: pause (KV cache kept) up to P of the "
                             "rollouts that yield to the users instead of aborting them, and "
                             "resume them when the users leave (default 0)")
    args = parser.parse_args()
    if args.rollouts_beside_serving < 0:
        parser.error(f"--rollouts-beside-serving must be >= 0, not {args.rollouts_beside_serving}")
    if args.pause_rollouts < 0:
        parser.error(f"--pause-rollouts must be >= 0, not {args.pause_rollouts}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from reroll.engines.hf import HFEngine
    from reroll.models.loading import load_model, load_tokenizer

    model = load_model(args.model)
    engine = HFEngine(model, args.max_batch_size, load_tokenizer(args.model).pad_token_id)
    server = CompletionServer(engine, args.model, args.host, args.port, args.yield_to_serving,
                              args.rollouts_beside_serving, args.pause_rollouts,
                              getattr(model.config, "max_position_embeddings", None))
    print(f"serving {args.model} at {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()

"""The OpenAI-compatible gateway in front of a rollout engine.

Routes (each under a session's base URL `/s/<id>/v1`, or under `/v1` with the session's API key
as the bearer token): `POST chat/completions` (`tools`, `tool_choice`, `stream`),
`POST completions` (a text or token-id prompt), `GET models`, and `POST reward`
(`{"reward": x}`: the episode's reward, from a harness that knows it).

Sampling is the run's (`rollout.temperature`, `top_p`, `max_new_tokens`): the trainer's
importance ratios assume the policy sampled at the run's temperature, so a client's
`temperature` and `top_p` are accepted and not used; its `max_tokens` can only lower the limit.
A stream (`stream: true`) is sent as server-sent events once the completion is done (the engine
returns whole completions): a role chunk, the content, the tool calls, the finish reason.
Request errors are OpenAI-style JSON errors (`reroll.engines.http`): 400 naming an unsupported
parameter, `context_length_exceeded` when the prompt leaves no room in
`max_context_tokens`, 409 for a session whose episode has ended, 401 for an unknown session.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from reroll.engines.base import Engine, Request, SamplingParams
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
from reroll.rollout.gateway.chat import ChatRenderer, parse_reply, same_reply
from reroll.rollout.gateway.session import Call, Session, Sessions, api_key, session_of_key

SAMPLING = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n",
            "stream", "stream_options", "user", "logprobs", "top_logprobs",
            "frequency_penalty", "presence_penalty", "metadata", "store"}
CHAT_PARAMS = SAMPLING | {"messages", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_PARAMS = SAMPLING | {"prompt"}


@dataclass
class GatewayStats:
    """Counters over the gateway's life (reported as `gateway/*` metrics by the task)."""

    calls: int = 0
    spliced: int = 0
    """Chat calls whose prompt extends an earlier call's tokens."""
    retokenize_mismatch: int = 0
    """Spliced calls whose conversation, rendered and encoded afresh, gives other tokens (the
    engine's tokens are used; this counts how often re-encoding would have been wrong)."""
    refused: dict[str, int] = field(default_factory=dict)
    latency_s: list[float] = field(default_factory=list)
    """Per call: the gateway's own time (rendering, parsing), the engine's excluded."""

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


class Gateway:
    """Serves `engine` to agent harnesses, one session per episode (see the module doc)."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, params: SamplingParams,
                 max_context_tokens: int, host: str = "127.0.0.1", port: int = 0,
                 tool_parser: str = "hermes"):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.params, self.max_context_tokens = params, max_context_tokens
        self.renderer = ChatRenderer(tokenizer, tool_parser)
        # The engine decodes on a loop of its own, so a decoding step never holds up the HTTP
        # loop (parsing requests, rendering, answering other sessions).
        self._engine_loop = BackgroundLoop("reroll-gateway-engine")
        self.sessions = Sessions()
        self.stats = GatewayStats()
        self._http = ServerThread(self._app(), host, port)

    # -- sessions --------------------------------------------------------------------------------

    def open(self, task=None, seed: int = 0) -> Session:
        return self.sessions.open(task, seed)

    def end(self, session: Session) -> None:
        self.sessions.end(session)

    def base_url(self, session: Session) -> str:
        return f"{self._http.base}/s/{session.id}/v1"

    @property
    def url(self) -> str:
        """The base URL for clients that name their session by API key alone."""
        return f"{self._http.base}/v1"

    api_key = staticmethod(api_key)

    def close(self) -> None:
        self._http.close()
        self._engine_loop.close()

    # -- the calls -------------------------------------------------------------------------------

    def _session(self, request: HTTPRequest) -> Session:
        sid = request.path_params.get("sid") or session_of_key(
            request.headers.get("authorization"))
        found = self.sessions.get(sid) if sid else None
        if found is False:
            self.stats.refuse("session_ended")
            raise OpenAIError(409, f"session {sid}: its episode has ended; calls after the end "
                                   "of an episode are not served", code="session_ended")
        if found is None:
            raise OpenAIError(401, "no such session: use the base URL or API key reroll gave "
                                   "this episode", kind="authentication_error",
                              code="invalid_api_key")
        return found

    def _sampling(self, body: dict, session: Session, prompt_len: int) -> Request:
        if body.get("n", 1) != 1:
            raise bad_param("n", "only n=1 is supported")
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name):
                raise bad_param(name, "is not supported (only 0)")
        if body.get("top_logprobs"):
            raise bad_param("top_logprobs", "is not supported (only 0)")
        room = self.max_context_tokens - prompt_len
        if room < 1:
            raise context_exceeded(prompt_len, self.max_context_tokens)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise bad_param("max_tokens", f"must be a positive integer, not {limit!r}")
        params = session.params or self.params
        cap = min(params.max_new_tokens, room, limit or room)
        seed = (session.seed * 1_000_003 + len(session.calls)) % 2**63
        return Request([], SamplingParams(cap, params.temperature, params.top_p, params.top_k,
                                          params.stop_token_ids), seed)

    async def _generate(self, session: Session, prompt: list[int], body: dict,
                        call: Call) -> Call:
        request = self._sampling(body, session, len(prompt))
        request.prompt_ids = prompt
        start = time.perf_counter()
        engine = session.engine or self.engine
        completion = await self._engine_loop.wait(engine.generate(request))
        call.engine_s = time.perf_counter() - start
        call.prompt_ids, call.completion_ids = list(prompt), list(completion.token_ids)
        call.logprobs, call.finish_reason = list(completion.logprobs), completion.finish_reason
        call.policy_version = completion.policy_version
        call.routed_experts = completion.routed_experts
        call.token_versions = completion.versions()
        stop = completion.token_ids[-1:] if completion.finish_reason == "stop" else []
        call.stop_text = self.tokenizer.decode(stop) if stop else None
        with session.lock:
            if session.ended:  # the episode ended while the engine ran: nothing to train on
                self.stats.refuse("session_ended")
                raise OpenAIError(409, f"session {session.id}: its episode ended during the call",
                                  code="session_ended")
            call.index = len(session.calls)
            session.calls.append(call)
        self.stats.calls += 1
        return call

    def _chat_prompt(self, session: Session, messages: list[dict], tools) -> tuple[list, Call]:
        """The prompt ids of a chat call: spliced onto the latest call whose conversation and
        reply this one extends, else the template's rendering (see `chat.py`)."""
        call = Call(-1, [], [], [], "", 0, messages=messages, tools=tools)
        fresh = self.renderer.encode(self.renderer.render(messages, tools, True))
        for earlier in reversed(session.calls):
            if earlier.reply is None or earlier.tools != tools:
                continue
            k = len(earlier.messages)
            if len(messages) > k + 1 and messages[:k] == earlier.messages \
                    and same_reply(messages[k], earlier.reply):
                history = earlier.messages + [earlier.reply]
                rest = self.renderer.continuation(history, earlier.stop_text,
                                                  messages[k + 1:], tools)
                if rest is None:
                    break  # the template rewrote history: a fresh rendering
                prompt = earlier.prompt_ids + earlier.completion_ids + rest
                call.parent, call.retokenized_equal = earlier.index, prompt == fresh
                self.stats.spliced += 1
                self.stats.retokenize_mismatch += prompt != fresh
                return prompt, call
        return fresh, call

    async def chat(self, request: HTTPRequest):
        started = time.perf_counter()
        session = self._session(request)
        body = await json_body(request)
        try:
            check_params(body, CHAT_PARAMS)
        except OpenAIError:
            session.count("unsupported_parameter")
            self.stats.refuse("unsupported_parameter")
            raise
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise bad_param("messages", "must be a non-empty list of messages")
        if body.get("tool_choice") == "none":
            tools = None
        elif body.get("tool_choice") not in (None, "auto", "required"):
            raise bad_param("tool_choice", "only none, auto and required are supported")
        try:
            prompt, call = self._chat_prompt(session, messages, tools)
            own = time.perf_counter() - started
            engine_start = time.perf_counter()
            call = await self._generate(session, prompt, body, call)
        except OpenAIError as e:
            if e.code:
                session.count(e.code)
                self.stats.refuse(e.code)
            raise
        engine_s = time.perf_counter() - engine_start
        text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        parsed = parse_reply(text, tools, self.renderer.parser)
        session.tool_parse_errors += parsed.errors
        call.reply = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            call.reply["tool_calls"] = parsed.tool_calls
        finish = "tool_calls" if parsed.tool_calls else (
            "length" if call.finish_reason == "length" else "stop")
        self.stats.latency_s.append(own + time.perf_counter() - engine_start - engine_s)
        reply = _chat_reply(self.model_name, call, finish)
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(_chat_chunks(reply, usage), media_type="text/event-stream")
        return JSONResponse(reply)

    async def completions(self, request: HTTPRequest):
        session = self._session(request)
        body = await json_body(request)
        check_params(body, COMPLETION_PARAMS)
        if body.get("stream"):
            raise bad_param("stream", "is not supported on completions (use chat completions)")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = self.renderer.encode(prompt)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise bad_param("prompt", "must be a string or a non-empty list of token ids")
        parent = next((c.index for c in reversed(session.calls)
                       if prompt[:len(c.prompt_ids) + len(c.completion_ids)]
                       == c.prompt_ids + c.completion_ids), None)
        call = await self._generate(session, prompt, body,
                                    Call(-1, [], [], [], "", 0, parent=parent))
        text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "text": text, "token_ids": call.completion_ids,
                         "finish_reason": call.finish_reason,
                         "logprobs": {"token_logprobs": call.logprobs}}],
            "usage": _usage(call)})

    async def models(self, request: HTTPRequest):
        self._session(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "reroll"}]})

    async def reward(self, request: HTTPRequest):
        session = self._session(request)
        body = await json_body(request)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_param("reward", f"must be a number, not {value!r}")
        session.reward = float(value)
        return JSONResponse({"session": session.id, "reward": session.reward})

    def _app(self):
        routes = []
        for prefix in ("/s/{sid}/v1", "/v1"):
            routes += [Route(f"{prefix}/chat/completions", self.chat, methods=["POST"]),
                       Route(f"{prefix}/completions", self.completions, methods=["POST"]),
                       Route(f"{prefix}/models", self.models),
                       Route(f"{prefix}/reward", self.reward, methods=["POST"])]
        return make_app(routes)


def _usage(call: Call) -> dict:
    return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids),
            "total_tokens": len(call.prompt_ids) + len(call.completion_ids)}


def _chat_reply(model: str, call: Call, finish: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": call.reply, "finish_reason": finish,
                         "logprobs": None}],
            "usage": _usage(call),
            # reroll's own: which call of the session this was and the engine's share of its
            # latency (clients ignore unknown keys; the benchmark reads them).
            "reroll": {"call": call.index, "engine_s": round(call.engine_s, 6)}}


async def _chat_chunks(reply: dict, usage: bool):
    """The reply as `chat.completion.chunk` server-sent events."""
    choice, message = reply["choices"][0], reply["choices"][0]["message"]
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(delta: dict, finish=None, **extra) -> str:
        chunk = head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk | extra)}\n\n"

    yield event({"role": "assistant", "content": ""})
    if message.get("content"):
        yield event({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": i} | call]})
    yield event({}, choice["finish_reason"])
    if usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"

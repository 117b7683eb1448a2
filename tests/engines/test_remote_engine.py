"""The remote engine against real OpenAI-compatible servers on loopback (reroll's server around
the HF engine): same tokens and logprobs as in-process, least-loaded routing under a per-endpoint
cap, fail-over from a dead endpoint, endpoints added and removed while running, clear errors."""

import asyncio
import http.server
import socket
import threading

import pytest
from engine_checks import generate_all

from reroll.config.errors import ConfigError
from reroll.config.schema import RolloutConfig
from reroll.engines import build_engine
from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.engines.remote import RemoteEngine, RemoteEngineError, RemoteOptions
from reroll.engines.server import CompletionServer
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit


class CountingEngine:
    """Forwards to a real HF engine and records the most requests it had at once."""

    def __init__(self, engine):
        self.engine, self.now, self.peak, self.served = engine, 0, 0, 0

    async def generate(self, request):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await self.engine.generate(request)
        finally:
            self.now -= 1
            self.served += 1


@pytest.fixture(scope="module")
def servers(tiny_model, tokenizer):
    made = [CompletionServer(CountingEngine(HFEngine(load_model(tiny_model), 64,
                                                     tokenizer.pad_token_id)), "tiny")
            for _ in range(2)]
    yield made
    for server in made:
        server.close()


def free_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def requests(tokenizer, n, temperature=1.0, length=8):
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": f"{i} + 1 = ?"}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]
           for i in range(n)]
    return [Request(p, SamplingParams(length, temperature=temperature), seed=i)
            for i, p in enumerate(ids)]



def test_remote_completions_equal_the_in_process_engine(servers, tiny_model, tokenizer):
    local = HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)
    remote = RemoteEngine([servers[0].url])
    try:
        reqs = requests(tokenizer, 4, temperature=0.8)
        ours, theirs = generate_all(remote, reqs), generate_all(local, reqs)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert all(c.finish_reason == "length" for c in ours)
    finally:
        remote.close()


def test_least_loaded_routing_respects_the_cap(servers, tokenizer):
    for server in servers:
        server.engine.peak = server.engine.served = 0
    remote = RemoteEngine([s.url for s in servers], RemoteOptions(max_in_flight=3))
    try:
        outs = generate_all(remote, requests(tokenizer, 16))
    finally:
        remote.close()
    assert len(outs) == 16 and all(len(c.token_ids) == 8 for c in outs)
    assert all(s.engine.served >= 4 for s in servers)  # both endpoints took a share
    assert all(s.engine.peak <= 3 for s in servers)


def test_dead_endpoint_fails_over_and_endpoints_change_while_running(servers, tokenizer):
    dead = free_port_url()
    remote = RemoteEngine([dead, servers[0].url], RemoteOptions(backoff_s=30, max_retries=2))
    try:
        assert all(len(c.token_ids) == 8 for c in generate_all(remote, requests(tokenizer, 6)))
        assert remote.endpoints[dead].failures >= 1
        remote.remove_endpoint(servers[0].url)
        remote.add_endpoint(servers[1].url)
        before = servers[1].engine.served
        generate_all(remote, requests(tokenizer, 3))
        assert servers[1].engine.served == before + 3
    finally:
        remote.close()
    only_dead = RemoteEngine([dead], RemoteOptions(backoff_s=0.01, max_retries=2))
    try:
        with pytest.raises(RemoteEngineError, match="failed after 3 attempts"):
            generate_all(only_dead, requests(tokenizer, 1))
    finally:
        only_dead.close()


def test_abort_cancels_the_request(servers, tokenizer):
    remote = RemoteEngine([servers[0].url])
    request = requests(tokenizer, 1, length=2000)[0]

    async def go():
        task = asyncio.create_task(remote.generate(request))
        await asyncio.sleep(0.2)
        remote.abort(request.request_id)
        return await task

    try:
        out = asyncio.run(go())
    finally:
        remote.close()
    assert out.finish_reason == "abort" and out.token_ids == []


def test_unreachable_endpoint_is_a_config_error_naming_the_fix():
    url = free_port_url()
    rollout = RolloutConfig(engine="remote", remote={"endpoints": [url]})
    with pytest.raises(ConfigError, match=r"unreachable: .*Start the server"):
        build_engine(rollout, "unused")


class Garbling(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server that lists its model but answers completions with broken JSON."""

    def do_GET(self):
        self._reply(b'{"data": [{"id": "garbled"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b'{"choices": [{"text": "4", ')

    def _reply(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class WideBacklogServer(http.server.ThreadingHTTPServer):
    # The default listen backlog of 5 refused some of 16 simultaneous connections on a loaded CI
    # machine; a refused connection is a network error, backed off as it should be, and the test
    # then timed out for a reason that is not the one under test.
    request_queue_size = 128


def test_a_malformed_reply_is_named_not_timed_out(tokenizer):
    """Issue 49: a judge endpoint replying with broken JSON was backed off as a dead one by every
    failing request at once, so its calls were counted as time-outs. The endpoint is up: each
    request fails at once, saying the reply was malformed."""
    server = WideBacklogServer(("127.0.0.1", 0), Garbling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote = RemoteEngine([f"http://127.0.0.1:{server.server_address[1]}/v1"],
                          RemoteOptions(max_retries=2, backoff_s=1.0))

    async def one(request):
        try:
            await asyncio.wait_for(remote.generate(request), 10.0)
        except Exception as e:  # noqa: BLE001 - what each request ends with is the point
            return e

    async def go():
        return await asyncio.gather(*(one(r) for r in requests(tokenizer, 16)))

    try:
        errors = asyncio.run(go())
    finally:
        remote.close()
        server.shutdown()
        server.server_close()
    assert all(isinstance(e, RemoteEngineError) for e in errors), errors
    assert all("malformed reply, not an OpenAI completion" in str(e) for e in errors), errors[0]

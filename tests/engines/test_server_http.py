"""The completion server on its ASGI stack (Starlette on uvicorn): bad requests get OpenAI-style
JSON errors naming the parameter, a prompt past the context is `context_length_exceeded`, and a
good request still returns the engine's tokens and logprobs."""

import httpx
import pytest

from reroll.engines.hf import HFEngine
from reroll.engines.server import CompletionServer
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    made = CompletionServer(HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id), "tiny",
                            max_context_tokens=32)
    yield made
    made.close()


def post(server, body):
    return httpx.post(f"{server.url}/completions", json=body, timeout=60)


def test_a_completion_carries_token_ids_and_logprobs(server):
    reply = post(server, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 4
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1], "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "text"}, "prompt"),
    ({"prompt": [1], "n": 2}, "n"),
    ({"prompt": [1], "temperature": -1}, "temperature"),
])
def test_a_bad_parameter_is_a_400_naming_it(server, body, param):
    reply = post(server, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_a_prompt_past_the_context_is_context_length_exceeded(server):
    reply = post(server, {"prompt": list(range(1, 40)), "max_tokens": 4})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    # A prompt that fits has its completion cut at the context.
    reply = post(server, {"prompt": list(range(1, 30)), "max_tokens": 50, "ignore_eos": True})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) <= 3


def test_unknown_route_and_non_json_body(server):
    assert httpx.get(f"{server.url}/nothing").status_code == 404
    reply = httpx.post(f"{server.url}/completions", content=b"{nope", timeout=10)
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]

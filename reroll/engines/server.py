"""A small OpenAI-compatible completion server around any reroll engine (the HF engine by default).

It speaks the subset of `/v1/completions` that the remote engine uses, with vLLM's token
extensions: `prompt` as token ids, `return_token_ids`, `logprobs`, `seed`, `top_k`,
`stop_token_ids`. Use it to serve a checkpoint to remote rollouts or judges where vLLM is not
installed, and in tests. Run: `python -m reroll.engines.server MODEL_DIR --port 8000`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from reroll.engines.base import Engine, Request, SamplingParams
from reroll.engines.loop import BackgroundLoop


class CompletionServer:
    """Serves `engine` on host:port in a background thread (port 0: any free port)."""

    def __init__(self, engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 0):
        self.engine, self.model_name = engine, model_name
        self._loop = BackgroundLoop("reroll-server")
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def complete(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("`prompt` must be a list of token ids")
        params = SamplingParams(
            max_new_tokens=int(body.get("max_tokens", 16)),
            temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
            top_k=max(0, int(body.get("top_k", 0))),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()))
        request = Request(prompt, params, seed=int(body.get("seed") or 0))
        out = self._loop.run(self.engine.generate(request))
        return {
            "id": f"cmpl-{out.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": "", "token_ids": out.token_ids,
                         "finish_reason": out.finish_reason,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in out.token_ids],
                                      "token_logprobs": out.logprobs}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out.token_ids)},
        }

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._loop.close()


def _handler(server: CompletionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: one line per request is noise in rollouts
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._reply(200, {"object": "list", "data": [
                    {"id": server.model_name, "object": "model", "owned_by": "reroll"}]})
            else:
                self._reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/completions":
                return self._reply(404, {"error": {"message": f"no route {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._reply(200, server.complete(body))
            except (ValueError, TypeError, KeyError) as e:
                self._reply(400, {"error": {"message": str(e)}})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder in Hugging Face format")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=256)
    args = parser.parse_args()
    from reroll.engines.hf import HFEngine
    from reroll.models.loading import load_model, load_tokenizer

    engine = HFEngine(load_model(args.model), args.max_batch_size,
                      load_tokenizer(args.model).pad_token_id)
    server = CompletionServer(engine, args.model, args.host, args.port)
    print(f"serving {args.model} at {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()

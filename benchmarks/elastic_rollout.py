"""ROSE on this machine: rollouts on a dedicated engine alone vs also on a serving endpoint's spare
capacity, under the same bursty user traffic, at equal work (the same rollout requests, the same
tokens).

The hardware, split honestly: the serving endpoint is reroll's server in its own process with 1
torch thread (one core); the dedicated rollout engine is an HF engine in this process with 1
thread (the other core). The endpoint's users are a load generator replaying a bursty trace
(seeded Poisson arrivals, BURST_RATE requests/s for BURST_S, then IDLE_RATE for IDLE_S,
repeating; each USER_PROMPT tokens in, USER_NEW tokens out) from t = 0 of every run.

1. Calibration: the trace alone on the endpoint gives its p99 time to first token and time per
   output token; the objective is SLO_FACTOR x those (the endpoint's users accept that much).
   The trace is replayed CALIBRATIONS times and each p99 is the median of theirs: one replay's
   p99 (about 60 requests, so nearly their slowest) moved 0.130-0.163 s (TTFT) and 0.034-0.055
   s (TPOT) between runs on this shared machine, and an objective set in a quiet moment was
   missed by the users with nothing lent (2026-11-26).
2. Each run: ROLLOUTS requests of ROLLOUT_NEW tokens. `fixed`: the dedicated engine alone.
   `elastic` (`rollout.serving_endpoint`): the ElasticEngine lends the endpoint up to MAX_LENT
   of them while its users' p99s stay under `headroom` x the objective; when a user request
   arrives the endpoint gives back all but the BESIDE oldest of them and starts no new one
   until its users have left (and gives back those BESIDE too while a p99 is past it). With
   PAUSE (`--pause-rollouts`), up to PAUSE of those it would give back are paused instead (KV
   cache kept, no work under the users) and resumed when the users leave; the dedicated engine
   takes paused ones back when it has room no waiting rollout fills (the run's tail).
   Rollout throughput = rollout tokens / time until the last rollout ends; SLO attainment = the
   share of user requests in that time that met both objectives. The modes alternate ROUNDS
   times; each keeps its fastest run.

What it models: a serving endpoint with idle time between bursts, and an objective measured on
its own traffic. What it does not: GPUs (decode here is bound by one core's speed, and a CPU
engine's batch slows more per added sequence than a GPU's, so lending costs the users more than
it would there), network distance, and a real trace (the bursts are synthetic).
Last line: JSON with `speedup` (elastic over fixed rollout throughput), `slo_attainment`
(elastic), `slo_attainment_fixed` (both of the fastest runs), `slo_attainment_min` (the lowest
of every elastic run), and the runs.

    .venv/bin/python benchmarks/elastic_rollout.py [--rounds R] [--model small|tiny] [--beside K]
        [--pause P]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console

from reroll.engines.base import Request, SamplingParams
from reroll.engines.elastic import ElasticEngine, ServingObjective
from reroll.engines.hf import HFEngine
from reroll.engines.server import p99
from reroll.models.loading import load_model

ROOT = Path("runs/bench_elastic")
ROLLOUTS, ROLLOUT_PROMPT, ROLLOUT_NEW = 96, 48, 96
USER_PROMPT, USER_NEW = 32, 32
BURST_RATE, BURST_S, IDLE_RATE, IDLE_S = 6.0, 3.0, 0.5, 5.0
SLO_FACTOR = 2.0
CALIBRATION_S, CALIBRATIONS = 24.0, 3
MAX_LENT, DEDICATED_MAX = 16, 16
"""The dedicated engine decodes at most DEDICATED_MAX sequences at once in both modes (its
memory's limit on a GPU; here about where one core's throughput stops growing with the batch)."""
BESIDE = 4
"""Rollouts the endpoint keeps running beside its users (`--rollouts-beside-serving`): 0, 2 and
4 gave `speedup` 1.01, 1.05 and 1.19 on 2026-11-26 (docs/benchmarks.md)."""
PAUSE = MAX_LENT
"""Most rollouts the endpoint pauses at once for its users (`--pause-rollouts`); 0: it gives
every one past BESIDE back (aborted, prefilled again where it continues)."""
console = Console(stderr=True)


def build_model(preset: str) -> str:
    from reroll.models.factory import make_model

    folder = ROOT / preset
    if not (folder / "config.json").is_file():
        make_model(folder, preset, seed=0)
    return str(folder)


def trace(duration_s: float, seed: int = 0) -> list[float]:
    """Arrival times of the users' requests: Poisson within alternating burst and idle phases."""
    rng, t, arrivals = random.Random(seed), 0.0, []
    while t < duration_s:
        period = t % (BURST_S + IDLE_S)
        rate = BURST_RATE if period < BURST_S else IDLE_RATE
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


class Users:
    """Replays the trace against the endpoint from `start()`; records each request's latency."""

    def __init__(self, url: str, vocab: int, duration_s: float):
        self.url, self.arrivals = url, trace(duration_s)
        self.vocab, self.results, self._stop = vocab, [], threading.Event()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._threads = [threading.Thread(target=self._one, args=(i, at), daemon=True)
                         for i, at in enumerate(self.arrivals)]
        self._launcher = threading.Thread(target=self._launch, daemon=True)
        self._launcher.start()

    def _launch(self) -> None:
        for thread, at in zip(self._threads, self.arrivals, strict=True):
            delay = self.t0 + at - time.perf_counter()
            if self._stop.wait(max(0.0, delay)):
                return
            thread.start()

    def _one(self, i: int, at: float) -> None:
        rng = random.Random(1000 + i)
        body = {"model": "m", "prompt": [rng.randrange(5, self.vocab) for _ in range(USER_PROMPT)],
                "max_tokens": USER_NEW, "temperature": 1.0, "seed": i, "ignore_eos": True,
                "stop_token_ids": []}
        start = time.perf_counter()
        reply = httpx.post(f"{self.url}/completions", json=body, timeout=600).json()
        latency = time.perf_counter() - start
        tokens = len(reply["choices"][0]["token_ids"])
        ttft = reply.get("reroll_first_token_s", latency)
        self.results.append({"at": at, "start": start - self.t0, "end": start + latency - self.t0,
                             "latency": latency,
                             "ttft": ttft, "tpot": (latency - ttft) / max(tokens - 1, 1)})

    def stop(self) -> list[dict]:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive() or thread.ident is not None:
                thread.join(timeout=600)
        return sorted(self.results, key=lambda r: r["at"])


def start_server(model: str, port: int, beside: int, pause: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "reroll.engines.server", model,
                               "--port", str(port), "--threads", "1", "--yield-to-serving",
                               "--rollouts-beside-serving", str(beside),
                               "--pause-rollouts", str(pause)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in server.stdout:  # progress bars come first
        seen.append(line)
        if line.startswith("serving "):
            threading.Thread(target=server.stdout.read, daemon=True).start()  # keep it drained
            return server
    raise RuntimeError("the server did not start:\n" + "".join(seen))


def rollout_requests(vocab: int) -> list[Request]:
    rng = random.Random(7)
    return [Request([rng.randrange(5, vocab) for _ in range(ROLLOUT_PROMPT)],
                    SamplingParams(ROLLOUT_NEW, temperature=1.0), seed=i)
            for i in range(ROLLOUTS)]


async def generate(engine, requests: list[Request]) -> list:
    return await asyncio.gather(*(engine.generate(r) for r in requests))


def run_mode(mode: str, model: str, url: str, vocab: int, objective: ServingObjective) -> dict:
    dedicated = HFEngine(load_model(model), DEDICATED_MAX, 0)  # the same engine in both modes
    engine = dedicated if mode == "fixed" else \
        ElasticEngine(dedicated, url, objective, DEDICATED_MAX, model="m")
    users = Users(url, vocab, duration_s=600)
    requests = rollout_requests(vocab)
    before = httpx.get(f"{url}/load").json()
    users.start()
    start = time.perf_counter()
    outs = asyncio.run(generate(engine, requests))
    seconds = time.perf_counter() - start
    served = [r for r in users.stop() if r["at"] <= seconds]
    met = [r["ttft"] <= objective.ttft_p99_s and r["tpot"] <= objective.tpot_p99_s for r in served]
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"mode": mode, "seconds": seconds, "rollout_tokens": tokens,
              "tokens_per_s": tokens / seconds, "user_requests": len(served),
              "slo_attainment": sum(met) / max(len(met), 1),
              "user_ttft_p99_s": p99([r["ttft"] for r in served]),
              "user_tpot_p99_s": p99([r["tpot"] for r in served])}
    result["users_busy_s"] = busy([(r["start"], r["end"]) for r in served], seconds)
    if mode == "elastic":
        c = engine.counters
        result |= {"lent": c.lent, "backoffs": c.backoffs, "preempted": c.preempted,
                   "unkept": c.unkept,
                   "lent_tokens": c.lent_tokens, "kept_tokens": c.kept_tokens,
                   "lent_busy_s": c.lent_busy_s, "reclaimed": c.reclaimed}
        after = httpx.get(f"{url}/load").json()
        result |= {key: after.get(key, 0) - before.get(key, 0) for key in ("refused", "pauses")}
        engine.close()
    console.log(result)
    return result


def busy(intervals: list[tuple[float, float]], until: float) -> float:
    """Seconds in [0, until] covered by at least one of the intervals."""
    total, reach = 0.0, 0.0
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, until)
        if end > start:
            total += end - start
            reach = end
    return total


def calibrate(url: str, vocab: int) -> dict:
    """The users' p99s alone on the endpoint: the median of CALIBRATIONS replays of the trace
    (each replay's own p99s under `replays`)."""
    replays = []
    for _ in range(CALIBRATIONS):
        users = Users(url, vocab, CALIBRATION_S)
        users.start()
        time.sleep(CALIBRATION_S)
        done = users.stop()
        replays.append({"ttft_p99_s": p99([r["ttft"] for r in done]),
                        "tpot_p99_s": p99([r["tpot"] for r in done]), "requests": len(done)})
    return {key: statistics.median(r[key] for r in replays) for key in ("ttft_p99_s", "tpot_p99_s")} \
        | {"replays": replays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["small", "tiny"])
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--beside", type=int, default=BESIDE,
                        help="rollouts the endpoint keeps beside its users (--rollouts-beside-"
                             "serving); 0: every rollout yields to a user")
    parser.add_argument("--pause", type=int, default=PAUSE,
                        help="rollouts the endpoint pauses at once for its users instead of "
                             "giving them back (--pause-rollouts); 0: none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.model)
    vocab = load_model(model).config.vocab_size
    server = start_server(model, args.port, args.beside, args.pause)
    url = f"http://127.0.0.1:{args.port}/v1"
    try:
        base = calibrate(url, vocab)
        objective = ServingObjective(SLO_FACTOR * base["ttft_p99_s"],
                                     SLO_FACTOR * base["tpot_p99_s"],
                                     max_lent=MAX_LENT, control_interval_s=0.05, window_s=1.0)
        console.log(f"users alone: {base}; objective ttft p99 {objective.ttft_p99_s:.3f} s, "
                    f"tpot p99 {objective.tpot_p99_s:.4f} s")
        runs = {"fixed": [], "elastic": []}
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(run_mode(mode, model, url, vocab, objective))
    finally:
        server.terminate()
        server.wait(timeout=30)
    best = {mode: min(rs, key=lambda r: r["seconds"]) for mode, rs in runs.items()}
    assert best["fixed"]["rollout_tokens"] == best["elastic"]["rollout_tokens"]  # equal work
    print(json.dumps({
        "speedup": best["fixed"]["seconds"] / best["elastic"]["seconds"],
        "slo_attainment": best["elastic"]["slo_attainment"],
        "slo_attainment_fixed": best["fixed"]["slo_attainment"],
        "slo_attainment_min": min(r["slo_attainment"] for r in runs["elastic"]),
        "rollout_tokens": best["fixed"]["rollout_tokens"], "beside": args.beside,
        "pause": args.pause,
        "objective": {"ttft_p99_s": objective.ttft_p99_s, "tpot_p99_s": objective.tpot_p99_s},
        "users_alone": base, "runs": runs}))


if __name__ == "__main__":
    main()

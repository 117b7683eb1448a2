"""The gateway vs the built-in agent loop: the same episodes on the same engine.

Workload: `guess_number` (high 8) episodes of up to `--turns` turns on a random-init model of
the `--preset` size (default `small`, ~30M parameters, where decoding rather than Python
overhead takes the time, as with real models; `tiny` shows the overhead's worst case) with the
HF engine, `--episodes` at once. The built-in AgentLoop drives the env itself (token in, token
out); through the gateway an unmodified `openai` SDK harness drives the same env, each episode
in its own thread and session, resending the conversation on every call as any client does.
Same model, engine, sampling settings and env seeds; the modes alternate `--repeats` times and
each keeps its fastest run (this machine's noise only slows a run down).

Figures: `throughput_ratio` (the gateway's generated tokens per second over the loop's; goal
>= 0.8), `faithful_fraction` (the calls whose prompt and completion tokens and logprobs the
assembled training samples reproduce exactly; goal 1.0) and `added_latency_ms_p50` (a call's
latency seen by the SDK less the engine's time: HTTP, rendering, splicing, parsing).

    .venv/bin/python benchmarks/gateway.py [--preset small|tiny] [--episodes N] [--turns N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reroll.engines.base import SamplingParams  # noqa: E402
from reroll.engines.hf import HFEngine  # noqa: E402
from reroll.envs import make_env  # noqa: E402
from reroll.models.factory import make_model  # noqa: E402
from reroll.models.loading import load_model, load_tokenizer  # noqa: E402
from reroll.rollout.agent_loop import AgentJob  # noqa: E402
from reroll.rollout.agent_loop import run_episodes as loop_episodes  # noqa: E402
from reroll.rollout.gateway import AgentSpec, Gateway  # noqa: E402
from reroll.rollout.gateway import run_episodes as gateway_episodes  # noqa: E402

CONTEXT = 1024


def harness(turns: int, added: list[float], lock: threading.Lock):
    """An OpenAI-SDK agent playing the env: observation in, reply out, until the env ends."""
    import openai

    def play(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        env = make_env("guess_number", high=8, max_turns=turns)
        obs, _ = env.reset(seed=task["seed"])
        messages = [{"role": "user", "content": obs}]
        total = 0.0
        for _ in range(turns):
            start = time.perf_counter()
            reply = client.chat.completions.create(model="tiny", messages=messages)
            took = time.perf_counter() - start
            with lock:
                added.append(took - reply.model_extra["reroll"]["engine_s"])
            text = reply.choices[0].message.content
            obs, reward, terminated, truncated, _ = env.step(text)
            total += reward
            if terminated or truncated:
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
        return total

    return play


def run_loop(engine, tokenizer, params, seeds, turns) -> tuple[int, float]:
    job = AgentJob(engine, tokenizer, lambda: make_env("guess_number", high=8, max_turns=turns),
                   params, max_turns=turns, max_context_tokens=CONTEXT)
    start = time.perf_counter()
    trajectories, _ = loop_episodes(job, seeds, 1, run_seed=0, step=1)
    wall = time.perf_counter() - start
    return sum(sum(t.policy_mask) for t in trajectories), wall


def run_gateway(gateway, seeds, turns, added) -> tuple[int, float, float]:
    spec = AgentSpec(entrypoint=harness(turns, added, threading.Lock()), time_limit_s=300)
    start = time.perf_counter()
    trajectories, stats = gateway_episodes(gateway, spec, [{"seed": s} for s in seeds], 1, seed=0)
    wall = time.perf_counter() - start
    failed = sum(stats.failures.values())
    if failed:
        raise RuntimeError(f"{failed} gateway episodes failed: {stats.errors[:3]}")
    return (sum(sum(t.policy_mask) for t in trajectories), wall,
            stats.faithful_calls / max(stats.calls, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / args.preset, args.preset, seed=0)
        tokenizer = load_tokenizer(str(path))
        engine = HFEngine(load_model(str(path)), 64, tokenizer.pad_token_id)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    gateway = Gateway(engine, tokenizer, "tiny", params, CONTEXT)
    seeds = list(range(args.episodes))
    loop_best, gateway_best, faithful, added = None, None, [], []
    try:
        run_loop(engine, tokenizer, params, seeds[:2], args.turns)  # warm-up
        for _ in range(args.repeats):
            tokens, wall = run_loop(engine, tokenizer, params, seeds, args.turns)
            rate = tokens / wall
            loop_best = max(loop_best or 0.0, rate)
            print(f"agent loop: {tokens} tokens in {wall:.2f} s ({rate:.1f} tok/s)", flush=True)
            tokens, wall, fraction = run_gateway(gateway, seeds, args.turns, added)
            rate = tokens / wall
            gateway_best = max(gateway_best or 0.0, rate)
            faithful.append(fraction)
            print(f"gateway:    {tokens} tokens in {wall:.2f} s ({rate:.1f} tok/s), faithful "
                  f"{fraction:.3f}", flush=True)
    finally:
        gateway.close()
    print(json.dumps({
        "throughput_ratio": round(gateway_best / loop_best, 3),
        "faithful_fraction": min(faithful),
        "added_latency_ms_p50": round(1000 * statistics.median(added), 2),
        "loop_tokens_per_s": round(loop_best, 1), "gateway_tokens_per_s": round(gateway_best, 1),
        "gateway_own_ms_p50": round(1000 * statistics.median(gateway.stats.latency_s), 2),
        "retokenize_mismatch_frac": round(gateway.stats.retokenize_mismatch
                                          / max(gateway.stats.spliced, 1), 3),
        "preset": args.preset, "episodes": args.episodes, "turns": args.turns,
        "repeats": args.repeats}))


if __name__ == "__main__":
    main()

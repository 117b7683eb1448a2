"""reroll dpo vs TRL's DPOTrainer: the same DPO work on the same tiny model and pairs.

    .venv/bin/python benchmarks/dpo_vs_trl.py [--steps 60] [--rounds 2] [--threads 2]
                                              [--micro-batch 16] [--device cpu|cuda]
                                              [--model DIR --pairs N --eval-pairs N --lr LR]

Both sides start from the same warm-started model (a short reroll SFT of a freshly built tiny
model on worked arithmetic solutions) and train on the same preference pairs (`reroll make-data
--preferences`: chosen the worked right answer, rejected a wrong one), with the same loss (sigmoid
DPO, beta 0.1), batch (16 pairs), steps, learning rate (constant after 2 warm-up steps, AdamW,
gradient clip 1.0), precision (fp32, no gradient checkpointing: TRL 1.x defaults to bf16 and
checkpointing, turned off here) and reference (the starting model). With `--device cuda` both sides train on the GPU in bf16
autocast (reroll's `device: cuda`, TRL's `bf16=True`), the weights staying fp32. TRL gets the pairs in its
conversational format (it applies the same chat template) and runs each batch as one forward;
reroll runs it as
micro-batches of `--micro-batch` sequences (its `train.micro_batch_size`; 16, the default on a
CPU, = two micro-batches of 8 pairs, shortest pairs first, the gradient accumulated: the same
update of 16 pairs; 32, the default on a GPU, = one forward a step, as TRL: there the tiny model
is bound by the host's work per forward and backward, not by the GPU's).

Each training run is a fresh process with the same torch thread count; the sides alternate
(TRL, reroll, TRL, reroll, ...) so drift of the machine cancels. Round i seeds both sides with i
(the order of the pairs), so the rounds also show how far each side's held-out accuracy moves
with the seed; `reroll_accuracy` and `trl_accuracy` are the means over the rounds.
Two times of each run:
- training (`throughput_ratio`): the reference's log-probabilities of the pairs and the steps.
  TRL's `trainer.train()` (its reference forward is inside each step); reroll's scoring of every
  pair with the reference once (in the pipeline's construction) plus its `run()`. Loading the
  model and tokenising the pairs is outside on both sides.
- end to end (`end_to_end_ratio`): from reading the pairs file to the trained model, loading the
  model and tokenising the pairs included (TRL: the dataset, `from_pretrained` and the
  trainer's construction; reroll: the pipeline's construction). Until 2026-11-26 the benchmark
  set reroll's end to end against TRL's training alone.
Writing the trained model is outside both times, on both sides: TRL saves nothing in `train()`
(`save_strategy="no"`) and its final model after the clock stops; reroll's `run()` writes its
last checkpoint (weights, AdamW's moments: resumable) and its final model, which the clock
leaves out (`reroll_save_seconds`, reported apart; counted in every time until 2026-11-27).
Throughput: pairs trained per second. After training, every final model is evaluated the same
way: held-out preference accuracy of DPO's implicit reward beta * log(pi / pi_ref) against the
starting model, with reroll's tokenisation.

`--model DIR` starts both sides from that model instead of the tiny warm start, e.g. the real
SmolLM2-135M-Instruct (`make models/smollm2/config.json`; its 49,152-token vocabulary and 30
layers make the work the model's, where the tiny one's is mostly overhead). On a 2-core CPU a
step of it takes seconds, so `--pairs` (the training pairs; `--steps` x 16 is one pass),
`--eval-pairs` and `--lr` (1e-3 suits the tiny model, about 1e-5 a pretrained one) size it.

The last line printed is one JSON object; `throughput_ratio` is reroll's pairs/s over TRL's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH_PAIRS, BETA = 16, 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs per side, alternating; round i seeds both sides with i")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    p.add_argument("--micro-batch", type=int,
                   help="reroll's train.micro_batch_size (sequences; 2 per pair); default 16 "
                        "on a CPU, 32 (one forward a step) on a GPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides train (cuda: bf16 autocast on both)")
    p.add_argument("--model", help="start both sides from this model directory (default: the "
                                   "tiny model, warm-started here)")
    p.add_argument("--pairs", type=int, default=1000, help="training pairs")
    p.add_argument("--eval-pairs", type=int, default=200, help="held-out pairs")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of both sides")
    p.add_argument("--side", choices=["trl", "reroll"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.micro_batch is None:
        args.micro_batch = 2 * BATCH_PAIRS if args.device == "cuda" else BATCH_PAIRS
    return args


def prepare(work: Path, threads: int, model: str | None, pairs: int, eval_pairs: int
            ) -> dict[str, str]:
    """The starting model (`model`, or the tiny one warm-started here) and the pairs, built
    once."""
    import torch

    from reroll.config.schema import SFTConfig
    from reroll.data.preferences import write_arithmetic_preferences
    from reroll.data.tasks import write_arithmetic
    from reroll.models.factory import make_model
    from reroll.pipelines.sft import train_sft

    torch.set_num_threads(threads)
    written = write_arithmetic_preferences(work / "pairs", pairs, eval_pairs, seed=0)
    pair_files = {"train": str(written["train"]), "eval": str(written["eval"])}
    if model is not None:
        return {"model": str(Path(model).resolve()), **pair_files}
    tiny = make_model(work / "tiny", "tiny", seed=0)
    data = write_arithmetic(work / "arithmetic", 4000, 20, seed=0)
    sft = train_sft(SFTConfig.model_validate({
        "output_dir": str(work / "sft"), "model": {"path": str(tiny)},
        "data": {"train": str(data["train"]), "response_key": "solution"}, "steps": 150,
        "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 10, "schedule": "cosine"},
        "train": {"micro_batch_size": 32, "num_threads": threads},
        "tracking": {"progress": False, "tensorboard": False}}))
    return {"model": sft["final_model"], **pair_files}


def run_reroll(paths: dict, steps: int, threads: int, out: Path, micro: int,
               device: str, seed: int, lr: float) -> dict[str, float]:
    from reroll.config.preference import DPOConfig
    from reroll.pipelines.dpo import DPOObjective
    from reroll.pipelines.preference import preference_step
    from reroll.pipelines.run import Run

    scoring, saving = [], []

    def timed(into: list, fn):
        def call(*args, **kwargs):
            synchronize(device)
            start = time.perf_counter()
            fn(*args, **kwargs)
            synchronize(device)
            into.append(time.perf_counter() - start)
        return call

    class TimedDPO(DPOObjective):
        def prepare(self, name, pairs):  # the reference's scoring of every pair
            timed(scoring, super().prepare)(name, pairs)

        def save_final(self, directory):
            timed(saving, super().save_final)(directory)

    config = DPOConfig.model_validate({
        "output_dir": str(out), "model": {"path": paths["model"]}, "device": device,
        "seed": seed,
        "data": {"train": paths["train"]}, "steps": steps, "batch_size": BATCH_PAIRS,
        "loss": {"name": "sigmoid", "beta": BETA},
        "optimizer": {"lr": lr, "warmup_steps": 2, "grad_clip": 1.0},
        "train": {"micro_batch_size": micro, "num_threads": threads},
        "checkpoint": {"every_steps": 0}, "sample_prompts": 0,
        "tracking": {"progress": False, "tensorboard": False}})
    start = time.perf_counter()
    pipeline = Run(config, step=lambda c: preference_step(c, TimedDPO))
    strategy = pipeline.step.objective.strategy
    strategy.save = timed(saving, strategy.save)  # the checkpoints' writing
    loop_start = time.perf_counter()
    pipeline.run()
    synchronize(device)
    end = time.perf_counter()
    return {"seconds": sum(scoring) + end - loop_start - sum(saving),
            "end_to_end_seconds": end - start - sum(saving), "save_seconds": sum(saving)}


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that the time counts all of it."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_trl(paths: dict, steps: int, threads: int, out: Path, device: str,
            seed: int, lr: float) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    start = time.perf_counter()
    rows = [json.loads(line) for line in open(paths["train"])]
    dataset = Dataset.from_list([{
        "prompt": [{"role": "user", "content": r["prompt"]}],
        "chosen": [{"role": "assistant", "content": r["chosen"]}],
        "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    args = DPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=BATCH_PAIRS,
                     max_steps=steps, learning_rate=lr, lr_scheduler_type="constant_with_warmup",
                     warmup_steps=2, max_grad_norm=1.0, beta=BETA, loss_type="sigmoid",
                     report_to="none", save_strategy="no", logging_steps=steps,
                     use_cpu=device == "cpu",
                     dataloader_num_workers=0, disable_tqdm=True, seed=seed,
                     # TRL 1.x turns both on by default; reroll trains without checkpointing,
                     # in fp32 on a CPU (bf16 on one without bf16 units is many times slower)
                     # and in bf16 autocast on a GPU
                     bf16=device == "cuda", gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset,
                         processing_class=tokenizer)
    train_start = time.perf_counter()
    trainer.train()
    synchronize(device)
    end = time.perf_counter()
    model.save_pretrained(out / "final")
    return {"seconds": end - train_start, "end_to_end_seconds": end - start}


def held_out_accuracy(paths: dict, model_dir: str, threads: int) -> float:
    """Share of held-out pairs whose chosen response gets the higher implicit DPO reward (a tie
    counts half), against the starting model as reference."""
    import torch

    from reroll.data.preferences import load_preferences
    from reroll.models.loading import load_model, load_tokenizer
    from reroll.pipelines.dpo import pair_logprobs
    from reroll.pipelines.preference import tokenize_pair

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(paths["model"])
    pairs = [tokenize_pair(tokenizer, row, 512) for row in load_preferences(paths["eval"])]
    ref = pair_logprobs(load_model(paths["model"]), pairs, tokenizer.pad_token_id, 64)
    policy = pair_logprobs(load_model(model_dir), pairs, tokenizer.pad_token_id, 64)
    margin = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    return float(((margin > 0).float() + 0.5 * (margin == 0).float()).mean())


def child(args: argparse.Namespace) -> None:
    paths = json.loads(Path(args.work, "paths.json").read_text())
    out = Path(args.out)
    if args.side == "trl":
        times = run_trl(paths, args.steps, args.threads, out, args.device, args.seed, args.lr)
    else:
        times = run_reroll(paths, args.steps, args.threads, out, args.micro_batch, args.device,
                           args.seed, args.lr)
    accuracy = held_out_accuracy(paths, str(out / "final"), args.threads)
    print(json.dumps({**times, "accuracy": accuracy}))


def main() -> None:
    args = parse_args()
    if args.side:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    paths = prepare(work, args.threads, args.model, args.pairs, args.eval_pairs)
    (work / "paths.json").write_text(json.dumps(paths))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {"trl": [], "reroll": []}
    for i in range(args.rounds):
        for side in ("trl", "reroll"):
            done = subprocess.run(
                [sys.executable, __file__, "--side", side, "--work", str(work), "--out",
                 str(work / f"{side}-{i}"), "--steps", str(args.steps), "--threads",
                 str(args.threads), "--micro-batch", str(args.micro_batch),
                 "--device", args.device, "--seed", str(i), "--lr", str(args.lr)],
                env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{side} run failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[side].append(result)
            print(f"{side} round {i} (seed {i}): training {result['seconds']:.2f} s, end to end "
                  f"{result['end_to_end_seconds']:.2f} s, held-out accuracy "
                  f"{result['accuracy']:.3f}", flush=True)
    pairs = args.steps * BATCH_PAIRS

    def speed(side: str, key: str) -> float:
        return pairs / statistics.median(r[key] for r in results[side])

    accuracy = {s: statistics.mean(r["accuracy"] for r in results[s]) for s in results}
    print(json.dumps({
        "throughput_ratio": round(speed("reroll", "seconds") / speed("trl", "seconds"), 3),
        "end_to_end_ratio": round(speed("reroll", "end_to_end_seconds")
                                  / speed("trl", "end_to_end_seconds"), 3),
        "reroll_pairs_per_s": round(speed("reroll", "seconds"), 1),
        "trl_pairs_per_s": round(speed("trl", "seconds"), 1),
        "seconds": {s: [round(r["seconds"], 2) for r in results[s]] for s in results},
        "reroll_save_seconds": [round(r["save_seconds"], 2) for r in results["reroll"]],
        "end_to_end_seconds": {s: [round(r["end_to_end_seconds"], 2) for r in results[s]]
                               for s in results},
        "reroll_accuracy": round(accuracy["reroll"], 3),
        "trl_accuracy": round(accuracy["trl"], 3),
        "accuracy_per_seed": {s: [round(r["accuracy"], 3) for r in results[s]] for s in results},
        "steps": args.steps, "batch_pairs": BATCH_PAIRS, "reroll_micro_batch": args.micro_batch,
        "rounds": args.rounds, "threads": args.threads, "device": args.device,
        "model": args.model or "tiny (warm-started)", "pairs": args.pairs,
        "eval_pairs": args.eval_pairs, "lr": args.lr,
        "trl_version": importlib.metadata.version("trl")}))


if __name__ == "__main__":
    main()

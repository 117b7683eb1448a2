"""A step's batch on disk, exactly: `rollouts/step_N.batch.pt` holds every trajectory of the step
(token ids, the engine's behaviour logprobs, rewards, groups) so `reroll replay` can rebuild the
training batch bit for bit without sampling again.

Token ids are stored as int32 and logprobs as float32 tensors, the dtypes the batch is built from
(`collate` makes float32 logprobs), so nothing the loss sees is rounded by the round trip.

`write_rows` writes a step's samples as JSON lines (`rollouts/step_N.jsonl`) for `reroll view`.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.tracking.jsonsafe import dumps

FORMAT = 1
# Per-token lists, stored as tensors; every other Trajectory field is stored as it is.
TOKEN_FIELDS = {"prompt_ids": torch.int32, "response_ids": torch.int32,
                "behaviour_logprobs": torch.float32, "policy_mask": torch.int32,
                "turn_ids": torch.int32}


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / "rollouts" / f"step_{step}.batch.pt"


def save_batch(path: Path, step: int, trajectories: list[Trajectory]) -> None:
    rows = []
    for t in trajectories:
        row: dict[str, Any] = {}
        for f in fields(Trajectory):
            value = getattr(t, f.name)
            dtype = TOKEN_FIELDS.get(f.name)
            row[f.name] = torch.tensor(value, dtype=dtype) if dtype and value is not None else value
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, "step": step, "trajectories": rows}, tmp)
    tmp.replace(path)  # a run stopped mid-write never leaves a truncated batch behind


def load_batch(path: Path) -> list[Trajectory]:
    if not path.is_file():
        raise ConfigError(f"{path}: no recorded batch. Batches are stored every "
                          f"tracking.record_batch_every steps; pick a step that has one")
    try:
        data = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file, whatever torch says
        detail = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise ConfigError(f"{path}: not a readable recorded batch, truncated or corrupt "
                          f"({type(e).__name__}: {detail})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a recorded batch")
    if data.get("format") != FORMAT:
        raise ConfigError(f"{path}: batch format {data.get('format')!r}, this reroll reads {FORMAT}")
    known = {f.name for f in fields(Trajectory)}
    return [Trajectory(**{k: v.tolist() if k in TOKEN_FIELDS and isinstance(v, torch.Tensor) else v
                          for k, v in row.items() if k in known})
            for row in data["trajectories"]]


def write_rows(path: Path, rows: list[dict]) -> None:
    """JSON lines for `reroll view` (NaN/inf as null)."""
    path.parent.mkdir(exist_ok=True)
    with path.open("w") as f:
        f.writelines(dumps(row) + "\n" for row in rows)

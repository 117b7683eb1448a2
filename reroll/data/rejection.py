"""Rejection-sampling fine-tuning data: recorded episodes and samples -> SFT rows.

    reroll make-sft --from RUN_DIR_OR_FILE --min-reward R --out FILE

The input is a run directory (its `rollouts/step_N.jsonl`, written with `rollout.record`), a
`reroll eval` `.samples.jsonl` file, or one rollouts file. A row whose reward is at least R and
that finished cleanly (not cut at the length limit, no env failure, not aborted) becomes an SFT
row: an episode's `messages` (its tool calls, tool results and `tools` included; recorded by
the agent loop) up to its last assistant turn, or a single-turn sample's prompt and response.
Identical conversations are written once. `reroll sft` trains every assistant turn of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError

UNFINISHED = ("length", "env_error", "abort")


def sample_files(source: str | Path) -> list[Path]:
    """The jsonl files of a run directory's rollouts, or the one file given."""
    path = Path(source)
    if path.is_dir():
        files = sorted((path / "rollouts").glob("step_*.jsonl"),
                       key=lambda p: int(p.stem.removeprefix("step_") or 0))
        if not files:
            raise ConfigError(f"--from {path}: no rollouts/step_N.jsonl in this run directory "
                              f"(record them with rollout.record)")
        return files
    if not path.is_file():
        raise ConfigError(f"--from {path}: no such run directory or samples file")
    return [path]


def sft_row(sample: dict[str, Any]) -> dict[str, Any] | None:
    """The SFT row of one recorded sample, or None when it has no assistant turn."""
    messages = sample.get("messages")
    if messages:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                   default=None)
        if last is None:
            return None
        row = {"messages": messages[: last + 1]}
        return row | ({"tools": sample["tools"]} if sample.get("tools") else {})
    if not str(sample.get("response", "")).strip():
        return None
    return {"messages": [{"role": "user", "content": sample["prompt"]},
                         {"role": "assistant", "content": sample["response"]}]}


def rejection_rows(source: str | Path, min_reward: float) -> tuple[list[dict[str, Any]], int]:
    """(SFT rows of the samples whose reward is >= `min_reward`, samples read)."""
    rows, seen, total = [], set(), 0
    for path in sample_files(source):
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                reward = float(sample["reward"])
                if "messages" not in sample and "prompt" not in sample:
                    raise KeyError("messages or prompt")
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{lineno}: not a rollout or eval sample row "
                                  f"(needs reward and messages or prompt/response: {e})") from None
            total += 1
            if reward < min_reward or sample.get("finish_reason") in UNFINISHED:
                continue
            row = sft_row(sample)
            key = json.dumps(row, sort_keys=True)
            if row is not None and key not in seen:
                seen.add(key)
                rows.append(row | {"reward": reward})
    return rows, total

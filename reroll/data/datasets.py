"""Prompt datasets from .jsonl or .parquet files, with errors that name the file and row.

A row has `prompt` (a string) and usually `answer`, or `messages` (a chat list of
`{role, content}`, OpenAI-style: assistant messages may carry `tool_calls`, and `tool`
messages the results) instead of `prompt`. A message's content may be a list of parts with
images (`reroll.data.images`: `{"type": "image", "image": path}`, a relative path against the
file's folder; each image is opened at load). Other columns (`tools`: the tool schemas a
multi-turn SFT row renders) are kept as metadata.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from reroll.config.errors import ConfigError
from reroll.data.images import check_parts, content_text, image_parts


@dataclass
class PromptRow:
    messages: list[dict[str, str]]
    answer: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    """`file:line` (jsonl) or `file:row` (parquet), for error messages."""

    @property
    def prompt_text(self) -> str:
        return content_text(self.messages[-1]["content"])

    @property
    def has_images(self) -> bool:
        return bool(image_parts(self.messages))

    @property
    def tag(self) -> str | None:
        """The row's `tag` column as text (None without one): on-policy distillation routes the
        row's samples to a teacher by it."""
        value = self.metadata.get("tag")
        return None if value is None else str(value)


def _read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number, record), read one at a time: a caller checking each row as it comes
    names the file's first bad line, whether its JSON or its fields are what is wrong."""
    if path.suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or "
                          f".parquet)")
    try:
        yield from _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    except OSError as e:
        raise ConfigError(f"dataset {path}: cannot be read ({e.strerror or e})") from None


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                  f"at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            yield lineno, record


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, ValueError) as e:
        raise ConfigError(f"{path}: not a readable parquet file ({e})") from None
    return list(enumerate(table.to_pylist(), start=1))


def _parse_row(raw: Any, where: str, system_prompt: str | None, base: Path | None = None
               ) -> PromptRow:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a row must be an object, got {type(raw).__name__}")
    if "messages" in raw and raw["messages"] is not None:
        messages = raw["messages"]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(m.get("content"), (str, list)) or (m.get("content") is None
                                                              and m.get("tool_calls")))
            for m in messages)
        if not ok:
            raise ConfigError(f"{where}: `messages` must be a non-empty list of {{role, content}} "
                              f"(content a string or a list of text/image parts; an assistant "
                              f"message with `tool_calls` may have null content)")
        messages = [m if isinstance(m["content"], (str, list)) else {**m, "content": ""}
                    for m in messages]
        messages = check_parts(messages, base, where)
    elif isinstance(raw.get("prompt"), str) and raw["prompt"].strip():
        messages = [{"role": "user", "content": raw["prompt"]}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
    else:
        raise ConfigError(f"{where}: needs a non-empty string `prompt` or a `messages` list "
                          f"(found keys {sorted(raw)})")
    answer = raw.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = json.dumps(answer) if isinstance(answer, (list, dict)) else str(answer)
    metadata = {k: v for k, v in raw.items() if k not in ("prompt", "messages", "answer")}
    return PromptRow(messages=messages, answer=answer, metadata=metadata, source=where)


Row = TypeVar("Row")


def load_prompts(path: str | Path, system_prompt: str | None = None,
                 then: Callable[[PromptRow], Row] | None = None) -> list[Row]:
    """Read every row, in file order, each parsed and checked before the next is read, `then`
    too (a pipeline's own check and form of a row: a preference pair, a tokenised example):
    the first malformed line of the file raises a ConfigError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset {path} does not exist")
    finish = then or (lambda row: row)
    rows = [finish(_parse_row(raw, f"{path}:{n}", system_prompt, path.parent))
            for n, raw in _read_records(path)]
    if not rows:
        raise ConfigError(f"dataset {path} is empty")
    return rows


def parse_records(records: list[Any], name: str, system_prompt: str | None = None
                  ) -> list[PromptRow]:
    """Rows given in memory (`reroll.train(..., train_dataset=[...])`), checked as a file's
    rows are; an error names `name[i]` (0-based, as the user indexes the list)."""
    rows = [_parse_row(raw, f"{name}[{i}]", system_prompt) for i, raw in enumerate(records)]
    if not rows:
        raise ConfigError(f"{name} is empty")
    return rows


class PromptSampler:
    """Endless, reproducible stream of prompt batches: shuffled per epoch with `seed + epoch`.

    Its position (`state_dict`) is saved in checkpoints so a resumed run sees the same prompts.
    """

    def __init__(self, rows: list[PromptRow], seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[PromptRow]:
        batch = []
        while len(batch) < size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.rows[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)

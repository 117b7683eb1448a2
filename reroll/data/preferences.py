"""Preference pairs from .jsonl or .parquet files: `prompt` (or `messages`) + `chosen` +
`rejected`, checked row by row with errors naming the file and line; and a preference set built
from the arithmetic task (chosen: a right answer, rejected: a wrong one)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow, load_prompts
from reroll.data.tasks import arithmetic_rows


@dataclass
class PreferenceRow:
    prompt: PromptRow
    """The conversation before the answer (its `source` is `file:line`)."""
    chosen: str
    rejected: str


def _response(value: Any, key: str, where: str) -> str:
    """A response given as a string or as `[{"role": "assistant", "content": ...}]` (TRL's
    conversational format)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) \
            and value[0].get("role") == "assistant":
        value = value[0].get("content")
    if value is None:
        raise ConfigError(f"{where}: missing `{key}` (a preference row needs `prompt` or "
                          f"`messages`, `chosen` and `rejected`)")
    if not isinstance(value, str):
        raise ConfigError(f"{where}: `{key}` must be a string or a list holding one assistant "
                          f"message, got {type(value).__name__}")
    if not value.strip():
        raise ConfigError(f"{where}: `{key}` is empty")
    return value


def preference_row(row: PromptRow) -> PreferenceRow:
    """The pair of a dataset row; malformed pairs raise a ConfigError naming `row.source`."""
    if row.messages[-1]["role"] == "assistant":
        raise ConfigError(f"{row.source}: `messages` must end before the answer (the answers "
                          f"are `chosen` and `rejected`)")
    chosen = _response(row.metadata.get("chosen"), "chosen", row.source)
    rejected = _response(row.metadata.get("rejected"), "rejected", row.source)
    if chosen.strip() == rejected.strip():
        raise ConfigError(f"{row.source}: `chosen` and `rejected` are the same response")
    return PreferenceRow(row, chosen, rejected)


def load_preferences(path: str | Path, system_prompt: str | None = None) -> list[PreferenceRow]:
    """Every pair of the file; the first malformed row raises a ConfigError naming file and line."""
    return [preference_row(row) for row in load_prompts(path, system_prompt)]


def wrong_answers(answer: int, rng: random.Random, question: str) -> list[int]:
    """Plausible wrong answers: off by one to three, or a number copied from the question (the
    careless annotator's shortcut of `reroll.data.tasks`)."""
    copied = [int(w) for w in question.replace(".", " ").split() if w.isdigit()]
    options = [answer + d for d in (-3, -2, -1, 1, 2, 3) if answer + d >= 0] + copied
    return [x for x in options if x != answer] or [answer + 1]


def arithmetic_preference_rows(n: int, seed: int, levels: tuple[int, ...] = (1, 2, 3, 4)
                               ) -> list[dict]:
    """`n` rows `{prompt, chosen, rejected, answer}`: chosen is the worked solution, rejected the
    same working with a wrong final answer, or a wrong answer stated directly."""
    rng = random.Random(seed + 7)
    rows = []
    for row in arithmetic_rows(n, seed, levels):
        answer = int(row["answer"])
        wrong = rng.choice(wrong_answers(answer, rng, row["prompt"]))
        work = row["solution"].rsplit(" The answer is", 1)[0]
        rejected = (f"{work} The answer is \\boxed{{{wrong}}}." if rng.random() < 0.5
                    else f"The answer is \\boxed{{{wrong}}}.")
        rows.append({"prompt": row["prompt"], "chosen": row["solution"], "rejected": rejected,
                     "answer": row["answer"]})
    return rows


def write_arithmetic_preferences(out: str | Path, train_size: int = 2000, eval_size: int = 200,
                                 seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4)
                                 ) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl` preference sets; eval prompts never appear in train."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eval_rows = arithmetic_preference_rows(eval_size, seed + 1_000_003, levels)
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = [r for r in arithmetic_preference_rows(train_size * 4, seed, levels)
                  if r["prompt"] not in held_out][:train_size]
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def judge_prompt(question: str, first: str, second: str) -> str:
    """The Think-J question: which of two responses to `question` is correct, answered as a boxed
    letter so the math reward scores agreement with the known preference."""
    return (f"Question: {question}\n\nResponse A: {first}\n\nResponse B: {second}\n\n"
            f"Which response is correct? Answer with \\boxed{{A}} or \\boxed{{B}}.")


def judge_rows(pairs: list[dict], seed: int) -> list[dict]:
    """RLVR rows `{prompt, answer}` from preference rows `{prompt, chosen, rejected}`: the chosen
    response is shown as A or B at random (seeded, so a judge cannot learn the position), and the
    answer is the letter of the chosen one."""
    rng = random.Random(seed + 11)
    rows = []
    for pair in pairs:
        chosen_first = rng.random() < 0.5
        first, second = ((pair["chosen"], pair["rejected"]) if chosen_first
                         else (pair["rejected"], pair["chosen"]))
        rows.append({"prompt": judge_prompt(pair["prompt"], first, second),
                     "answer": "A" if chosen_first else "B"})
    return rows


def write_arithmetic_judge(out: str | Path, train_size: int = 2000, eval_size: int = 200,
                           seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4)
                           ) -> dict[str, Path]:
    """Write Think-J `train.jsonl` and `eval.jsonl` (the arithmetic preference splits turned into
    judge rows by `judge_rows`) for an RLVR run with `reward: {type: math}`."""
    paths = write_arithmetic_preferences(out, train_size, eval_size, seed, levels)
    for split, path in paths.items():
        pairs = [json.loads(line) for line in path.read_text().splitlines()]
        rows = judge_rows(pairs, seed + (1 if split == "eval" else 0))
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths

"""Preference pairs from .jsonl or .parquet files: `prompt` (or `messages`) + `chosen` +
`rejected`, checked row by row with errors naming the file and line; and a preference set built
from the arithmetic task (chosen: a right answer, rejected: a wrong one), or from a model's own
verified samples (`reroll eval`'s `.samples.jsonl`: chosen scored right, rejected wrong)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.data.datasets import PromptRow, load_prompts
from reroll.data.tasks import arithmetic_rows, write_splits


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


def load_preferences(path: str | Path, system_prompt: str | None = None,
                     then: Callable[[PreferenceRow], Any] | None = None) -> list:
    """Every pair of the file, each checked as it is read (`then`: the caller's form of a pair,
    e.g. tokenised): the first malformed line raises a ConfigError naming file and line."""
    finish = then or (lambda pair: pair)
    return load_prompts(path, system_prompt, lambda row: finish(preference_row(row)))


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
    eval_rows = arithmetic_preference_rows(eval_size, seed + 1_000_003, levels)
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = [r for r in arithmetic_preference_rows(train_size * 4, seed, levels)
                  if r["prompt"] not in held_out][:train_size]
    return write_splits(out, {"train": train_rows, "eval": eval_rows})


def judge_prompt(question: str, first: str, second: str) -> str:
    """The Think-J question: which of two responses to `question` is correct, answered as a boxed
    letter so the math reward scores agreement with the known preference."""
    return (f"Question: {question}\n\nResponse A: {first}\n\nResponse B: {second}\n\n"
            f"Which response is correct? Answer with \\boxed{{A}} or \\boxed{{B}}.")


def judge_rows(pairs: list[dict], seed: int) -> list[dict]:
    """RLVR rows `{prompt, answer, response, format_response}` from preference rows `{prompt,
    chosen, rejected}`: the chosen response is shown as A or B at random (seeded, so a judge
    cannot learn the position), the answer is the letter of the chosen one, `response` the right
    verdict in the reply format, and `format_response` a verdict in the same format whose letter
    is drawn at random, independent of the answer (the target of a warm-up that teaches the
    format and nothing of which response is right, so what a judge knows after it comes from
    RL)."""
    rng = random.Random(seed + 11)
    coin = random.Random(seed + 13)  # its own stream: the rows' order and answers stay as they were
    rows = []
    for pair in pairs:
        chosen_first = rng.random() < 0.5
        first, second = ((pair["chosen"], pair["rejected"]) if chosen_first
                         else (pair["rejected"], pair["chosen"]))
        letter = "A" if chosen_first else "B"
        guess = "A" if coin.random() < 0.5 else "B"
        rows.append({"prompt": judge_prompt(pair["prompt"], first, second), "answer": letter,
                     "response": f"The answer is \\boxed{{{letter}}}.",
                     "format_response": f"The answer is \\boxed{{{guess}}}."})
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


def sample_group(sample: dict) -> str:
    """The samples a pair is drawn from: the `n` samples of one eval row or one env seed
    (`reroll eval`'s `source` and `prompt_index`), else those of one prompt. (An environment's
    episodes may all begin with the same observation, guess-the-number's do; its seeds still
    differ.)"""
    if "prompt_index" in sample:
        return f"{sample.get('source', '')}#{sample['prompt_index']}"
    return str(sample["prompt"])


def sample_preference_pairs(samples: list[dict], threshold: float = 1.0, pairs_per_prompt: int = 2,
                            seed: int = 0) -> list[tuple[str, dict]]:
    """(group, preference row `{prompt, chosen, rejected}`) from a model's verified samples
    (rows of `reroll eval`'s `.samples.jsonl`: `prompt`, `response`, `reward`, `finish_reason`):
    per group of samples (`sample_group`: one prompt, or one env seed's episodes), up to
    `pairs_per_prompt` pairs of a distinct right response (reward >= `threshold`) and a distinct
    wrong one, drawn without replacement (seeded). Groups whose samples were all right or all
    wrong give none; responses cut at the length limit are left out (a pair's responses are
    trained closed with EOS). Pairs on the policy's own mistakes teach a reward model the errors
    the policy makes, not only the ones a generator thought of."""
    groups: dict[str, tuple[str, list[str], list[str]]] = {}
    for sample in samples:
        if sample.get("finish_reason") == "length" or not str(sample["response"]).strip():
            continue
        _, right, wrong = groups.setdefault(sample_group(sample), (sample["prompt"], [], []))
        bucket = right if float(sample["reward"]) >= threshold else wrong
        if sample["response"] not in bucket:
            bucket.append(sample["response"])
    rng = random.Random(seed + 13)
    pairs = []
    for group, (prompt, right, wrong) in groups.items():
        rng.shuffle(right)
        rng.shuffle(wrong)
        for chosen, rejected in list(zip(right, wrong, strict=False))[:pairs_per_prompt]:
            pairs.append((group, {"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    return pairs


def write_sample_preferences(samples_path: str | Path, out: str | Path, eval_size: int = 200,
                             threshold: float = 1.0, pairs_per_prompt: int = 2, seed: int = 0
                             ) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl` pairs from a `.samples.jsonl` file; whole groups
    (prompts, or env seeds; seeded) are held out until the eval split holds `eval_size`
    pairs."""
    samples = read_samples(samples_path)
    pairs = sample_preference_pairs(samples, threshold, pairs_per_prompt, seed)
    splits = split_by_prompt(pairs, lambda pair: pair[0], eval_size, seed)
    if not splits["train"] or (eval_size and not splits["eval"]):
        raise ConfigError(f"--preferences-from {samples_path}: {len(pairs)} pairs from "
                          f"{len(samples)} samples (a pair needs a prompt with a right and a "
                          f"wrong sample): too few for a train split and {eval_size} eval pairs; "
                          f"sample more (reroll eval --n 8 --temperature 1.0) or lower --eval-size")
    return write_splits(out, {name: [row for _, row in split] for name, split in splits.items()})


def read_samples(samples_path: str | Path) -> list[dict]:
    """The rows of a `reroll eval` `.samples.jsonl` file (each with prompt, response, reward); a
    broken row is a ConfigError naming the file and line."""
    samples_path = Path(samples_path)
    try:
        lines = samples_path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{samples_path}: cannot be read ({e.strerror or e})") from None
    samples = []
    for lineno, line in enumerate(lines, start=1):
        try:
            sample = json.loads(line)
            if not isinstance(sample, dict) or not {"prompt", "response", "reward"} <= set(sample):
                raise ValueError("needs prompt, response and reward")
        except ValueError as e:
            raise ConfigError(f"{samples_path}:{lineno}: not a sample row of `reroll eval` "
                              f"({e})") from None
        samples.append(sample)
    return samples


def split_by_prompt(rows: list, prompt_of: Callable[[Any], str], eval_size: int, seed: int
                    ) -> dict[str, list]:
    """{"train", "eval"} rows: whole prompts (`prompt_of(row)`, seeded order) go to the held-out
    split until it holds `eval_size` rows, so no held-out prompt appears in train."""
    prompts_of = [prompt_of(row) for row in rows]
    counts: dict[str, int] = {}
    for prompt in prompts_of:
        counts[prompt] = counts.get(prompt, 0) + 1
    prompts = sorted(counts)
    random.Random(seed).shuffle(prompts)
    held_out: set[str] = set()
    count = 0
    for prompt in prompts:
        if count >= eval_size:
            break
        held_out.add(prompt)
        count += counts[prompt]
    return {"train": [r for r, p in zip(rows, prompts_of, strict=True) if p not in held_out],
            "eval": [r for r, p in zip(rows, prompts_of, strict=True) if p in held_out]}


def judge_label_rows(samples: list[dict], template: str, threshold: float = 1.0,
                     seed: int = 0) -> list[dict]:
    """SFT rows that teach a judge the task (`reward: {type: judge}`): per distinct verified
    sample, `prompt` the judge prompt (`template` with the question, the reference answer and
    the response, as the judge reward fills it) and `response` "yes" when the verifier scored it
    right (reward >= `threshold`), else "no"; as many yes as no rows (seeded), so the judge
    cannot learn a prior. `question` keeps the task prompt (for held-out splits), `answer` the
    verdict too (`reroll eval --reward custom --reward-function
    reroll.rewards.judge:verdict_agreement` scores a judge's held-out agreement with it)."""
    seen, labelled = set(), {"yes": [], "no": []}
    for sample in samples:
        key = (sample["prompt"], sample["response"])
        if key in seen or sample.get("finish_reason") == "length":
            continue
        seen.add(key)
        verdict = "yes" if float(sample["reward"]) >= threshold else "no"
        labelled[verdict].append({
            "question": sample["prompt"], "response": verdict, "answer": verdict,
            "prompt": template.format(question=sample["prompt"], response=sample["response"],
                                      reference=sample.get("answer") or "")})
    rng = random.Random(seed + 17)
    size = min(len(labelled["yes"]), len(labelled["no"]))
    rows = rng.sample(labelled["yes"], size) + rng.sample(labelled["no"], size)
    rng.shuffle(rows)
    return rows


def write_judge_labels(samples_path: str | Path, out: str | Path, template: str,
                       eval_size: int = 200, threshold: float = 1.0, seed: int = 0
                       ) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl` judge SFT rows (`judge_label_rows`) from a
    `.samples.jsonl` file; held-out rows' questions never appear in train."""
    rows = judge_label_rows(read_samples(samples_path), template, threshold, seed)
    splits = split_by_prompt(rows, lambda row: row["question"], eval_size, seed)
    if not splits["train"]:
        raise ConfigError(f"--judge-labels-from {samples_path}: no right and wrong samples to "
                          f"label (a judge needs both); sample more (reroll eval --n 8 "
                          f"--temperature 1.0)")
    return write_splits(out, splits)

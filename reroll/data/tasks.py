"""Built-in verifiable tasks: generated prompt/answer datasets with train and eval splits.

`arithmetic`: word problems in four difficulty levels (1: add single digits, 2: subtract,
3: multiply, 4: two operations). Every row has a worked `solution` ending in `\\boxed{answer}`
and a `response`, the SFT target; RL only needs `prompt` and `answer`.

`direct_frac` and `direct_accuracy` make the SFT targets of mixed quality, as imitation data
often is: that share of responses states an answer without the working, and only
`direct_accuracy` of those answers is right (the others take a careless annotator's shortcut:
they copy the first number of the question).
A small model imitates both styles; RL with a verifiable reward has to discover that working it
out pays. The demo uses this to leave RL room to show what it does.

`code`: "Write a Python function `g(x)` that returns x times 4." rows whose `answer` is three
MBPP-style asserts (`{"asserts": ["assert g(2) == 8", ...]}`, the code reward runs them in the
sandbox) and whose `response` is a fenced one-line function. `sloppy_frac` of the demonstrations
for "minus" and "times" are a careless annotator's: they add whatever the word says.
"""

from __future__ import annotations

import json
import operator
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

NAMES = ["Sam", "Mia", "Leo", "Ava", "Max", "Zoe", "Ben", "Ivy", "Tom", "Eva", "Kai", "Lua"]
ITEMS = ["apples", "pens", "books", "coins", "stickers", "marbles", "shells", "cards", "cookies",
         "stamps", "beads", "rocks"]
INSTRUCTION = "Put the final answer in \\boxed{}."


def _level1(rng: random.Random, who: str, item: str) -> tuple[str, str, int]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    q = f"{who} has {a} {item}. {who} gets {b} more {item}. How many {item} does {who} have now?"
    return q, f"{a} + {b} = {a + b}.", a + b


def _level2(rng: random.Random, who: str, item: str) -> tuple[str, str, int]:
    a = rng.randint(10, 19)
    b = rng.randint(1, 9)
    q = f"{who} has {a} {item}. {who} gives away {b} {item}. How many {item} are left?"
    return q, f"{a} - {b} = {a - b}.", a - b


def _level3(rng: random.Random, who: str, item: str) -> tuple[str, str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    q = f"{who} has {a} bags with {b} {item} in each bag. How many {item} does {who} have?"
    return q, f"{a} * {b} = {a * b}.", a * b


def _level4(rng: random.Random, who: str, item: str) -> tuple[str, str, int]:
    a, b, c = rng.randint(5, 19), rng.randint(1, 9), rng.randint(1, 5)
    q = (f"{who} has {a} {item}, finds {b} more and then loses {c}. "
         f"How many {item} does {who} have?")
    return q, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}.", a + b - c


LEVELS = {1: _level1, 2: _level2, 3: _level3, 4: _level4}


def arithmetic_rows(n: int, seed: int, levels: tuple[int, ...] = (1, 2, 3, 4),
                    direct_frac: float = 0.0, direct_accuracy: float = 1.0) -> Iterator[dict]:
    """`n` rows `{prompt, answer, solution, response, level}`; levels are drawn uniformly."""
    rng = random.Random(seed)
    for _ in range(n):
        level = rng.choice(levels)
        question, work, answer = LEVELS[level](rng, rng.choice(NAMES), rng.choice(ITEMS))
        solution = f"{work} The answer is \\boxed{{{answer}}}."
        response = solution
        if rng.random() < direct_frac:
            # The shortcut of a careless annotator: copy the first number of the question.
            stated = answer if rng.random() < direct_accuracy else int(work.split(" ")[0])
            response = f"The answer is \\boxed{{{stated}}}."
        yield {
            "prompt": f"{question} {INSTRUCTION}",
            "answer": str(answer),
            "solution": solution,
            "response": response,
            "level": level,
        }


def write_arithmetic(out: str | Path, train_size: int = 4000, eval_size: int = 200,
                     seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4),
                     direct_frac: float = 0.0, direct_accuracy: float = 1.0) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl`; eval prompts never appear in train."""
    eval_rows = list(arithmetic_rows(eval_size, seed=seed + 1_000_003, levels=levels))
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = []
    for row in arithmetic_rows(train_size * 4, seed=seed, levels=levels, direct_frac=direct_frac,
                               direct_accuracy=direct_accuracy):
        if row["prompt"] not in held_out:
            train_rows.append(row)
        if len(train_rows) == train_size:
            break
    return write_splits(out, {"train": train_rows, "eval": eval_rows})


def write_splits(out: str | Path, splits: dict[str, Iterable[dict]], prefix: str = ""
                 ) -> dict[str, Path]:
    """Each split's rows as JSON lines in `out/<prefix><split>.jsonl` (the folder made, the
    splits written in order); returns split -> path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = out / f"{prefix}{split}.jsonl"
        with paths[split].open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths


CODE_NAMES = ["f", "g", "h", "calc", "step", "solve"]
CODE_OPS = {"plus": ("+", operator.add), "minus": ("-", operator.sub), "times": ("*", operator.mul)}
CODE_INPUTS = (2, 5, 11)


def code_rows(n: int, seed: int, sloppy_frac: float = 0.0,
              exclude: frozenset[str] = frozenset()) -> Iterator[dict]:
    """`n` rows `{prompt, answer, response}` of the `code` task (prompts in `exclude` skipped)."""
    rng = random.Random(seed)
    made = 0
    while made < n:
        name, word, k = rng.choice(CODE_NAMES), rng.choice(list(CODE_OPS)), rng.randint(1, 30)
        sloppy = rng.random() < sloppy_frac
        prompt = f"Write a Python function {name}(x) that returns x {word} {k}."
        if prompt in exclude:
            continue
        symbol, apply = CODE_OPS[word]
        op = "+" if sloppy else symbol
        asserts = [f"assert {name}({x}) == {apply(x, k)}" for x in CODE_INPUTS]
        made += 1
        yield {"prompt": prompt, "answer": json.dumps({"asserts": asserts}),
               "response": f"```python\ndef {name}(x):\n    return x {op} {k}\n```"}


def write_code(out: str | Path, train_size: int = 2000, eval_size: int = 64, seed: int = 0,
               sloppy_frac: float = 0.0) -> dict[str, Path]:
    """Write `code_train.jsonl` and `code_eval.jsonl` (distinct prompts, drawn with repeats
    from 540); the train rows' `response` has `sloppy_frac` sloppy demonstrations."""
    eval_rows, seen = [], set()
    for row in code_rows(10 * eval_size, seed=seed + 1_000_003):
        if row["prompt"] not in seen and len(eval_rows) < eval_size:
            seen.add(row["prompt"])
            eval_rows.append(row)
    train_rows = code_rows(train_size, seed, sloppy_frac, frozenset(seen))
    return write_splits(out, {"train": train_rows, "eval": eval_rows}, prefix="code_")


def tokenizer_corpus(seed: int = 0, n: int = 3000) -> Iterator[str]:
    """Text to train the tiny models' tokenizer on: task prompts and solutions, chat markup,
    and some general words so other prompts still tokenise sensibly."""
    for row in arithmetic_rows(n, seed=seed):
        yield f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n{row['solution']}"
    general = ("The quick brown fox jumps over the lazy dog. You are a helpful assistant. "
               "Think step by step, then answer. def solve(x): return x + 1 # python code\n"
               "Observation: the agent moves left, right, up or down. Reward: 1.0. Done.")
    for _ in range(50):
        yield general

"""Write the data of examples/multidomain/ that `reroll make-data` does not:

- the instruction-following domain (grpo.yaml, code.yaml): arithmetic word problems whose rows
  carry rule checks (`constraints`) instead of an answer: work the problem out in one sentence,
  then state the answer in a second one, in at most ten words;
- the code domain (code.yaml): "Write a Python function g(x) that returns x times 4." with three
  asserts run in the sandbox by the code reward (`reroll.data.tasks.code_rows`); 60% of the
  demonstrations for "minus" and "times" are a careless annotator's, who always adds;
- the SFT warm start of code.yaml: the arithmetic demonstrations (data/arithmetic/train.jsonl,
  written by `reroll make-data`) and the code ones together.

    python examples/multidomain/make_data.py        # -> data/multidomain/*.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from reroll.data.tasks import arithmetic_rows, write_code

CONSTRAINTS = [{"check": "sentence_count", "min": 2, "max": 2},
               {"check": "word_count", "max": 10},
               {"check": "include_keywords", "keywords": ["answer"]}]


def main(out: str = "data/multidomain", arithmetic: str = "data/arithmetic/train.jsonl") -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for split, size, seed in (("train", 2000, 11), ("eval", 64, 12)):
        with (folder / f"rules_{split}.jsonl").open("w") as f:
            for row in arithmetic_rows(size, seed=seed):
                f.write(json.dumps({"prompt": row["prompt"], "constraints": CONSTRAINTS}) + "\n")
    code = write_code(folder, train_size=2000, eval_size=64, seed=13, sloppy_frac=0.6)
    if not Path(arithmetic).is_file():
        sys.exit(f"{arithmetic} is missing: run `reroll make-data --out data/arithmetic` first")
    rows = [json.loads(line) for line in Path(arithmetic).open()]
    rows += [json.loads(line) for line in code["train"].open()]
    random.Random(14).shuffle(rows)
    with (folder / "sft.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["prompt"], "response": row["response"]}) + "\n")
    print(f"wrote {folder}/rules_{{train,eval}}.jsonl, code_{{train,eval}}.jsonl and sft.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])

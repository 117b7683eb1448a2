"""Write the instruction-following domain of examples/multidomain/grpo.yaml: arithmetic word
problems whose rows carry rule checks (`constraints`) instead of an answer: work the problem out
in one sentence, then state the answer in a second one, in at most ten words.

    python examples/multidomain/make_data.py        # -> data/multidomain/rules_{train,eval}.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from reroll.data.tasks import arithmetic_rows

CONSTRAINTS = [{"check": "sentence_count", "min": 2, "max": 2},
               {"check": "word_count", "max": 10},
               {"check": "include_keywords", "keywords": ["answer"]}]


def main(out: str = "data/multidomain") -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for split, size, seed in (("train", 2000, 11), ("eval", 64, 12)):
        with (folder / f"rules_{split}.jsonl").open("w") as f:
            for row in arithmetic_rows(size, seed=seed):
                f.write(json.dumps({"prompt": row["prompt"], "constraints": CONSTRAINTS}) + "\n")
    print(f"wrote {folder}/rules_train.jsonl and rules_eval.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])

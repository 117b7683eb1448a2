"""How much of a held-out score is format and how much is correctness.

    python examples/real/score.py runs/real-eval/base.samples.jsonl runs/real-eval/sft.samples.jsonl ...

For each `reroll eval` samples file: `reward` (the task's score: the last \\boxed{} answer is
right), `boxed` (a non-empty \\boxed{} answer is there at all: the format) and `last_number`
(the response's last number is the answer, whatever the format: correctness alone). A rise in
`reward` with `last_number` flat is format; a rise in `last_number` is the model getting better
at the task.
"""

import json
import re
import sys

BOXED = re.compile(r"\\boxed\{[^{}]+\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
    numbers = [NUMBER.findall(r["response"]) for r in rows]
    return {"file": path, "samples": len(rows),
            "reward": sum(r["reward"] for r in rows) / len(rows),
            "boxed": sum(bool(BOXED.search(r["response"])) for r in rows) / len(rows),
            "last_number": sum(bool(n) and n[-1] == str(r["answer"]) for r, n in
                               zip(rows, numbers, strict=True)) / len(rows)}


if __name__ == "__main__":
    results = [score(path) for path in sys.argv[1:]]
    print(f"{'samples file':60s} {'reward':>7s} {'boxed':>7s} {'last_number':>12s}")
    for r in results:
        print(f"{r['file']:60s} {r['reward']:7.3f} {r['boxed']:7.3f} {r['last_number']:12.3f}")
    print(json.dumps(results))

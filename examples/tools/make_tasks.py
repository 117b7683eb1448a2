"""Task rows for `make demo-tools`: `{"prompt", "answer", "seed"}`, the `calculator` env's
questions (`a * b + c` on operands of `--digits` digits), for the openai harness
(examples/tools/harness.py). Training rows come from env seeds `--seed`, `--seed`+1, ...;
held-out rows from seeds 10^9 up (as every agentic evaluation's), so they never overlap the
training rows nor the SFT episodes of `reroll make-episodes --env calculator` (seeds from 0).

    python examples/tools/make_tasks.py --out data/tools --train 512 --eval 64 --digits 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reroll.envs.calculator import CalculatorEnv

EVAL_SEED_BASE = 10**9


def rows(seeds: range, digits: int) -> list[dict]:
    env, out = CalculatorEnv(digits=digits), []
    for seed in seeds:
        prompt, _ = env.reset(seed)
        out.append({"prompt": prompt, "answer": env.answer, "seed": seed})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for tasks.jsonl and eval.jsonl")
    parser.add_argument("--train", type=int, default=512, help="training task rows")
    parser.add_argument("--eval", type=int, default=64, help="held-out task rows")
    parser.add_argument("--digits", type=int, default=4, help="digits of the operands")
    parser.add_argument("--seed", type=int, default=10_000, help="env seed of the first "
                        "training row (past the SFT episodes' seeds)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, seeds in (("tasks.jsonl", range(args.seed, args.seed + args.train)),
                        ("eval.jsonl", range(EVAL_SEED_BASE, EVAL_SEED_BASE + args.eval))):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows(seeds, args.digits)))
    print(f"wrote {args.train} training and {args.eval} held-out task rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

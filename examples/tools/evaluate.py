"""Held-out success of a model through the same path as a run's evaluation: an agentic config's
`agent` (the openai harness) on its `agent.eval_tasks`, through reroll's gateway, with the run's
eval sampling (greedy by default). `make demo-tools` measures the model before SFT with it; the
GRPO run itself reports the figures after SFT (before its first step) and after RL.

    python examples/tools/evaluate.py examples/tools/grpo.yaml model.path=models/smollm2 \
        --out runs/tools-eval/base.json

writes the figures to base.json and the episodes (prompt, segments, reward) to
base.samples.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from reroll.config.loading import load_config
from reroll.engines import build_engine
from reroll.engines.base import SamplingParams
from reroll.models.loading import load_tokenizer
from reroll.pipelines.agents import AgentTask
from reroll.pipelines.task import rollout_row


def evaluate(config_path: str, overrides: list[str]) -> tuple[dict, list[dict]]:
    """The held-out figures of the config's model, and the episodes as rollout rows."""
    config = load_config(config_path, overrides, expect="agentic")
    model = config.model.path
    tokenizer = load_tokenizer(model)
    task = AgentTask(config, tokenizer)
    engine = build_engine(config.rollout, model, pad_token_id=tokenizer.pad_token_id,
                          seed=config.seed)
    params = SamplingParams(config.rollout.max_new_tokens, config.eval.temperature,
                            stop_token_ids=(tokenizer.eos_token_id,))
    started = time.time()
    task.start(engine)
    try:
        metrics = task.evaluate(params)
    finally:
        task.close()
    episodes = [t for s in task.eval_sets for t in s.trajectories()]
    figures = {"model": model, "eval_tasks": config.agent.eval_tasks,
               "episodes": len(episodes), "wall_time_s": time.time() - started, **metrics}
    return figures, [rollout_row(t) for t in episodes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="an agentic config with `agent.eval_tasks`")
    parser.add_argument("overrides", nargs="*", help="key.path=value, as `reroll train` takes")
    parser.add_argument("--out", required=True, help="JSON file for the figures")
    args = parser.parse_args(argv)
    figures, samples = evaluate(args.config, args.overrides)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    # the episodes themselves, as `reroll eval` keeps them (rows `reroll view` shows)
    out.with_suffix(".samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    print(f"{figures['model']}: held-out success {figures['eval/success_rate']:.3f} "
          f"({figures['episodes']} episodes, {figures['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""docs/terminal-tasks.md's commands in order, as a user types them, with the training runs shrunk
(16 expert episodes, fewer SFT epochs, 1 GRPO step of small batches, 2 turns): the suite is written and checked, expert
episodes come from the tasks' solutions, SFT and GRPO train on them, and `reroll eval` scores the
run's checkpoint on the held-out tasks, every command in the sandbox, none an infrastructure
failure."""

from __future__ import annotations

import json

import pytest
from test_docs_commands import _project, _run_chain

pytestmark = pytest.mark.e2e

TERMINAL_CHAIN = [
    "reroll make-model --out models/tiny",
    "reroll make-terminal-tasks --out data/terminal --check",
    "reroll envs --describe terminal_tasks --kwargs '{\"tasks\": \"data/terminal\"}'",
    "reroll make-episodes --env terminal_tasks --kwargs '{\"tasks\": \"data/terminal\"}' "
    "--episodes 16 --out data/terminal/sft.jsonl",
    "reroll sft examples/agentic/terminal_tasks_sft.yaml epochs=0.5",
    "reroll train examples/agentic/terminal_tasks.yaml steps=1 rollout.prompts_per_step=4 "
    "rollout.group_size=2 env.max_turns=2 env.eval_episodes=2",
    "reroll eval --model runs/terminal-tasks/checkpoints/step_1 --env terminal_tasks "
    "--env-kwargs '{\"tasks\": \"data/terminal\"}' --episodes 3 --n 2 --max-turns 2 "
    "--out runs/eval/terminal.json",
]
"""The documented commands; the SFT, GRPO and eval ones shrunk (the documented ones are
allowlisted in tests/test_docs_commands.py with this file as the reason)."""


def test_the_terminal_tasks_doc_commands_work_in_order(tmp_path):
    cwd = _project(tmp_path)
    _run_chain(TERMINAL_CHAIN, cwd)
    rows = (cwd / "data/terminal/sft.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 16  # the solution, then `submit`
    summary = json.loads((cwd / "runs/terminal-tasks/summary.json").read_text())
    assert summary["steps"] == 1
    result = json.loads((cwd / "runs/eval/terminal.json").read_text())
    assert result["prompts"] == 3 and "pass@2" in result
    assert result["env/errors"] == 0  # the sandbox never failed an episode
    samples = [json.loads(line) for line in
               (cwd / "runs/eval/terminal.samples.jsonl").read_text().splitlines()]
    # evaluation seeds: they draw the held-out tasks
    assert len(samples) == 6 and all(s["reward_info"]["env_seed"] >= 10**6 for s in samples)

"""docs/agentic.md, "Write your own environment", run as a user would: the doc's `my_envs.py`
and `repeat_code.yaml` are written to a fresh folder and every command of the doc is run there
(the train run shortened to 2 steps); the outputs the doc shows must be what the commands print."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from reroll.cli import main

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "agentic.md"
SHOWN_PATH = "/home/me/project"
"""The folder the doc's outputs show; the test's folder stands in for it."""


def section() -> str:
    text = DOC.read_text()
    return text.split("## Write your own environment", 1)[1].split("\n## ", 1)[0]


def block_after(text: str, words: str, language: str = "") -> str:
    """The fenced block that follows the first mention of `words`."""
    mention = r"\s+".join(map(re.escape, words.split()))  # the doc may wrap it
    found = re.search(mention + r".*?```" + language + r"\n(.*?)```", text, re.S)
    assert found, f"docs/agentic.md: no ```{language} block after {words!r}"
    return found.group(1)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_docs_own_environment_describes_trains_evaluates_and_makes_episodes(
        tmp_path, monkeypatch, capsys):
    doc = section()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("COLUMNS", "100")  # the width the doc's tables were printed at
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)
    (tmp_path / "my_envs.py").write_text(block_after(doc, "Save it as `my_envs.py`", "python"))
    (tmp_path / "repeat_code.yaml").write_text(block_after(doc, "`repeat_code.yaml`", "yaml"))
    commands = [shlex.split(line) for line in
                block_after(doc, "Then, from the same folder", "bash").splitlines() if line]
    assert [c[:2] for c in commands] == [["reroll", "envs"], ["reroll", "make-model"],
                                         ["reroll", "train"], ["reroll", "eval"],
                                         ["reroll", "make-episodes"]]
    try:
        describe, make_model, train, evaluate, episodes = (c[1:] for c in commands)
        code, out, _ = run(describe, capsys)
        shown = block_after(doc, "and shows what it takes:").replace(SHOWN_PATH, str(tmp_path))
        assert code == 0 and [line.rstrip() for line in out.splitlines()] == \
            [line.rstrip() for line in shown.splitlines()]

        assert run(make_model, capsys)[0] == 0
        mistakes = block_after(doc, "and mistakes are named:").replace(SHOWN_PATH, str(tmp_path))
        for command, expected in zip(*[iter(mistakes.splitlines())] * 2, strict=True):
            code, _, err = run(shlex.split(command.removeprefix("$ "))[1:], capsys)
            assert code == 2 and " ".join(err.split()) == " ".join(expected.split())
        assert run(train + ["steps=2"], capsys)[0] == 0
        rows = [json.loads(line) for line in Path("runs/repeat-code/metrics.jsonl").open()]
        assert [r["step"] for r in rows] == [1, 2] and "eval/success_rate" in rows[-1]
        assert all(r["env/errors"] == 0 and r["env/turns_mean"] >= 1 for r in rows)
        episode = json.loads(Path("runs/repeat-code/rollouts/step_2.jsonl").open().readline())
        assert "Repeat this code: " in episode["prompt"]  # the user's env made the episodes

        evaluate[evaluate.index("runs/repeat-code/checkpoints/step_20")] = \
            "runs/repeat-code/checkpoints/step_2"
        code, out, _ = run(evaluate + ["--threads", "1"], capsys)
        results = json.loads(out.splitlines()[-1])
        assert code == 0 and results["prompts"] == 16 and results["env/errors"] == 0

        assert run(episodes, capsys)[0] == 0
        rows = [json.loads(line) for line in Path("data/repeat_code.jsonl").open()]
        assert len(rows) == 100  # the expert repeats the code at once: one turn per episode
        for row in rows:
            code_shown = row["messages"][0]["content"].removeprefix("Repeat this code: ")
            assert len(code_shown) == 2 and row["messages"][1]["content"] == code_shown

    finally:
        sys.modules.pop("my_envs", None)

"""docs/python-api.md, run as a user would: the doc's two set-up commands, then every ```python
block of the page, in order, as one script (`python script.py`) in a fresh folder holding the
repository's examples. The doc promises exactly this, so an example that drifts from the API fails
here. Runs are the doc's own (a few steps on the tiny model)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "python-api.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def setup_commands(text: str) -> list[list[str]]:
    """The bash block that says how to start: `reroll make-model ...`, `reroll make-data ...`."""
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "docs/python-api.md: no set-up block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_the_doc_has_examples_and_a_setup():
    text = DOC.read_text()
    assert len(python_blocks(text)) >= 6
    assert [c[:2] for c in setup_commands(text)] == [["reroll", "make-model"],
                                                    ["reroll", "make-data"]]


@pytest.mark.e2e
def test_every_example_of_the_python_api_doc_runs_in_order(tmp_path):
    text = DOC.read_text()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for command in setup_commands(text):
        subprocess.run([sys.executable, "-m", "reroll.cli", *command[1:]], cwd=tmp_path,
                       env=env, check=True, capture_output=True)
    script = "\n\n".join(python_blocks(text))
    (tmp_path / "script.py").write_text(script)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    out = done.stdout
    assert "grpo 4" in out and "invalid config" in out and "3 5" in out
    for run in ("api-first", "api-weights", "api-yaml", "api-datasets", "api-env", "api-sft",
                "api-resume"):
        assert (tmp_path / "runs" / run / "metrics.jsonl").is_file(), run

import re
from pathlib import Path

import pytest

from reroll.config.reference import render_markdown

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_every_config_key_is_documented():
    rows = [line for line in render_markdown().splitlines() if re.match(r"^\| `[\w.]+` \|", line)]
    assert len(rows) > 50
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert undocumented == []


def test_docs_config_md_is_up_to_date():
    # Regenerate with: .venv/bin/python -m reroll.config.reference > docs/config.md
    assert (ROOT / "docs" / "config.md").read_text() == render_markdown() + "\n"

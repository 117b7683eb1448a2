"""`reroll view` on a VLM run: each rollout's prompt images are in the report, embedded as small
PNGs beside the prompt's text, so the report stands alone."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from reroll.viewer import write_report

pytestmark = pytest.mark.unit


def test_the_report_holds_each_rollout_s_image(tmp_path):
    Image.new("RGB", (640, 320), (255, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/reward_mean": 0.5}\n')
    (tmp_path / "rollouts").mkdir()
    rows = [{"prompt": "<image>How many red squares?", "response": "2", "reward": 1.0,
             "images": [str(tmp_path / "red.png")]},
            {"prompt": "<image>How many?", "response": "1", "reward": 0.0,
             "images": [str(tmp_path / "moved.png")]}]
    (tmp_path / "rollouts" / "step_1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    run, path = write_report(tmp_path)
    html = path.read_text()
    uri = run.rollouts[1][0]["images"][0]
    assert uri.startswith("data:image/png;base64,") and uri in html
    thumb = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert thumb.size == (128, 64) and thumb.getpixel((5, 5)) == (255, 0, 0)  # aspect kept
    assert run.rollouts[1][1]["images"] == [None]  # a moved image: a warning, not a failure
    assert any("moved.png cannot be shown" in w for w in run.warnings)
    assert "imagesView" in html  # the table's detail view draws them

"""`reroll check-model DIR --diagnose`: the engine-vs-trainer table, swept over engine dtype,
batch size, padded or packed, and routing replay off or on for a mixture-of-experts model."""

from __future__ import annotations

import json

import pytest

from reroll.cli import main

pytestmark = pytest.mark.unit


def diagnosis(model: str, capsys) -> tuple[dict, str]:
    assert main(["check-model", model, "--diagnose"]) in (0, None)
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out.err


def test_a_moe_model_s_table_has_routing_replay_off_and_on(tiny_moe, capsys):
    """Replay on forces the engine's experts in the trainer's forward, so no token is routed
    apart, with a bf16 engine too (the mismatch real deployments have)."""
    result, _ = diagnosis(tiny_moe, capsys)
    rows = result["diagnosis"]
    assert result["routing_replay"] == "swept"
    for dtype in ("float32", "bfloat16"):
        for batch in (1, 4):
            here = {(r["layout"], r["routing_replay"]): r for r in rows
                    if r["engine_dtype"] == dtype and r["batch_size"] == batch}
            assert {("padded", "off"), ("padded", "on")} <= set(here), here.keys()
            assert all(0 <= r["routing_mismatch"] <= 1 for r in here.values())
            assert here["padded", "on"]["routing_mismatch"] == 0


def test_a_dense_model_s_table_says_routing_replay_is_skipped(tiny_model, capsys):
    result, err = diagnosis(tiny_model, capsys)
    assert result["routing_replay"] == "skipped: dense model: no experts to route"
    assert "routing replay on/off: skipped (dense model: no experts to route)" in err
    rows = result["diagnosis"]
    assert len(rows) == 2 * 2 * len({r["layout"] for r in rows})  # dtype x batch x layout
    assert all(r["routing_replay"] == "n/a" and r["routing_mismatch"] is None for r in rows)

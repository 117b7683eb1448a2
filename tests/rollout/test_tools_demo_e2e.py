"""`make demo-tools`' path on the tiny model: the same commands and configs as the demo
(examples/tools/), shrunk by overrides. Task rows and scripted calculator episodes, held-out
success through the gateway before SFT, a short SFT on the episodes, GRPO through the gateway
driven by the unmodified `openai` SDK harness (examples/tools/harness.py), then the demo's
figures. The tiny model learns nothing in two steps (it never calls the tool, so every reward
is 0); this checks that the pipeline runs end to end on the harness's calls, token for token,
and that every figure is written."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from reroll.cli import main

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_demo_path_trains_through_the_gateway(tiny_model, tmp_path, monkeypatch):
    # a project folder as the demo's (the repository root): examples/ importable from it
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # demo_tools_figures imports demo_figures
    started = time.time()
    assert _script(REPO / "examples/tools/make_tasks.py").main(
        ["--out", "data/tools", "--train", "4", "--eval", "2", "--digits", "4"]) == 0
    assert main(["make-episodes", "--env", "calculator",
                 "--kwargs", '{"digits": 4, "careless": 0.5}', "--episodes", "4", "--out", "data/tools/sft.jsonl"]) == 0
    grpo = str(REPO / "examples/tools/grpo.yaml")
    shrunk = ["rollout.max_new_tokens=24", "agent.max_context_tokens=null"]
    assert _script(REPO / "examples/tools/evaluate.py").main(
        [grpo, f"model.path={tiny_model}", *shrunk, "--out", "runs/tools-eval/base.json"]) == 0
    assert main(["sft", str(REPO / "examples/tools/sft.yaml"), f"model.path={tiny_model}",
                 "data.max_tokens=1024", "batch_size=4", "train.micro_batch_size=4",
                 "tracking.progress=false"]) == 0
    assert main(["train", grpo, "steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "train.micro_batch_size=4",
                 *shrunk, "tracking.progress=false"]) == 0

    rows = [json.loads(line) for line in Path("runs/tools-grpo/metrics.jsonl").read_text()
            .splitlines()]
    trained = [r for r in rows if "gateway/episodes" in r]
    assert len(trained) == 2 and all(r["gateway/episodes"] == 4 for r in trained)
    # the steps trained on the harness's calls, token for token, and no harness failed
    assert all(r["rollout/tokens"] > 0 and r["train/response_len_mean"] > 0 for r in trained)
    assert all(r["gateway/faithful_fraction"] == 1.0 for r in trained)
    assert all(r["gateway/crashed"] == r["gateway/timeout"] == 0 for r in trained)

    figures_tool = _script(REPO / "tools/demo_tools_figures.py")
    assert figures_tool.main(["--started", str(started)]) == 0
    figures = json.loads(Path("runs/demo-tools-figures.json").read_text())
    assert figures["sft_steps"] >= 1 and figures["grpo_steps"] == 2
    assert figures["eval_episodes"] == 2
    assert len(Path("runs/tools-eval/base.samples.jsonl").read_text().splitlines()) == 2
    for key in ("success_before_sft", "success_after_sft", "success_after_rl"):
        assert 0.0 <= figures[key] <= 1.0, figures

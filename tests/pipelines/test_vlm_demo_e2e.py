"""`make demo-vlm`'s path, shrunk: SFT on the counting task's image rows, then GRPO from the SFT
model with the demo's own configs (examples/vlm/), and the blank-image ablation's data. The full
demo's figures are in docs/vlm.md."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from scripts import load_script

from reroll.cli import main
from reroll.data.images import write_count_task

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
QUIET = ["tracking.progress=false", "train.num_threads=1"]
SHRINK = {"sft": ["steps=2", "batch_size=4", "train.micro_batch_size=4"],
          "train": ["steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                    "train.micro_batch_size=8"]}
BLANK = ["data.train=data/red-squares-blank/train.jsonl",
         "data.eval=data/red-squares-blank/eval.jsonl"]
DEMO = [  # the Makefile's `demo-vlm` recipe, in order
    ["sft", "examples/vlm/sft.yaml"],
    ["train", "examples/vlm/grpo.yaml"],
    ["sft", "examples/vlm/sft.yaml", "name=vlm-blank-sft", *BLANK],
    ["train", "examples/vlm/grpo.yaml", "name=vlm-blank-grpo",
     "model.path=runs/vlm-blank-sft/final", *BLANK],
]


def test_the_vlm_demo_s_commands_run_in_order_with_the_images_in_the_sft_loss(
        tiny_vlm, tmp_path, monkeypatch):
    """`make demo-vlm` shrunk: its model and data made alike, its four runs with fewer steps,
    then its figures; the first SFT step's loss differs with blank images (the pixels reach
    SFT's loss) and the GRPO runs start from the SFT models (their processors kept)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # demo_vlm_figures imports demo_figures
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the demo's reward imports from here
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-vlm").symlink_to(tiny_vlm)
    write_count_task("data/red-squares", train_size=8, eval_size=4, seed=0)
    write_count_task("data/red-squares-blank", train_size=8, eval_size=4, seed=0, blank=True)
    started = time.time()
    for command, *args in DEMO:
        assert main([command, *args, *SHRINK[command], *QUIET]) == 0, args

    def first_loss(run: str) -> float:
        return json.loads(Path(f"runs/{run}/metrics.jsonl").read_text().splitlines()[0])["sft/nll"]

    # The same weights, rows and order: the first step's loss differs by the pixels alone.
    assert first_loss("vlm-sft") != pytest.approx(first_loss("vlm-blank-sft"), abs=1e-6)
    assert Path("runs/vlm-sft/final/processor_config.json").is_file()
    samples = [json.loads(line) for line in
               Path("runs/vlm-grpo/rollouts/eval_step_2.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["images"] for s in samples)

    figures_tool = load_script("tools/demo_vlm_figures.py")
    assert figures_tool.main(["--started", str(started)]) == 0
    figures = json.loads(Path("runs/demo-vlm-figures.json").read_text())
    assert figures["sft_steps"] == figures["grpo_steps"] == 2
    for key in ("reward_after_sft", "reward_after_rl", "blank_after_sft", "blank_after_rl"):
        assert 0.0 <= figures[key] <= 1.0, figures


def missing_image(task: Path) -> None:
    (task / "images" / "train_1.png").unlink()


def second_row_ends_with(*messages: dict):
    def damage(task: Path) -> None:
        rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
        rows[1]["messages"] += messages
        (task / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return damage


multi_turn = second_row_ends_with({"role": "assistant", "content": "3"},
                                  {"role": "user", "content": "Sure?"},
                                  {"role": "assistant", "content": "Yes."})
parts_answer = second_row_ends_with({"role": "assistant",
                                     "content": [{"type": "text", "text": "3"}]})


@pytest.mark.parametrize("damage, more, said", [
    (missing_image, [], "train.jsonl:2: image .*train_1.png does not exist"),
    (multi_turn, ["data.train_turns=all"],  # `auto` trains the last turn alone, as for text
     "train.jsonl:2: a multi-turn row with images is not trained yet"),
    (parts_answer, [], "train.jsonl:2: the last assistant message's content .* must be a string")])
def test_sft_refuses_bad_image_rows_by_file_and_line(tiny_vlm, tmp_path, capsys, damage, more,
                                                     said):
    """Before the model loads, with exit 2 and no traceback."""
    task = tmp_path / "task"
    write_count_task(task, train_size=3, eval_size=1, seed=0)
    damage(task)
    assert main(["sft", str(REPO / "examples/vlm/sft.yaml"), f"model.path={tiny_vlm}",
                 f"output_dir={tmp_path / 'run'}", f"data.train={task}/train.jsonl",
                 "data.eval=null", "steps=1", *QUIET, *more]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and "Traceback" not in err

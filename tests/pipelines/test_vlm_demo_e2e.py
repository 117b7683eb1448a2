"""`make demo-vlm`'s path, shrunk: SFT on the counting task's image rows, then GRPO from the SFT
model with the demo's own configs (examples/vlm/), and the blank-image ablation's data. The full
demo's figures are in docs/vlm.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.data.images import write_count_task

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
QUIET = ["tracking.progress=false", "train.num_threads=1"]


def sft(task: Path, out: Path, model: str, *more: str) -> list[dict]:
    """`reroll sft examples/vlm/sft.yaml` on `task`, 2 steps; its metrics rows."""
    assert main(["sft", "examples/vlm/sft.yaml", f"model.path={model}", f"output_dir={out}",
                 f"data.train={task}/train.jsonl", f"data.eval={task}/eval.jsonl", "steps=2",
                 "batch_size=4", "train.micro_batch_size=4", *QUIET, *more]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_vlm_demo_s_sft_then_grpo_runs_with_the_images_in_the_sft_loss(
        tiny_vlm, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the demo's reward, examples.vlm.reward, imports from the root
    task, blank = tmp_path / "task", tmp_path / "blank"
    write_count_task(task, train_size=8, eval_size=4, seed=0)
    write_count_task(blank, train_size=8, eval_size=4, seed=0, blank=True)
    assert (blank / "train.jsonl").read_text() == (task / "train.jsonl").read_text()

    seen = sft(task, tmp_path / "sft", tiny_vlm)
    unseen = sft(blank, tmp_path / "sft-blank", tiny_vlm)
    # The same weights, rows and order: the first step's loss differs by the pixels alone.
    assert seen[0]["sft/nll"] != pytest.approx(unseen[0]["sft/nll"], abs=1e-6)
    final = tmp_path / "sft" / "final"
    assert (final / "processor_config.json").is_file()  # an RL run starts from it

    assert main(["train", "examples/vlm/grpo.yaml", f"model.path={final}",
                 f"output_dir={tmp_path / 'grpo'}", f"data.train={task}/train.jsonl",
                 f"data.eval={task}/eval.jsonl", "steps=2", "rollout.prompts_per_step=2",
                 "rollout.group_size=4", "train.micro_batch_size=8", *QUIET]) == 0
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert summary["steps"] == 2
    assert 0 <= summary["eval_reward_start"] <= 1 and 0 <= summary["eval_reward_end"] <= 1
    samples = [json.loads(line) for line in
               (tmp_path / "grpo" / "rollouts" / "eval_step_2.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["images"] for s in samples)


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

"""RLVR on a trained reward model raises the task reward the true verifier measures, and more
than the same run on an untrained reward model: the recipe of docs/preferences.md ("RLVR on a
reward model, measured by the verifier"), run with the CLI as a user runs it.

The demo's warm start (1,000 SFT steps on demonstrations of mixed quality), its samples on 1,000
training prompts verified by math-verify and paired (a right one chosen, a wrong one rejected),
a reward model trained on those pairs, then 10 GRPO steps on the reward model's score with
held-out evaluation by the verifier (`eval.reward: {type: math}`). The control is the same
reward model before training (the SFT'd backbone, its scalar head as initialised): a random head
also favours some answers, so beating the start alone would not show what the training adds.
About 6 minutes on 2 cores, most of it the SFT."""

import json
from pathlib import Path

import pytest

from reroll.cli import main

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fresh_run_in(out: Path) -> list[str]:
    """Overrides: the run directory `out`, written anew, without a progress bar."""
    return [f"output_dir={out}", "overwrite=true", "tracking.progress=false"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def grpo_on(tmp_path: Path, sft: Path, data: Path, reward_model: Path, name: str
            ) -> tuple[float, float]:
    """Held-out verifier reward (before step 1, after step 10) of GRPO on `reward_model`'s
    score."""
    assert main(["train", str(EXAMPLES / "preferences/rm_rl.yaml"), f"model.path={sft}",
                 f"reward.path={reward_model}", f"data.train={data / 'train.jsonl'}",
                 f"data.eval={data / 'eval.jsonl'}", "steps=10",
                 *fresh_run_in(tmp_path / name)]) == 0
    run = summary(tmp_path / name)
    return run["eval_reward_start"], run["eval_reward_end"]


# pytest-timeout is a hang guard (600 s in pyproject); this test does minutes of real
# training (~500 s on a quiet 2-core machine), so its guard is wider: on a loaded machine
# it ran past 600 s while still making progress.
@pytest.mark.timeout(1800)
def test_grpo_on_a_trained_reward_model_raises_the_verified_reward(tmp_path, tiny_model):
    data, sft = tmp_path / "data", tmp_path / "sft"
    assert main(["make-data", "--out", str(data), "--direct-frac", "0.6",
                 "--direct-accuracy", "0.25"]) == 0
    assert main(["sft", str(EXAMPLES / "arithmetic/sft.yaml"), f"model.path={tiny_model}",
                 f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'eval.jsonl'}",
                 *fresh_run_in(sft)]) == 0
    samples = tmp_path / "eval" / "sft-train.json"
    assert main(["eval", "--model", str(sft / "final"), "--task", str(data / "train.jsonl"),
                 "--max-prompts", "1000", "--n", "8", "--temperature", "1.0",
                 "--out", str(samples)]) == 0
    pairs = tmp_path / "pairs"
    assert main(["make-data", "--preferences-from",
                 str(samples.with_name("sft-train.samples.jsonl")), "--out", str(pairs)]) == 0

    rm_config = [str(EXAMPLES / "preferences/rm_samples.yaml"), f"model.path={sft / 'final'}",
                 f"data.train={pairs / 'train.jsonl'}", f"data.eval={pairs / 'eval.jsonl'}"]
    assert main(["rm", *rm_config, *fresh_run_in(tmp_path / "rm")]) == 0
    # the control: one step at a learning rate that changes nothing, so the head stays as drawn
    assert main(["rm", *rm_config, "steps=1", "optimizer.lr=1e-12",
                 *fresh_run_in(tmp_path / "rm-untrained")]) == 0
    rm = summary(tmp_path / "rm")
    assert rm["eval_accuracy_end"] >= rm["eval_accuracy_start"] + 0.05

    trained = grpo_on(tmp_path, sft / "final", data, tmp_path / "rm" / "final", "grpo")
    untrained = grpo_on(tmp_path, sft / "final", data, tmp_path / "rm-untrained" / "final",
                        "grpo-untrained")
    # measured: start 0.035; 0.52 on the trained reward model, 0.19 on the untrained one
    assert trained[0] == untrained[0] <= 0.15
    assert trained[1] >= 0.35
    assert trained[1] >= untrained[1] + 0.15

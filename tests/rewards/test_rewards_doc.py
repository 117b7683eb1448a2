"""docs/rewards.md's custom-reward example runs as written: its dataset, reward module and
config train a step, and the recorded rewards follow the documented contract (extra columns in
`metadata`, `RewardResult.info` stored as `reward_info`)."""

import json
import re
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.rewards import RewardSample, build_runner

pytestmark = pytest.mark.e2e
DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The page's three files, where it says they are, in a fresh working directory."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keywords.jsonl").write_text(blocks("jsonl")[0])
    (tmp_path / "my_reward.py").write_text(blocks("python")[0])
    (tmp_path / "keyword.yaml").write_text(blocks("yaml")[-1])  # the whole config
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_documented_function_scores_by_the_contract(example):
    import asyncio

    from reroll.config import load_config

    config = load_config("keyword.yaml")
    runner = build_runner(config.reward)
    try:
        sample = RewardSample(prompt="Name a colour of the sky.", response="It is Blue.",
                              answer="blue", finish_reason="length", metadata={"keyword": "blue"})
        result = asyncio.run(runner.reward(sample))
    finally:
        runner.close()
    assert result.score == 0.5
    assert result.info == {"keyword": "blue", "found": True, "cut_off": True}


def test_the_documented_example_trains(example, tiny_model, capsys):
    assert main(["train", "keyword.yaml", f"model.path={tiny_model}", "steps=1",
                 "tracking.tensorboard=false", "tracking.progress=false"]) == 0
    rows = [json.loads(line) for line in
            (example / "runs" / "keyword-grpo" / "rollouts" / "step_1.jsonl").open()]
    assert rows and all(row["reward_info"]["keyword"] in ("blue", "green") for row in rows)
    for row in rows:
        info = row["reward_info"]
        assert row["reward"] == float(info["found"]) - 0.5 * info["cut_off"]
        assert info["cut_off"] == (row["finish_reason"] == "length")

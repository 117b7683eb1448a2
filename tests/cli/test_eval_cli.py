"""`reroll eval`: pass@k estimates checked by hand, and the command on the tiny model."""

import json
import math
import sys
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.evaluation import pass_at_k, summarize

PIPELINE_TESTS = Path(__file__).parent.parent / "pipelines"  # parity_reward.py lives there


@pytest.mark.unit
def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert math.isclose(pass_at_k(4, 1, 2), 1 - 3 / 6)  # C(3,2)/C(4,2) pairs miss the right one
    assert pass_at_k(4, 2, 3) == 1.0  # any 3 of 4 include one of 2 right samples
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@pytest.mark.unit
def test_summarize_averages_over_prompts():
    scores = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]]
    out = summarize(scores, [1, 2, 4], threshold=1.0)
    assert math.isclose(out["pass@1"], (0.25 + 0 + 0.5) / 3)
    assert math.isclose(out["pass@2"], (0.5 + 0 + (1 - 1 / 6)) / 3)
    assert math.isclose(out["pass@4"], 2 / 3)
    assert math.isclose(out["mean@4"], 3.5 / 12)


@pytest.mark.e2e
def test_eval_command_on_the_tiny_model(tmp_path, tiny_model, arithmetic, capsys):
    out = tmp_path / "res.json"
    sys.path.insert(0, str(PIPELINE_TESTS))
    try:
        code = main(["eval", "--model", tiny_model, "--task", arithmetic["eval"], "--n", "4",
                     "--k", "2", "--max-prompts", "6", "--max-new-tokens", "12",
                     "--reward", "custom", "--reward-function", "parity_reward:odd_length",
                     "--out", str(out)])
    finally:
        sys.path.remove(str(PIPELINE_TESTS))
    assert code == 0
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "mean@4" in printed
    results = json.loads(out.read_text())
    assert results["prompts"] == 6 and results["n"] == 4 and results["temperature"] == 1.0
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").open()]
    assert len(samples) == 24
    by_prompt = [[s["reward"] for s in samples if s["prompt_index"] == i] for i in range(6)]
    expected = summarize(by_prompt, [1, 2, 4], threshold=1.0)
    for key in ("pass@1", "pass@2", "pass@4", "mean@4"):
        assert math.isclose(results[key], expected[key]), key
    assert 0 < results["pass@1"] < 1 and results["pass@1"] <= results["pass@2"] <= results["pass@4"]
    assert json.loads(printed.strip().splitlines()[-1])["out"] == str(out)


@pytest.mark.e2e
def test_eval_builtin_task_greedy(tmp_path, tiny_model, capsys):
    out = tmp_path / "res.json"
    assert main(["eval", "--model", tiny_model, "--task", "arithmetic", "--max-prompts", "4",
                 "--max-new-tokens", "8", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["temperature"] == 0.0 and results["prompts"] == 4
    assert set(results) >= {"pass@1", "mean@1", "truncated_frac", "tokens_per_s"}


@pytest.mark.unit
@pytest.mark.parametrize("flags, named", [
    (["--task", "nope.jsonl"], "--task nope.jsonl"),
    (["--task", "arithmetic", "--n", "2", "--k", "3"], "--k 3"),
    (["--task", "arithmetic", "--k", "two"], "--k"),
    (["--env", "guess-number"], "unknown environment 'guess-number'"),
    (["--env", "guess_number", "--env-kwargs", "[1]"], "--env-kwargs"),
])
def test_eval_bad_flags_exit_2(tiny_model, capsys, flags, named):
    assert main(["eval", "--model", tiny_model, *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.unit
def test_eval_checks_the_prompts_as_training_does(tmp_path, tiny_model, capsys):
    """The prompts are sampled by the training task (`PromptTask`), so training's start-up
    checks hold: a math-scored row without an answer is refused, naming its file and line, not
    scored 0 as a wrong response."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?"}\n')
    out = tmp_path / "r.json"
    assert main(["eval", "--model", tiny_model, "--task", str(rows), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--task {rows}: reward.type=math needs an `answer`" in err and f"{rows}:2" in err
    assert not out.exists()


@pytest.mark.unit
def test_eval_unknown_engine_exits_2(tiny_model, capsys):
    assert main(["eval", "--model", tiny_model, "--task", "arithmetic", "--engine", "nope"]) == 2
    assert "--engine nope" in capsys.readouterr().err


@pytest.mark.e2e
def test_eval_over_an_environment_suite(tmp_path, tiny_model, capsys):
    out = tmp_path / "env.json"
    assert main(["eval", "--model", tiny_model, "--env", "guess_number,countdown", "--episodes",
                 "3", "--n", "2", "--max-turns", "2", "--max-new-tokens", "8",
                 "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["envs"]) == {"guess_number", "countdown"}
    assert results["prompts"] == 6 and results["temperature"] == 1.0
    for part in results["envs"].values():
        assert part["prompts"] == 3 and {"pass@1", "pass@2", "mean@2"} <= set(part)
    assert math.isclose(results["pass@1"], (results["envs"]["guess_number"]["pass@1"]
                                            + results["envs"]["countdown"]["pass@1"]) / 2)
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").open()]
    assert len(samples) == 12 and {s["source"] for s in samples} == {"guess_number", "countdown"}


@pytest.mark.unit
def test_help_lists_eval_and_replay():
    from reroll.cli import build_parser

    text = build_parser().format_help()
    assert "eval" in text and "replay" in text


@pytest.mark.vllm
def test_eval_on_vllm_closes_its_engine(tmp_path, tiny_model, arithmetic):
    """The engine is closed before the interpreter exits: vLLM's engine core used to die first and
    its client printed EngineDeadError after the results."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "eval", "--model", tiny_model, "--task",
         arithmetic["eval"], "--engine", "vllm", "--max-prompts", "8", "--max-new-tokens", "16",
         "--threads", "1", "--out", str(tmp_path / "eval.json")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "EngineDeadError" not in result.stderr and "Traceback" not in result.stderr
    assert json.loads((tmp_path / "eval.json").read_text())["prompts"] == 8


@pytest.mark.unit
def test_eval_threads_must_be_positive(tiny_model, capsys):
    assert main(["eval", "--model", tiny_model, "--task", "arithmetic", "--threads", "0"]) == 2
    assert "--threads 0" in capsys.readouterr().err

"""Reading a run directory: what the report is built from, and the errors for bad input."""

from __future__ import annotations

import json

import pytest

from reroll.config.errors import ConfigError
from reroll.viewer.charts import plan_charts
from reroll.viewer.report import payload
from reroll.viewer.rundata import load_run
from reroll.viewer.summary import headline

pytestmark = pytest.mark.unit


def test_metrics_are_read_per_step_with_non_finite_values_listed(run_dir, spec):
    run = load_run(run_dir)
    assert [row["step"] for row in run.metrics] == list(range(1, spec["steps"] + 1))
    bad = spec["non_finite_step"]
    assert run.metrics[bad - 1]["train/grad_norm"] is None
    assert run.non_finite == {"train/grad_norm": [bad], "actor/entropy": [bad]}
    assert all(step != bad for step, _ in run.series("train/grad_norm"))
    assert [s for s, _ in run.series("eval/reward_mean")] == list(
        range(spec["eval_every"], spec["steps"] + 1, spec["eval_every"]))
    assert run.pipeline == "rlvr" and run.name == "synthetic-run"
    assert run.warnings == []


def test_rows_sharing_a_step_are_merged_and_sorted(tmp_path):
    """An SFT run logs its final eval/nll on a line of its own with the last step."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "sft/nll": 1.5}\n{"step": 1, "sft/nll": 2.0}\n\n{"step": 2, "eval/nll": 1.4}\n')
    run = load_run(tmp_path)
    assert run.metrics == [{"step": 1, "sft/nll": 2.0}, {"step": 2, "sft/nll": 1.5, "eval/nll": 1.4}]
    assert run.pipeline == "sft"  # guessed from the metrics: there is no config.yaml
    assert any("config.yaml is missing" in w for w in run.warnings)
    assert any("summary.json is missing" in w for w in run.warnings)


def test_rollouts_are_ordered_by_step_number_and_normalised(run_dir, spec):
    (run_dir / "rollouts" / "notes.txt").write_text("not a rollout file")
    run = load_run(run_dir)
    assert list(run.rollouts) == list(spec["rollout_steps"])  # step_10 after step_2
    assert all(len(rows) == spec["rows_per_step"] for rows in run.rollouts.values())
    agentic = run.rollouts[20][0]
    assert [t["role"] for t in agentic["turns"]] == ["policy", "env", "policy", "env"]
    assert "turns" not in run.rollouts[20][1]
    first = run.rollouts[2][0]
    assert first["reward"] == 0.0 and first["finish_reason"] == "length" and first["group_id"] == 0
    assert first["reward_info"] == {"correct": 0.0, "reason": "wrong"}


def test_bad_rollout_lines_are_skipped_with_a_note_and_long_steps_are_capped(run_dir):
    path = run_dir / "rollouts" / "step_2.jsonl"
    rows = path.read_text().splitlines()
    odd = {"prompt": None, "response": {"structured": True}, "reward": "nan",
           "reward_info": {"score": float("inf")}, "tool_calls": 3}
    path.write_text("\n".join(rows + ["{broken", "[1, 2]", json.dumps(odd)]) + "\n")
    run = load_run(run_dir, max_rollouts_per_step=9)
    assert len(run.rollouts[2]) == 9
    notes = "\n".join(run.warnings)
    assert f"{path}:9: not valid JSON" in notes and f"{path}:10: not a JSON object" in notes
    assert "first 9 of" not in notes  # 8 good rows + 1 odd one: nothing capped
    odd_row = run.rollouts[2][8]
    assert odd_row["prompt"] == "" and odd_row["response"] == '{"structured": true}'
    assert odd_row["reward"] is None and odd_row["reward_raw"] == "nan"
    assert odd_row["reward_info"] == {"score": "inf"} and odd_row["extra"] == {"tool_calls": 3}
    capped = load_run(run_dir, max_rollouts_per_step=4)
    assert len(capped.rollouts[2]) == 4
    assert any("showing the first 4 of 9 trajectories" in w for w in capped.warnings)


def test_an_incomplete_last_line_is_skipped_with_a_note(run_dir, spec):
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "train/rew')
    run = load_run(run_dir)
    assert run.metrics[-1]["step"] == spec["steps"]
    assert any("last line is incomplete" in w for w in run.warnings)


@pytest.mark.parametrize("content, message", [
    ('{"step": 1}\n{oops\n{"step": 3}\n', "metrics.jsonl:2: not valid JSON"),
    ('{"step": 1}\n{"loss": 3}\n', "metrics.jsonl:2: expected a JSON object with an integer 'step'"),
    ('{"step": "1"}\n', "metrics.jsonl:1: expected a JSON object with an integer 'step'"),
    ("[1, 2]\n", "metrics.jsonl:1: expected a JSON object"),
    ("\n\n", "metrics.jsonl: holds no steps yet"),
])
def test_corrupt_metrics_name_the_file_and_line(tmp_path, content, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ConfigError, match="metrics.jsonl") as info:
        load_run(tmp_path)
    assert str(tmp_path) in str(info.value) and message in str(info.value)


def test_missing_directory_file_or_metrics_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'absent'}: no such run directory"):
        load_run(tmp_path / "absent")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match="file.txt: not a directory"):
        load_run(tmp_path / "file.txt")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'metrics.jsonl'}: not found"):
        load_run(tmp_path)


def test_a_bad_summary_is_a_note_not_an_error(run_dir):
    (run_dir / "summary.json").write_text("{not json")
    run = load_run(run_dir)
    assert run.summary is None and any("summary.json: not valid JSON" in w for w in run.warnings)


def test_charts_group_metrics_and_keep_the_unclaimed_ones(run_dir):
    run = load_run(run_dir)
    charts = {c.id: c for c in plan_charts(run.numeric_keys(), run.non_finite)}
    assert charts["reward"].keys == ["train/reward_mean", "eval/reward_mean"]
    assert charts["reward"].band == ("train/reward_mean", "train/reward_std")
    assert charts["kl"].keys == ["actor/kl_ref", "actor/approx_kl"]
    assert charts["staleness"].keys == ["staleness/mean"]
    assert charts["time"].keys[0] == "time/step_s"
    assert charts["grad"].non_finite == {"train/grad_norm": [17]}
    assert charts["metric-custom-widgets"].extra and charts["metric-custom-widgets"].keys == ["custom/widgets"]
    assert "nll" not in charts  # no NLL metrics in an RL run
    drawn = [k for c in charts.values() for k in c.keys]
    assert len(drawn) == len(set(drawn))  # no metric in two charts
    assert set(drawn) | {"train/reward_std"} == set(run.numeric_keys())


def test_sft_charts_and_headline(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "sft/nll": 2.0, "time/step_s": 3.0}\n{"step": 2, "sft/nll": 1.5, "time/step_s": 4.5}\n'
        '{"step": 2, "eval/nll": 1.25}\n')
    run = load_run(tmp_path)
    assert [c.id for c in plan_charts(run.numeric_keys())] == ["nll", "time"]
    figures = {f.label: f for f in headline(run)}
    assert figures["train NLL"].value == "2 → 1.5"
    assert figures["eval NLL"].value == "1.25 → 1.25"
    assert figures["wall time"].value == "7.5 s" and figures["wall time"].hint == "sum of time/step_s"
    assert figures["status"].value == "no summary.json (last step 2)"


def test_headline_of_a_finished_rl_run(run_dir):
    figures = {f.label: f for f in headline(load_run(run_dir))}
    assert figures["steps"].value == "30"
    assert figures["train reward"].value.startswith("0.1533 → ")  # 0.1 + 0.7/30 + 0.03
    assert figures["eval reward"].value == "0.15 → 0.8" and figures["eval reward"].hint == "summary.json"
    assert figures["wall time"].value == "1 min 02 s"
    assert figures["status"].value == "finished"


def test_an_agentic_headline_shows_the_environments_success_rate(tmp_path):
    """On a learned reward the eval reward is its score; the success rate is the true measure,
    from before step 1 (summary.json's `eval_start`) to the last evaluation."""
    (tmp_path / "config.yaml").write_text("pipeline: agentic\n")
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 5, "train/reward_mean": 2.0, "eval/reward_mean": 3.4, "eval/success_rate": 0.9}\n')
    (tmp_path / "summary.json").write_text(json.dumps(
        {"steps": 5, "eval_reward_start": -1.3, "eval_reward_end": 3.4,
         "eval_start": {"eval/reward_mean": -1.3, "eval/success_rate": 0.375}}))
    figures = {f.label: f for f in headline(load_run(tmp_path))}
    assert figures["eval reward"].value == "-1.3 → 3.4"
    assert figures["eval success rate"].value == "0.375 → 0.9"
    (tmp_path / "summary.json").unlink()  # a run still going: its eval steps alone
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "eval/success_rate": 0.5}\n{"step": 4, "eval/success_rate": 0.75}\n')
    figures = {f.label: f for f in headline(load_run(tmp_path))}
    assert figures["eval success rate"].value == "0.5 → 0.75"


def test_held_out_samples_and_turn_rewards_are_read(run_dir, held_out):
    run = load_run(run_dir)
    assert list(run.eval_rollouts) == list(held_out["eval_steps"])  # eval_step_0 is before training
    assert 30 in run.rollouts and 0 not in run.rollouts  # eval files are not training steps
    assert [r["prompt"] for r in run.eval_rollouts[10]] == \
        [r["prompt"] for r in run.eval_rollouts[0]]
    assert run.rollouts[30][0]["turn_rewards"] == [-0.1, 1.0]
    assert run.rollouts[30][0]["num_turns"] == 2
    rows = payload(run)["rollouts"]
    assert {r["split"] for r in rows} == {"train", "eval"}
    assert sum(r["split"] == "eval" for r in rows) == \
        len(held_out["eval_steps"]) * held_out["eval_prompts"]

"""The report in a real headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
selenium): it loads from disk without console errors or network requests, the curves are drawn,
and the rollout table's filters change what is shown.

Skipped, with the reason, only when chromium or chromedriver is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import yaml

from reroll.viewer import cmd_view, write_report

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--window-size=1400,1000")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("Chromium is not installed: apt-get install -y chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing from the environment: pip install -e .[dev]")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def open_report(driver, path):
    driver.get(path.resolve().as_uri())
    deadline = time.monotonic() + 20
    while driver.execute_script("return document.body && document.body.dataset.ready") != "1":
        assert time.monotonic() < deadline, "the page's script did not finish"
        time.sleep(0.05)


def console_problems(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def visible_rows(driver) -> int:
    rows = driver.find_elements("css selector", "#rollout-body tr.rollout-row")
    return sum(row.is_displayed() for row in rows)


def path_vertices(driver, chart: str, key: str) -> dict:
    """Vertices and pen-up moves of a series' drawn path, and its length on screen."""
    return driver.execute_script("""
        const p = document.querySelector(`#chart-${arguments[0]} path[data-key="${arguments[1]}"]`);
        if (!p) return null;
        const d = p.getAttribute("d");
        const box = p.getBoundingClientRect();
        return {moves: (d.match(/M/g) || []).length, lines: (d.match(/L/g) || []).length,
                length: p.getTotalLength(), width: box.width, height: box.height};
    """, chart, key)


def set_value(driver, element_id: str, text: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(text)


def select(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(value)


def test_console_errors_would_be_seen(browser, run_dir):
    """The console check below is real: an error thrown on the page shows in the log."""
    _, report = write_report(run_dir)
    open_report(browser, report)
    browser.get_log("browser")
    browser.execute_script("setTimeout(() => { throw new Error('probe-error'); }, 0)")
    time.sleep(0.3)
    assert any("probe-error" in e["message"] for e in console_problems(browser))


def test_report_loads_offline_and_draws_the_curves(browser, run_dir, spec):
    _, report = write_report(run_dir)
    browser.get_log("browser")  # start from an empty log
    open_report(browser, report)
    assert console_problems(browser) == []
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0

    reward = path_vertices(browser, "reward", "train/reward_mean")
    assert reward["moves"] == 1 and reward["lines"] == spec["steps"] - 1
    assert reward["length"] > 100 and reward["width"] > 200 and reward["height"] > 50
    eval_points = browser.find_elements("css selector", '#chart-reward circle[data-key="eval/reward_mean"]')
    assert len(eval_points) == spec["steps"] // spec["eval_every"] + 1  # + the start, at step 0
    assert browser.find_elements("css selector", "#chart-reward polygon.band")  # ± std
    grad = path_vertices(browser, "grad", "train/grad_norm")
    assert grad["moves"] == 2  # the nan at step 17 breaks the line
    assert "non-finite" in browser.find_element("id", "chart-grad").text
    for chart in ("kl", "entropy", "length", "clip", "staleness", "time"):
        assert browser.find_elements("css selector", f"#chart-{chart} path.series"), chart
    assert not browser.find_elements("css selector", "#chart-nll")
    assert browser.find_element("id", "more-count").text == "1"


def test_filters_change_the_visible_rows(browser, run_dir, spec):
    _, report = write_report(run_dir)
    open_report(browser, report)
    total = len(spec["rollout_steps"]) * spec["rows_per_step"]
    count = browser.find_element("id", "rollout-count")
    assert visible_rows(browser) == total and count.text.startswith(f"{total} of {total}")

    set_value(browser, "f-text", "zebra")
    assert visible_rows(browser) == spec["zebra_rows"]
    assert count.text.startswith(f"{spec['zebra_rows']} of {total}")
    set_value(browser, "f-min", "0.5")  # zebra rows have rewards 0, 1, 0.5
    assert visible_rows(browser) == 2
    select(browser, "f-step", "2")  # no zebras at step 2
    assert visible_rows(browser) == 0 and count.text.startswith(f"0 of {total}")

    browser.find_element("id", "f-clear").click()
    assert visible_rows(browser) == total
    set_value(browser, "f-min", "0")
    set_value(browser, "f-max", "0.5")  # rewards cycle 0, 1, 0.5, -1
    assert visible_rows(browser) == total // 2
    browser.find_element("id", "f-clear").click()
    set_value(browser, "f-text", "LEGS   cat")  # every word, any case
    assert visible_rows(browser) == total - spec["zebra_rows"]
    browser.find_element("id", "f-clear").click()
    select(browser, "f-finish", "stop")
    assert visible_rows(browser) == total // 2
    browser.find_element("id", "f-clear").click()

    browser.find_element("css selector", 'th[data-key="reward"]').click()  # highest reward first
    first = browser.find_element("css selector", "#rollout-body tr.rollout-row td.reward")
    assert first.text == "1"
    assert console_problems(browser) == []


def test_agentic_trajectories_show_their_turns(browser, run_dir):
    _, report = write_report(run_dir)
    open_report(browser, report)
    select(browser, "f-step", "20")
    row = browser.find_element("css selector", "#rollout-body tr.rollout-row")
    assert "2 turns" in row.text  # two guesses; the env's replies are not turns
    row.click()
    turns = browser.find_elements("css selector", "tr.rollout-detail .turn")
    assert [t.get_attribute("data-role") for t in turns] == ["policy", "env", "policy", "env"]
    assert "turn-policy" in turns[0].get_attribute("class")
    assert "turn-env" in turns[1].get_attribute("class")
    assert turns[0].value_of_css_property("background-color") != \
        turns[1].value_of_css_property("background-color")
    assert "Game over: you won." in turns[3].text
    browser.find_element("css selector", "#rollout-body tr.rollout-row.open").click()  # closes
    assert not browser.find_elements("css selector", "tr.rollout-detail")
    assert console_problems(browser) == []


def test_report_of_a_real_training_run(browser, tmp_path, tiny_model, arithmetic, capsys):
    """Train the tiny model for 3 steps, recording rollouts; the report shows those numbers."""
    from reroll.config import load_config
    from reroll.pipelines.rlvr import train

    steps, recorded = 3, 8
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": steps,
        "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
        "train": {"micro_batch_size": 8}, "eval": {"every_steps": 2, "max_prompts": 4},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": recorded}}))
    summary = train(load_config(config))
    run_dir = tmp_path / "run"

    cmd_view(type("Args", (), {"run_dir": str(run_dir), "out": None, "max_rollouts_per_step": 500})())
    assert f"report written to {(run_dir / 'report.html').resolve()}" in capsys.readouterr().out
    browser.get_log("browser")
    open_report(browser, run_dir / "report.html")
    assert console_problems(browser) == []

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drawn = browser.execute_script(
        "return JSON.parse(document.getElementById('run-data').textContent).series['train/reward_mean']")
    assert drawn == [[m["step"], m["train/reward_mean"]] for m in metrics]
    assert path_vertices(browser, "reward", "train/reward_mean")["lines"] == steps - 1
    eval_points = browser.find_elements("css selector", '#chart-reward circle[data-key="eval/reward_mean"]')
    assert len(eval_points) == 1 + sum("eval/reward_mean" in m for m in metrics)  # + start
    cards = browser.find_element("id", "overview").text
    assert f"STEPS\n{summary['steps']}" in cards and "finished" in cards

    evaluated = [0] + [m["step"] for m in metrics if "eval/reward_mean" in m]
    held_out = {n: (run_dir / "rollouts" / f"eval_step_{n}.jsonl").read_text().splitlines()
                for n in evaluated}  # written by the run: before training and at each eval
    assert all(len(rows) == 4 for rows in held_out.values())  # eval.max_prompts x 1 sample
    assert [json.loads(r)["prompt"] for r in held_out[0]] == \
        [json.loads(r)["prompt"] for r in held_out[evaluated[-1]]]  # the eval set's order
    select(browser, "f-split", "eval")
    assert visible_rows(browser) == 4 * len(evaluated)
    select(browser, "f-split", "train")
    assert visible_rows(browser) == steps * recorded
    select(browser, "f-step", "2")
    assert visible_rows(browser) == recorded
    first_prompt = json.loads((run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()[0])["prompt"]
    set_value(browser, "f-text", first_prompt.split("?")[0])
    shown = visible_rows(browser)
    assert 1 <= shown <= recorded
    assert all(first_prompt.split("?")[0] in r.get_attribute("textContent") for r in
               browser.find_elements("css selector", "#rollout-body tr.rollout-row"))


def test_agentic_segments_show_policy_tokens_against_env_tokens(browser, run_dir):
    """Rows written by the agentic pipeline carry `segments` (policy vs environment tokens);
    the report shows them turn by turn, and `async/staleness*` metrics get the staleness chart."""
    segments = [{"text": "<guess>50</guess>", "policy": True, "turn": 0},
                {"text": "Too high.", "policy": False, "turn": 0},
                {"text": "<guess>", "policy": True, "turn": 1},
                {"text": "25</guess>", "policy": True, "turn": 1},
                {"text": "Correct!", "policy": False, "turn": 1}]
    (run_dir / "rollouts" / "step_30.jsonl").write_text(json.dumps(
        {"prompt": "Guess a number between 1 and 100.", "response": "", "reward": 1.0,
         "segments": segments, "finish_reason": "stop", "group_id": 0}) + "\n")
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 31, "async/staleness_mean": 0.5, "async/staleness_max": 1,
                            "time/step_s": 1.25}) + "\n")
    _, report = write_report(run_dir)
    browser.get_log("browser")
    open_report(browser, report)
    assert console_problems(browser) == []
    staleness = browser.find_elements("css selector", "#chart-staleness path.series")
    assert {p.get_attribute("data-key") for p in staleness} >= {"async/staleness_mean",
                                                                 "async/staleness_max"}
    assert browser.find_elements("css selector", "#chart-time path.series")

    select(browser, "f-step", "30")
    row = browser.find_element("css selector", "#rollout-body tr.rollout-row")
    assert "2 turns" in row.text  # policy turns 0 and 1 (turn 1 came in two segments)
    row.click()
    turns = browser.find_elements("css selector", "tr.rollout-detail .turn")
    assert [t.get_attribute("data-role") for t in turns] == ["policy", "env", "policy", "env"]
    assert "TURN 1" in turns[2].text.upper() and "<guess>25</guess>" in turns[2].text
    assert turns[0].value_of_css_property("background-color") != \
        turns[1].value_of_css_property("background-color")
    set_value(browser, "f-text", "too high")
    assert visible_rows(browser) == 1


def test_held_out_samples_beside_training_a_prompt_followed_and_turn_rewards(
        browser, run_dir, spec, held_out):
    _, report = write_report(run_dir)
    browser.get_log("browser")
    open_report(browser, report)
    train = len(spec["rollout_steps"]) * spec["rows_per_step"] + 1  # + the episode at step 30
    evals = len(held_out["eval_steps"]) * held_out["eval_prompts"]
    assert visible_rows(browser) == train + evals
    select(browser, "f-split", "eval")
    rows = browser.find_elements("css selector", "#rollout-body tr.rollout-row")
    assert len(rows) == evals and all(r.get_attribute("data-split") == "eval" for r in rows)
    assert all("eval" in r.find_element("css selector", "td").text for r in rows)

    set_value(browser, "f-text", "Held-out 2:")
    browser.find_element("css selector", "#rollout-body tr.rollout-row").click()
    browser.find_element("css selector", "tr.rollout-detail button.follow").click()
    assert browser.find_element("id", "following").is_displayed()
    assert "Held-out 2: what is 2 + 2?" in browser.find_element("id", "following-prompt").text
    set_value(browser, "f-text", "")
    followed = browser.find_elements("css selector", "#rollout-body tr.rollout-row")
    assert [int(r.get_attribute("data-step")) for r in followed] == list(held_out["eval_steps"])
    rewards = [r.find_element("css selector", "td.reward").text for r in followed]
    assert rewards == ["0", "0", "1"]  # prompt 2 is solved at the last evaluation
    browser.find_element("id", "follow-clear").click()
    assert not browser.find_element("id", "following").is_displayed()
    select(browser, "f-split", "all")
    assert visible_rows(browser) == train + evals

    select(browser, "f-step", "30")
    row = browser.find_element("css selector", "#rollout-body tr.rollout-row")
    assert "2 turns: -0.1 \u00b7 1" in row.text
    row.click()
    turns = browser.find_elements("css selector", "tr.rollout-detail .turn")
    labels = [t.find_element("css selector", ".role").get_attribute("textContent") for t in turns]
    assert "reward -0.1" in labels[0] and "reward 1" in labels[2]
    assert "reward" not in labels[1]  # the environment's text has no reward of its own
    assert console_problems(browser) == []


def test_several_runs_are_overlaid_one_line_per_run(browser, tmp_path, make_run):
    from reroll.viewer.compare import write_comparison

    runs = []
    for name in ("grpo", "dapo"):
        path = make_run(tmp_path / name)
        config = yaml.safe_load((path / "config.yaml").read_text()) | {"name": name}
        (path / "config.yaml").write_text(yaml.safe_dump(config))
        runs.append(path)
    _, report = write_comparison(runs)
    browser.get_log("browser")
    open_report(browser, report)
    assert console_problems(browser) == []
    lines = {p.get_attribute("data-key")
             for p in browser.find_elements("css selector", "#chart-reward path.series")}
    assert {"grpo \u00b7 train/reward_mean", "dapo \u00b7 train/reward_mean"} <= lines
    legend = browser.find_element("css selector", "#chart-reward").text
    assert "grpo \u00b7 eval/reward_mean" in legend and "dapo \u00b7 eval/reward_mean" in legend


def test_special_tokens_are_marked_not_shown_as_the_models_text(browser, run_dir, tmp_path):
    """`<|im_end|>` and the tokenizer's own special tokens were shown raw, like the model's text."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"content": "<eos>", "special": True}, {"content": "<tool>", "special": False}]}))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["path"] = str(model)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "rollouts" / "step_40.jsonl").write_text(json.dumps(
        {"prompt": "<|im_start|>user\nHi<|im_end|>", "response": "Hello <tool> x<eos>",
         "reward": 1.0, "finish_reason": "stop", "group_id": 0}) + "\n")
    _, report = write_report(run_dir)
    open_report(browser, report)
    select(browser, "f-step", "40")
    row = browser.find_element("css selector", "#rollout-body tr.rollout-row")
    marked = [s.text for s in row.find_elements("css selector", ".special")]
    assert marked == ["<|im_start|>", "<|im_end|>", "<eos>"]  # `<tool>` is not special
    assert "Hello <tool> x" in row.text
    span = row.find_element("css selector", ".special")
    assert span.value_of_css_property("background-color") != \
        row.find_element("css selector", "td.text").value_of_css_property("background-color")
    row.click()
    detail = browser.find_element("css selector", "tr.rollout-detail")
    assert [s.text for s in detail.find_elements("css selector", ".special")] == marked
    assert console_problems(browser) == []

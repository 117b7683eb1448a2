"""Multi-domain RLVR on the tiny model: each domain's share of the batch is its weight, its
metrics are present and move, a domain whose reward fails fails alone, and resume is exact."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from reroll.config import load_config
from reroll.pipelines.rlvr import train
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
RULES = [{"check": "word_count", "max": 8}, {"check": "include_keywords", "keywords": ["answer"]}]


def write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def domains_data(tmp_path_factory, tiny_model):
    """The tiny model after a short SFT on single-digit additions, and two domains' files:
    additions scored by math-verify, and the same kind of prompts scored by rules."""
    from reroll.data.tasks import arithmetic_rows, write_arithmetic

    root = tmp_path_factory.mktemp("domains")
    data = write_arithmetic(root / "sft", train_size=1200, eval_size=16, seed=0, levels=(1,))
    (root / "sft.yaml").write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(root / "sft_run"), "model": {"path": tiny_model},
        "data": {"train": str(data["train"]), "response_key": "solution"},
        "epochs": 3.0, "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "train": {"micro_batch_size": 32}, "tracking": {"progress": False, "tensorboard": False}}))
    model = train_sft(load_config(root / "sft.yaml", expect="sft"))["final_model"]
    add = list(arithmetic_rows(80, seed=5, levels=(1,)))
    rules = [{"prompt": r["prompt"], "constraints": RULES}
             for r in arithmetic_rows(80, seed=6, levels=(1,))]
    return {"model": model,
            "add": (write(root / "add.jsonl", add[:64]), write(root / "add_eval.jsonl", add[64:])),
            "rules": (write(root / "rules.jsonl", rules[:64]),
                      write(root / "rules_eval.jsonl", rules[64:]))}


def domain_config(tmp_path, d, **overrides) -> dict:
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 1, "steps": 6,
        "model": {"path": d["model"]},
        "data": {"domains": [
            {"name": "add", "train": d["add"][0], "eval": d["add"][1], "weight": 1.0,
             "reward": {"type": "math"}},
            {"name": "rules", "train": d["rules"][0], "eval": d["rules"][1], "weight": 3.0,
             "reward": {"type": "rules"}, "dynamic_sampling": {"drop_all_equal": True}}]},
        "rollout": {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 24},
        "optimizer": {"lr": 3e-4}, "train": {"micro_batch_size": 32},
        "eval": {"every_steps": 3, "temperature": 1.0, "samples_per_prompt": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 8},
    }
    config.update(overrides)
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(config))
    return config


def test_two_domains_share_the_batch_by_weight_and_report_their_metrics(tmp_path,
                                                                         domains_data):
    domain_config(tmp_path, domains_data)
    summary = train(load_config(tmp_path / "rl.yaml"))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:  # weights 1:3 of 4 prompts: exactly 1 and 3 every step
        assert (r["train/add/prompts"], r["train/rules/prompts"]) == (1.0, 3.0)
        assert r["train/add/share"] == 0.25 and r["train/rules/share"] == 0.75
        for name in ("add", "rules"):
            for key in ("reward_mean", "pass_rate", "response_len_mean", "truncated_frac",
                        "groups_filtered", "reward_errors"):
                assert f"train/{name}/{key}" in r, (name, key)
            assert f"time/{name}/rollout_s" in r
    # the rules domain's own filter dropped (and refilled) its all-equal groups; add has none
    assert sum(r["train/rules/groups_filtered"] for r in rows) > 0
    assert all(r["train/add/groups_filtered"] == 0 for r in rows)
    for name in ("add", "rules"):
        series = [r[f"train/{name}/reward_mean"] for r in rows]
        assert len(set(series)) > 1, (name, series)  # the metric moves
        assert f"eval/{name}/reward_mean" in rows[2] and f"eval/{name}/reward_mean" in rows[5]
    assert "eval/reward_mean" in rows[5] and summary["eval_reward_end"] is not None
    assert {"eval_start/add/reward_mean", "eval_start/rules/reward_mean"} <= set(rows[0])
    assert "eval_start/add/reward_mean" not in rows[1]
    recorded = [json.loads(line) for line in
                (tmp_path / "run" / "rollouts" / "step_1.jsonl").open()]
    assert {r["domain"] for r in recorded} == {"add", "rules"}
    assert all("checks" in r["reward_info"] for r in recorded if r["domain"] == "rules")


def test_a_domain_whose_reward_fails_fails_alone(tmp_path, domains_data):
    config = domain_config(tmp_path, domains_data, steps=2, eval={"every_steps": 0})
    config["data"]["domains"][1]["reward"] = {
        "type": "custom", "function": "rewards_for_tests:always_raises",
        "max_failure_rate_step": 0.5, "max_failure_rate_run": 1.0}
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(config))
    sys.path.insert(0, str(HERE))
    try:
        train(load_config(tmp_path / "rl.yaml"))
    finally:
        sys.path.remove(str(HERE))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["train/rules/reward_failed_steps"] for r in rows] == [1.0, 2.0]
    # every call failed: at least 2 steps x 3 prompts x 8 responses and the 16 held-out prompts
    # at start (more: the domain's filter drops the all-zero groups and refills them)
    assert rows[-1]["train/rules/reward_errors"] >= 2 * 3 * 8 + 16
    assert rows[-1]["train/add/reward_errors"] == 0.0
    assert all("train/add/reward_mean" in r for r in rows)


def test_resume_with_domains_reproduces_the_uninterrupted_run(tmp_path, domains_data):
    config = domain_config(tmp_path, domains_data, steps=4,
                           data={"reweight": "mean_reward", "domains": [
                               {"name": "add", "train": domains_data["add"][0], "weight": 1.0},
                               {"name": "rules", "train": domains_data["rules"][0],
                                "weight": 1.0, "reward": {"type": "rules"}}]},
                           eval={"every_steps": 0})
    train(load_config(tmp_path / "rl.yaml"))
    full = read_metrics(tmp_path / "run")
    interrupted = tmp_path / "interrupted"
    shutil.copytree(tmp_path / "run", interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_4")
    lines = (interrupted / "metrics.jsonl").read_text().splitlines()[:3]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    config["output_dir"] = str(interrupted)
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(config))
    summary = train(load_config(tmp_path / "rl.yaml", ["resume=true"]))
    resumed = read_metrics(interrupted)
    assert summary["resumed_from_step"] == 2
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if not k.startswith("time/")}, a["step"]
    # mean_reward weighting: equal shares at first, then most prompts to the domain whose
    # reward is lower (the warm model keeps the rules nearly always, gets few sums right)
    assert (full[0]["train/add/prompts"], full[0]["train/rules/prompts"]) == (2.0, 2.0)
    assert full[0]["train/add/reward_mean"] < full[0]["train/rules/reward_mean"]
    assert sum(r["train/add/prompts"] for r in full[1:]) > \
        sum(r["train/rules/prompts"] for r in full[1:])


def trained_prompts(run: Path, steps) -> list[list[tuple[str, str]]]:
    """Each step's (domain, prompt) groups in the order the trainer took them."""
    return [list(dict.fromkeys((r["domain"], r["prompt"]) for r in map(
        json.loads, (run / "rollouts" / f"step_{n}.jsonl").read_text().splitlines())))
        for n in steps]


def test_async_domains_share_by_weight_and_resume_with_every_prompt_once(tmp_path,
                                                                         domains_data):
    """Issue 46: async training with domains. The producer splits each block of groups by the
    domains' weights (1:3 of 4), each group is scored by its domain's reward, and a run killed
    after its step-1 checkpoint (groups buffered and in flight: the producer works a batch
    ahead) resumes to train the uninterrupted run's prompts, step by step: none lost, none
    trained twice. (A kill -9 after a checkpoint leaves what deleting the later ones leaves.)"""
    config = domain_config(
        tmp_path, domains_data, steps=3, eval={"every_steps": 0},
        checkpoint={"every_steps": 1, "keep_last": 3},
        async_training={"enabled": True, "max_staleness": 2, "max_ahead": 1, "order": "start"},
        tracking={"progress": False, "tensorboard": False, "record_rollouts": 32})
    del config["data"]["domains"][1]["dynamic_sampling"]  # which groups pass would vary by timing
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    train(load_config(tmp_path / "rl.yaml"))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (r["train/add/prompts"], r["train/rules/prompts"]) == (1.0, 3.0)
        assert r["staleness/max"] <= 2 and "train/rules/reward_mean" in r
    whole = trained_prompts(run, (1, 2, 3))
    assert all(sorted(d for d, _ in step) == ["add", "rules", "rules", "rules"] for step in whole)
    for n in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{n}")
    summary = train(load_config(tmp_path / "rl.yaml", ["resume=true"]))
    assert summary["resumed_from_step"] == 1
    resumed = trained_prompts(run, (2, 3))
    assert resumed == whole[1:]
    trained = sum(whole[:1] + resumed, [])
    assert len(set(trained)) == len(trained) == 12


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> Path:
    """A folder with the multidomain examples' data, written as documented (by their script),
    once for the examples' tests; each test's run goes to its own runs/<name> below it."""
    from reroll.data.tasks import write_arithmetic

    root = tmp_path_factory.mktemp("multidomain")
    example = HERE.parents[1] / "examples" / "multidomain"
    cwd = os.getcwd()
    os.chdir(root)
    sys.path.insert(0, str(example))
    try:
        write_arithmetic("data/arithmetic", train_size=64, eval_size=8, seed=0)
        import make_data

        make_data.main()
    finally:
        sys.path.remove(str(example))
        os.chdir(cwd)
    return root


def test_the_multidomain_example_trains_shrunk(example_data, domains_data, monkeypatch):
    """examples/multidomain/grpo.yaml as documented (its data written by its script), with
    fewer and smaller steps: math, rules and reasoning-gym domains in one run."""
    repo = HERE.parents[1]
    monkeypatch.chdir(example_data)
    config = load_config(repo / "examples" / "multidomain" / "grpo.yaml", [
        f"model.path={domains_data['model']}", "steps=2", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "train.micro_batch_size=8", "eval.max_prompts=4",
        "tracking.progress=false", "tracking.tensorboard=false"])
    train(config)
    rows = read_metrics(example_data / "runs" / "multidomain-grpo")
    assert [(r["train/math/prompts"], r["train/rules/prompts"], r["train/gym/prompts"])
            for r in rows] == [(2.0, 1.0, 1.0)] * 2
    assert {"eval/math/reward_mean", "eval/rules/reward_mean", "eval/gym/reward_mean"} <= \
        set(rows[-1])


def test_the_math_code_rules_example_trains_shrunk_and_evaluates_per_domain(
        example_data, domains_data, monkeypatch, capsys):
    """examples/multidomain/code.yaml as documented, with 2 small steps: the code domain's
    programs run in the sandbox; its metrics (train/code/..., eval/code/...) come with the
    others', and `reroll eval` on its last checkpoint reports every domain as training does."""
    from reroll.cli import main
    repo = HERE.parents[1]
    monkeypatch.chdir(example_data)
    config = load_config(repo / "examples" / "multidomain" / "code.yaml", [
        f"model.path={domains_data['model']}", "steps=2", "rollout.prompts_per_step=3",
        "rollout.group_size=2", "train.micro_batch_size=6", "eval.max_prompts=3",
        "tracking.progress=false", "tracking.tensorboard=false"])
    train(config)
    rows = read_metrics(example_data / "runs" / "multidomain-code")
    names = ("math", "code", "rules")
    assert [tuple(r[f"train/{n}/prompts"] for n in names) for r in rows] == [(1.0, 1.0, 1.0)] * 2
    for r in rows:
        for key in ("reward_mean", "pass_rate", "response_len_mean", "truncated_frac",
                    "reward_errors"):
            assert f"train/code/{key}" in r, key
        assert r["train/code/reward_errors"] == 0.0  # every program ran and was scored
    assert {f"eval/{n}/reward_mean" for n in names} <= set(rows[-1])
    assert {f"eval_start/{n}/pass_rate" for n in names} <= set(rows[0])
    recorded = [json.loads(line) for line in
                (example_data / "runs" / "multidomain-code" / "rollouts" / "step_1.jsonl").open()]
    assert all("passed" in r["reward_info"] for r in recorded if r["domain"] == "code")

    assert main(["eval", "--model", "runs/multidomain-code/checkpoints/step_2", "--threads", "1",
                 "--out", "eval.json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(results["domains"]) == list(names)
    for n in names:  # greedy, as the run's evaluation: the same figures as its last one
        assert results[f"eval/{n}/reward_mean"] == pytest.approx(rows[-1][f"eval/{n}/reward_mean"])

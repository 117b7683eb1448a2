"""`reroll eval --model RUN/checkpoints/step_N` evaluates on the run's task with the run's
settings (eval set or environment, reward, turns, token limits, sampling), each overridable by
its flag, and says which it took."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e
PIPELINE_TESTS = Path(__file__).parent.parent / "pipelines"  # parity_reward.py lives there


def fake_run(root: Path, tiny_model: str, config: dict) -> str:
    """A run directory as `reroll train` leaves it: its config.yaml and a checkpoint."""
    (root / "run" / "checkpoints").mkdir(parents=True)
    (root / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    checkpoint = root / "run" / "checkpoints" / "step_2"
    shutil.copytree(tiny_model, checkpoint)
    return str(checkpoint)


def run_eval(capsys, *flags) -> tuple[dict, str]:
    assert main(["eval", *flags]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), " ".join(captured.err.split())


def test_an_agentic_checkpoint_plays_the_runs_env(tmp_path, tiny_model, capsys):
    checkpoint = fake_run(tmp_path, tiny_model, {
        "pipeline": "agentic", "steps": 2, "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 4}, "max_turns": 2,
                "max_context_tokens": 96, "eval_episodes": 3},
        "rollout": {"max_new_tokens": 3, "prompts_per_step": 2, "group_size": 2},
        "train": {"micro_batch_size": 4}})
    out = tmp_path / "res.json"
    results, err = run_eval(capsys, "--model", checkpoint, "--threads", "1", "--out", str(out))
    assert results["env"] == "guess_number" and results["prompts"] == 3
    assert results["max_new_tokens"] == 3 and results["temperature"] == 0.0
    assert results["taken_from_run"]["max_turns"] == "env.max_turns"
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").open()]
    turns = [sum(seg["policy"] for seg in sample["segments"]) for sample in samples]
    assert len(turns) == 3 and max(turns) <= 2  # env.max_turns, not eval's default 8
    assert "settings from" in err and "max_new_tokens=3 (rollout.max_new_tokens)" in err
    assert "env_kwargs={'high': 4} (env.kwargs)" in err

    # A flag wins over the run's value; --ignore-run-config takes none.
    results, err = run_eval(capsys, "--model", checkpoint, "--threads", "1", "--out", str(out),
                            "--max-new-tokens", "5", "--episodes", "2")
    assert results["max_new_tokens"] == 5 and results["prompts"] == 2
    assert "max_new_tokens" not in results["taken_from_run"]
    assert main(["eval", "--model", checkpoint, "--ignore-run-config", "--out", str(out)]) == 2
    assert "--task or --env" in capsys.readouterr().err


def test_an_rlvr_checkpoint_uses_the_runs_eval_set_and_reward(tmp_path, tiny_model, arithmetic,
                                                               capsys):
    checkpoint = fake_run(tmp_path, tiny_model, {
        "steps": 2, "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"],
                 "max_prompt_tokens": 200},
        "reward": {"type": "custom", "function": "parity_reward:odd_length"},
        "rollout": {"max_new_tokens": 6, "prompts_per_step": 2, "group_size": 2},
        "train": {"micro_batch_size": 4}})
    sys.path.insert(0, str(PIPELINE_TESTS))
    try:
        results, err = run_eval(capsys, "--model", checkpoint, "--max-prompts", "3", "--n", "2",
                                "--threads", "1", "--out", str(tmp_path / "res.json"))
    finally:
        sys.path.remove(str(PIPELINE_TESTS))
    assert results["task"] == arithmetic["eval"] and results["prompts"] == 3
    assert results["max_new_tokens"] == 6 and results["temperature"] == 1.0  # rollout's, for n > 1
    assert results["taken_from_run"] == {
        "task": "data.eval", "reward": "reward.type", "reward_function": "reward.function",
        "max_prompt_tokens": "data.max_prompt_tokens", "max_new_tokens": "rollout.max_new_tokens",
        "top_p": "rollout.top_p", "temperature": "rollout.temperature"}
    assert "reward_function='parity_reward:odd_length' (reward.function)" in err


@pytest.mark.unit
def test_a_run_trained_on_a_learned_reward_is_evaluated_with_its_eval_reward(tmp_path):
    from reroll.evaluation_settings import run_settings

    (tmp_path / "eval.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
    base = {"pipeline": "rlvr", "steps": 2, "model": {"path": "m"},
            "data": {"train": "t.jsonl", "eval": str(tmp_path / "eval.jsonl")},
            "reward": {"type": "model", "path": "rm"}}
    for name, config, taken in (("with", base | {"eval": {"reward": {"type": "math"}}},
                                 ("math", "eval.reward.type")),
                                ("without", base, None)):
        run = tmp_path / name / "run"
        (run / "checkpoints" / "step_2").mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        _, settings = run_settings(str(run / "checkpoints" / "step_2"), {})
        assert settings.get("reward") == taken  # a model reward is not one --reward can name


def test_a_multidomain_checkpoint_is_evaluated_per_domain(tmp_path, tiny_model, arithmetic,
                                                          capsys):
    """Each domain with a held-out set (a file, or reasoning-gym's generated one) is sampled and
    scored by its own reward (a file domain without one: the run's `reward:`), at most the run's
    eval.max_prompts each; the figures carry training's names (eval/<domain>/reward_mean)."""
    from reroll.data.tasks import write_code

    code = write_code(tmp_path / "code", train_size=8, eval_size=4, seed=0)
    checkpoint = fake_run(tmp_path, tiny_model, {
        "steps": 2, "model": {"path": tiny_model},
        "data": {"domains": [
            {"name": "math", "train": arithmetic["train"], "eval": arithmetic["eval"]},
            {"name": "code", "train": str(code["train"]), "eval": str(code["eval"]),
             "reward": {"type": "code", "time_limit_s": 5.0}},
            {"name": "gym", "reasoning_gym": {"task": "basic_arithmetic", "size": 8,
                                              "eval_size": 2}},
            {"name": "nothing_held_out", "train": arithmetic["train"]}]},
        "eval": {"max_prompts": 3},
        "rollout": {"max_new_tokens": 6, "prompts_per_step": 2, "group_size": 2},
        "train": {"micro_batch_size": 4}})
    out = tmp_path / "res.json"
    results, err = run_eval(capsys, "--model", checkpoint, "--threads", "1", "--out", str(out))
    assert set(results["domains"]) == {"math", "code", "gym"}
    assert [results["domains"][d]["prompts"] for d in ("math", "code", "gym")] == [3, 3, 2]
    assert results["prompts"] == 8 and results["taken_from_run"]["max_prompts"] == "eval.max_prompts"
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").open()]
    for name in ("math", "code", "gym"):
        rewards = [s["reward"] for s in samples if s["source"] == name]
        assert results[f"eval/{name}/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert 0.0 <= results[f"eval/{name}/pass_rate"] <= 1.0
    code_infos = [s["reward_info"] for s in samples if s["source"] == "code"]
    assert all("passed" in info for info in code_infos)  # scored by the code reward
    assert results["eval/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 8)
    assert "domains=['math', 'code', 'gym'] (data.domains)" in err

    results, _ = run_eval(capsys, "--model", checkpoint, "--threads", "1", "--out", str(out),
                          "--domain", "code", "--max-prompts", "1")
    assert list(results["domains"]) == ["code"] and results["prompts"] == 1
    results, _ = run_eval(capsys, "--model", checkpoint, "--threads", "1", "--out", str(out),
                          "--task", arithmetic["eval"], "--reward", "math", "--max-prompts", "2")
    assert results["task"] == arithmetic["eval"] and "domains" not in results
    assert results["prompts"] == 2 and results["max_new_tokens"] == 6  # still the run's

    for flags, named in ((["--domain", "cod"], "the run's domains with a held-out set are "
                                               "math, code, gym"),
                         (["--reward", "code"], "--reward: the model's run evaluates"),
                         (["--task", arithmetic["eval"]], "--task: the model's run has several "
                                                         "domains")):
        assert main(["eval", "--model", checkpoint, "--out", str(out), *flags]) == 2
        assert named in " ".join(capsys.readouterr().err.split())
    assert main(["eval", "--model", tiny_model, "--task", arithmetic["eval"], "--domain", "a",
                 "--out", str(out)]) == 2
    assert "--domain: only for a model of a multi-domain run" in capsys.readouterr().err


def preference_run(tmp_path, pipeline: str, pairs: list[dict], **extra) -> str:
    """A DPO, RM or distillation run's directory with an empty checkpoint folder."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs))
    run = tmp_path / pipeline
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    config = {"pipeline": pipeline, "model": {"path": "m"},
              "data": {"train": str(path), "eval": str(path), "max_tokens": 300,
                       "system_prompt": "Be brief."}} | extra
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return str(run / "checkpoints" / "step_2")


PAIR = {"prompt": "1+1?", "chosen": "\\boxed{2}", "rejected": "\\boxed{3}", "answer": "2"}


@pytest.mark.unit
@pytest.mark.parametrize("pipeline", ["dpo", "distill"])
def test_a_preference_or_distillation_runs_model_is_evaluated_on_its_held_out_prompts(
        tmp_path, pipeline):
    """`reroll eval` on a DPO run's checkpoint crashed (AttributeError: 'PreferenceData' object
    has no attribute 'max_prompt_tokens'); a distillation run's did too (SFTData)."""
    from reroll.evaluation_settings import run_settings

    row = PAIR if pipeline == "dpo" else {"prompt": "1+1?", "response": "2", "answer": "2"}
    extra = {"teacher": {"path": "t"}} if pipeline == "distill" else {}
    checkpoint = preference_run(tmp_path, pipeline, [row], **extra)
    _, settings = run_settings(checkpoint, {})
    assert settings == {"task": (str(tmp_path / "pairs.jsonl"), "data.eval"),
                        "system_prompt": ("Be brief.", "data.system_prompt"),
                        "max_prompt_tokens": (300, "data.max_tokens")}


@pytest.mark.unit
def test_held_out_pairs_without_answers_are_refused_naming_the_file(tmp_path, capsys):
    """Pairs without an `answer` give nothing to score samples against (every sample would
    count as a reward error): the command says so and asks for --task, exit 2."""
    checkpoint = preference_run(tmp_path, "dpo", [{k: v for k, v in PAIR.items()
                                                   if k != "answer"}])
    assert main(["eval", "--model", checkpoint, "--out", str(tmp_path / "r.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data.eval" in err and "pairs.jsonl" in err and "no `answer`" in err
    assert "--task" in err and "Traceback" not in err


@pytest.mark.unit
def test_a_reward_model_is_refused_by_eval_with_where_its_accuracy_is(tmp_path, capsys):
    """A `reroll rm` model scores responses; it does not generate (it crashed as a DPO run's
    model did, or with --ignore-run-config was sampled as a causal LM)."""
    checkpoint = preference_run(tmp_path, "rm", [PAIR])
    (Path(checkpoint) / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}))
    for flags in ([], ["--ignore-run-config", "--task", "arithmetic"]):
        assert main(["eval", "--model", checkpoint, "--out", str(tmp_path / "r.json"),
                     *flags]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "reward model" in err and "eval/accuracy" in err and "type: model" in err


def test_a_dpo_checkpoint_is_sampled_on_its_held_out_pairs_prompts(tmp_path, tiny_model, capsys):
    from reroll.data.preferences import write_arithmetic_preferences

    pairs = write_arithmetic_preferences(tmp_path / "pairs", train_size=8, eval_size=3, seed=0)
    checkpoint = fake_run(tmp_path, tiny_model, {
        "pipeline": "dpo", "model": {"path": tiny_model}, "steps": 2, "batch_size": 2,
        "train": {"micro_batch_size": 4},
        "data": {"train": str(pairs["train"]), "eval": str(pairs["eval"]), "max_tokens": 200}})
    results, err = run_eval(capsys, "--model", checkpoint, "--max-new-tokens", "4",
                            "--threads", "1", "--out", str(tmp_path / "res.json"))
    assert results["task"] == str(pairs["eval"]) and results["prompts"] == 3
    assert results["taken_from_run"] == {"task": "data.eval", "max_prompt_tokens": "data.max_tokens"}
    assert "task=" in err and "(data.eval)" in err

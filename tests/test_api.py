"""The Python API without a model run: configs from dicts, YAML and overrides; objects checked
at start with one clear message; what a run directory records of the objects; the weighted
reward of several functions (reroll/api.py, reroll/rewards/python.py)."""

import asyncio
import json
import threading
from pathlib import Path

import pytest
import yaml

import reroll
from reroll.api import _Objects, _prepare
from reroll.config.errors import ConfigError
from reroll.pipelines.inputs import InputFile, TaskInputs
from reroll.rewards import build_reward
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.python import object_name

pytestmark = pytest.mark.unit

ROWS = [{"prompt": "1+1?", "answer": "2", "level": 1}, {"prompt": "2+2?", "answer": "4", "level": 2}]


def base(tmp_path: Path, **extra) -> dict:
    return {"model": {"path": "tiny"}, "steps": 2, "output_dir": str(tmp_path / "run"),
            "data": {"train": "x.jsonl"}, **extra}


def contains_answer(sample) -> float:
    """A top-level function: importable by its recorded name, so a CLI resume rebuilds it."""
    return float(sample.answer in sample.response)


def test_make_config_applies_dotted_and_nested_overrides(tmp_path):
    config = reroll.make_config(base(tmp_path), overrides={"rollout.group_size": 4,
                                                           "optimizer": {"lr": 1e-4}})
    assert config.rollout.group_size == 4 and config.optimizer.lr == 1e-4
    assert config.pipeline == "rlvr" and config.steps == 2


def test_load_config_reads_yaml_with_either_kind_of_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base(tmp_path)))
    assert reroll.load_config(path, overrides={"train.micro_batch_size": 4}).train.micro_batch_size == 4
    assert reroll.load_config(path, overrides=["steps=7"]).steps == 7


def test_a_bad_override_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.group_size"):
        reroll.make_config(base(tmp_path), overrides={"rollout.group_size": 0})


@pytest.mark.parametrize("fn, match", [
    (lambda prompts, completions, **kw: [0.0], r"reward_funcs\[0\].*one argument, the sample.*TRL"),
    (lambda: 1.0, r"reward_funcs\[0\].*must take one argument"),
    ("contains_answer", r"reward_funcs\[0\]: 'contains_answer' is not callable"),
])
def test_a_reward_function_with_the_wrong_signature_is_refused(tmp_path, fn, match):
    with pytest.raises(ConfigError, match=match):
        reroll.train(base(tmp_path), reward_funcs=[fn])
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_a_reward_function_holding_a_lock_is_refused_unless_async(tmp_path):
    lock = threading.Lock()
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\].*cannot be sent to the reward "
                                          r"worker processes.*async def"):
        reroll.train(base(tmp_path), reward_funcs=[lambda s: float(lock.locked())])


def test_a_dataset_row_without_a_prompt_is_refused_naming_the_row(tmp_path):
    rows = [ROWS[0], {"question": "3+3?", "answer": "6"}]
    with pytest.raises(ConfigError, match=r"train_dataset\[1\]: needs a non-empty string "
                                          r"`prompt`.*found keys \['answer', 'question'\]"):
        reroll.train(base(tmp_path), reward_funcs=[contains_answer], train_dataset=rows)


@pytest.mark.parametrize("dataset, match", [([], "train_dataset is empty"),
                                            ({"prompt": ["a"]}, "train_dataset: a dict"),
                                            (3, "int is not a dataset")])
def test_what_is_not_a_dataset_is_refused(tmp_path, dataset, match):
    with pytest.raises(ConfigError, match=match):
        reroll.train(base(tmp_path), train_dataset=dataset)


def test_objects_a_pipeline_does_not_use_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="env: not used by a rlvr run"):
        reroll.train(base(tmp_path, pipeline="rlvr"), env=GuessEnv)
    agentic = {"model": {"path": "tiny"}, "steps": 1, "env": {"id": "guess_number"}}
    with pytest.raises(ConfigError, match="reward_funcs: not used by a agentic run"):
        reroll.train(agentic | {"pipeline": "agentic"}, reward_funcs=[contains_answer])
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2"):
        reroll.train(base(tmp_path), reward_funcs=[contains_answer, contains_answer],
                     reward_weights=[1.0])
    # issue 49: a NaN weight was taken, and the run stopped at step 1
    for bad in ([float("nan")], [float("inf")], ["2"]):
        with pytest.raises(ConfigError, match=r"reward_weights\[0\]: .* is not a finite number"):
            reroll.train(base(tmp_path), reward_funcs=[contains_answer], reward_weights=bad)


def test_objects_are_recorded_in_the_config_and_the_run_dir_inputs(tmp_path):
    datasets = pytest.importorskip("datasets")
    objects = _Objects(reward_funcs=[contains_answer, lambda s: 0.5], reward_weights=[1, 0.2],
                       train_dataset=datasets.Dataset.from_list(ROWS), eval_dataset=ROWS[:1])
    config, inputs = _prepare(base(tmp_path, reward={"type": "custom", "function": "m:f",
                                                     "timeout_s": 3.0}),
                              None, objects, ("rlvr", "agentic"))
    run = tmp_path / "run"
    assert config.reward.type == "python" and config.reward.timeout_s == 3.0
    assert config.reward.functions == [f"{__name__}:contains_answer",
                                       f"{__name__}:test_objects_are_recorded_in_the_config_and_"
                                       f"the_run_dir_inputs.<locals>.<lambda>"]
    assert config.reward.weights == [1.0, 0.2]
    assert config.data.train == str(run / "inputs" / "train.jsonl")
    assert config.data.eval == str(run / "inputs" / "eval.jsonl")
    inputs.write_files(run)
    saved = [json.loads(line) for line in (run / "inputs" / "train.jsonl").open()]
    assert saved == ROWS
    note = json.loads((run / "inputs" / "python_objects.json").read_text())
    assert [f["importable"] for f in note["reward_funcs"]] == [True, False]
    assert "resume such a run from Python" in note["note"]


def test_a_dataset_path_is_used_as_given(tmp_path):
    config, inputs = _prepare(base(tmp_path), None, _Objects(train_dataset="data/t.jsonl"),
                              ("rlvr", "agentic"))
    assert config.data.train == "data/t.jsonl" and inputs.files == ()


def test_resuming_with_other_objects_is_refused(tmp_path):
    TaskInputs(files=(InputFile("inputs/train.jsonl", "a\n", "train_dataset"),)).write_files(tmp_path)
    same = TaskInputs(files=(InputFile("inputs/train.jsonl", "a\n", "train_dataset"),))
    same.write_files(tmp_path)  # the same objects: fine
    other = TaskInputs(files=(InputFile("inputs/train.jsonl", "b\n", "train_dataset"),))
    with pytest.raises(ConfigError, match="train_dataset: differs from what the run"):
        other.write_files(tmp_path)


class GuessEnv:
    """A two-action environment: say `yes` to win."""

    def __init__(self, bonus: float = 1.0):
        self.bonus = bonus

    def reset(self, seed=None):
        return "Say yes.", {}

    def step(self, action):
        return "", self.bonus * float("yes" in action), True, False, {}


class NoStep:
    def reset(self, seed=None):
        return "", {}


def test_an_environment_is_checked_and_recorded(tmp_path):
    agentic = {"model": {"path": "tiny"}, "steps": 1, "output_dir": str(tmp_path / "run"),
               "env": {"kwargs": {"bonus": 2.0}}}
    config, inputs = _prepare(agentic, None, _Objects(env=GuessEnv), ("rlvr", "agentic"))
    assert config.pipeline == "agentic" and config.env.id == f"{__name__}:GuessEnv"
    env = inputs.env_factory()
    env.reset(0)
    assert env.step("yes")[1] == 2.0
    with pytest.raises(ConfigError, match=r"env: .*NoStep gives a NoStep, which lacks step"):
        _prepare(agentic | {"env": {}}, None, _Objects(env=NoStep), ("rlvr", "agentic"))
    with pytest.raises(ConfigError, match=r"GuessEnv\(\*\*env.kwargs\) failed"):
        _prepare(agentic | {"env": {"kwargs": {"nope": 1}}}, None, _Objects(env=GuessEnv),
                 ("rlvr", "agentic"))
    config, inputs = _prepare(agentic | {"env": {}}, None, _Objects(env=GuessEnv(3.0)),
                              ("rlvr", "agentic"))
    assert config.env.id == f"{__name__}:GuessEnv()"  # an instance: copied per episode
    assert inputs.env_factory().env is not inputs.env_factory().env


async def half(sample) -> RewardResult:
    return RewardResult(0.5, {"half": True})


def test_several_functions_are_summed_with_weights(tmp_path):
    config, inputs = _prepare(base(tmp_path), None,
                              _Objects(reward_funcs=[contains_answer, half, lambda s: 2.0],
                                       reward_weights=[1.0, 2.0, 0.25]), ("rlvr",))
    reward = inputs.reward_fn()
    try:
        result = asyncio.run(reward(RewardSample("1+1?", "it is 2", answer="2")))
    finally:
        reward.close()
    assert result.score == pytest.approx(1.0 + 2 * 0.5 + 0.25 * 2.0)
    assert result.info["half"] is True
    assert list(result.info["rewards"].values()) == [1.0, 0.5, 2.0]


def test_a_recorded_python_reward_rebuilds_importable_functions_only(tmp_path):
    config, _ = _prepare(base(tmp_path), None, _Objects(reward_funcs=[contains_answer]), ("rlvr",))
    reward = build_reward(config.reward)  # what `reroll train run/config.yaml` does
    try:
        assert asyncio.run(reward(RewardSample("q", "2", answer="2"))).score == 1.0
    finally:
        reward.close()
    config, _ = _prepare(base(tmp_path), None, _Objects(reward_funcs=[lambda s: 1.0]), ("rlvr",))
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]: .*<lambda> was passed as a "
                                          r"Python object to reroll.train"):
        build_reward(config.reward)


def test_object_names():
    assert object_name(contains_answer) == f"{__name__}:contains_answer"
    assert object_name(GuessEnv(1.0)) == f"{__name__}:GuessEnv()"


def test_the_cli_refuses_an_sft_config_for_train_as_before(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "sft", "model": {"path": "m"},
                                    "data": {"train": "t.jsonl"}}))
    from reroll.cli import main

    assert main(["train", str(path)]) == 2
    assert "pipeline is 'sft', but this command runs 'rlvr' configs" in capsys.readouterr().err

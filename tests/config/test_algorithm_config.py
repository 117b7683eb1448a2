"""The `algorithm:` section: every estimator, loss and option parses; typos list the valid names;
combinations that cannot work are errors naming the fields (at load time, or at pipeline start
for those that involve `rollout:`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reroll.config import ConfigError, load_config
from reroll.config.algorithm import ADVANTAGE_NAMES, AlgorithmConfig
from reroll.pipelines.advantages import ESTIMATORS

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"steps": 2, "model": {"path": "no/such/model"}, "data": {"train": "t.jsonl"}}
LOSSES = ["ppo", "gspo", "cispo", "topr", "reinforce", "decoupled_ppo", "ipa_chunk"]  # + custom


def load(tmp_path, algorithm: dict, **sections):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "algorithm": algorithm, **sections}))
    return load_config(path)


def error_of(tmp_path, algorithm: dict, **sections) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, algorithm, **sections)
    return str(info.value)


def test_the_estimator_names_are_the_catalogue_and_each_has_a_function():
    assert set(ADVANTAGE_NAMES) == {"grpo", "dr_grpo", "lite_ppo", "rloo", "reinforce_pp",
                                    "reinforce_pp_baseline", "gae", "rebn", "gigpo", "ipa_chunk",
                                    "custom"}
    # `custom` is the user's own function, resolved by its import path (pipelines/plugins.py)
    assert set(ESTIMATORS) | {"custom"} == set(ADVANTAGE_NAMES)


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_every_estimator_is_one_name_away(tmp_path, name):
    extra = {"critic": {}} if name == "gae" else {}
    function = {"function": "my_module:my_estimator"} if name == "custom" else {}
    config = load(tmp_path, {"advantage": {"name": name, **function}, **extra})
    assert config.algorithm.advantage.name == name


@pytest.mark.parametrize("name", LOSSES)
def test_every_policy_loss_is_one_name_away(tmp_path, name):
    config = load(tmp_path, {"policy_loss": {"name": name}})
    assert config.algorithm.policy_loss.name == name


def test_loss_agg_defaults_to_the_method_choice():
    assert AlgorithmConfig().loss_agg == "token_mean"
    assert AlgorithmConfig(policy_loss={"name": "gspo"}).loss_agg == "seq_mean_token_mean"
    assert AlgorithmConfig(advantage={"name": "dr_grpo"}).loss_agg == "seq_mean_token_sum_norm"
    assert AlgorithmConfig(advantage={"name": "dr_grpo"}, loss_agg="token_mean").loss_agg == \
        "token_mean"


def test_full_section_parses(tmp_path):
    algorithm = {
        "advantage": {"name": "gae", "gamma": 0.99, "lam": 0.9},
        "policy_loss": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
        "loss_agg": "token_mean",
        "kl": {"coef": 0.01, "estimator": "k1", "mode": "reward",
               "controller": {"name": "adaptive", "target": 0.05, "horizon": 5000}},
        "entropy_coef": 0.001,
        "normalize": {"reward_clip": [-1, 1], "whiten_advantages": True, "advantage_clip": 5},
        "dynamic_sampling": {"drop_all_equal": True, "min_mean": 0.05, "max_std": 1.0},
        "overlong": {"filter": True, "soft_penalty_cache": 16, "soft_penalty": 0.5},
        "correction": {"tis": {"level": "sequence", "cap": 1.2},
                       "ratio_mask": {"level": "token", "low": 0.5, "high": 5}},
        "critic": {"num_critics": 2, "lr": 1e-5, "warmup_steps": 3, "value_clip": None,
                   "asyppo": {"advantage_mask_quantile": 0.1}},
    }
    a = load(tmp_path, algorithm).algorithm
    assert a.kl.controller.name == "adaptive" and a.kl.controller.target == 0.05
    assert a.normalize.reward_clip == (-1.0, 1.0) and a.correction.tis.cap == 1.2
    assert a.critic.num_critics == 2 and a.critic.value_clip is None


@pytest.mark.parametrize(("override", "field", "valid"), [
    ("algorithm.advantage.name=grop", "algorithm.advantage.name", "dr_grpo"),
    ("algorithm.policy_loss.name=gsp", "algorithm.policy_loss.name", "cispo"),
    ("algorithm.kl.controller.name=adaptiv", "algorithm.kl.controller.name", "adaptive"),
])
def test_a_typo_in_a_name_lists_the_valid_names(tmp_path, override, field, valid):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    message = str(info.value)
    assert field in message and valid in message and "unknown choice" in message


def test_a_knob_of_another_method_is_an_unknown_key(tmp_path):
    message = error_of(tmp_path, {"advantage": {"name": "rloo", "lam": 0.9}})
    # named as the user writes it (the chosen method is the `name` beside it)
    assert "algorithm.advantage.lam: unknown key" in message
    assert "are name (docs/config.md#algorithmadvantage-rlooadvantage)" in message  # rloo's


@pytest.mark.parametrize(("algorithm", "fields"), [
    ({"advantage": {"name": "gae"}}, ["algorithm.advantage gae", "algorithm.critic"]),
    ({"critic": {}}, ["algorithm.critic", "algorithm.advantage gae"]),
    ({"policy_loss": {"name": "gspo"}, "loss_agg": "token_mean"},
     ["algorithm.policy_loss gspo", "algorithm.loss_agg=token_mean"]),
    ({"policy_loss": {"name": "ipa_chunk"}, "loss_agg": "seq_mean_token_mean"},
     ["algorithm.policy_loss ipa_chunk", "algorithm.loss_agg"]),
    ({"policy_loss": {"name": "decoupled_ppo"}, "correction": {"tis": {}}},
     ["algorithm.policy_loss decoupled_ppo", "algorithm.correction.tis"]),
    ({"kl": {"controller": {"name": "adaptive"}}},
     ["algorithm.kl.controller adaptive", "algorithm.kl.coef"]),
    ({"correction": {"ratio_mask": {"low": 2.0, "high": 1.5}}},
     ["algorithm.correction.ratio_mask"]),
    ({"normalize": {"reward_clip": [1, 0]}}, ["algorithm.normalize.reward_clip"]),
])
def test_incompatible_combinations_name_the_fields(tmp_path, algorithm, fields):
    message = error_of(tmp_path, algorithm)
    for field in fields:
        assert field in message, message


@pytest.mark.parametrize(("value", "field"), [
    ("algorithm.policy_loss.dual_clip=0.5", "algorithm.policy_loss.dual_clip: "),
    ("algorithm.critic.num_critics=0", "algorithm.critic.num_critics"),
    ("algorithm.advantage.gamma=1.5", "algorithm.advantage"),
    ("algorithm.correction.tis.cap=-1", "algorithm.correction.tis.cap"),
])
def test_out_of_bounds_values(tmp_path, value, field):
    data = {**MINIMAL, "algorithm": {"advantage": {"name": "gae"}, "critic": {}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path, [value])
    assert field in str(info.value)


@pytest.mark.parametrize(("algorithm", "rollout", "fields"), [
    ({"advantage": {"name": "rloo"}}, {"group_size": 1},
     ["algorithm.advantage rloo", "rollout.group_size"]),
    ({"advantage": {"name": "gigpo"}}, {"group_size": 1}, ["rollout.group_size"]),
    ({"advantage": {"name": "gae"}, "critic": {"num_critics": 4}}, {"group_size": 2},
     ["algorithm.critic.num_critics", "rollout.group_size"]),
    ({"overlong": {"soft_penalty_cache": 100}}, {"max_new_tokens": 64},
     ["algorithm.overlong.soft_penalty_cache", "rollout.max_new_tokens"]),
])
def test_combinations_with_rollout_are_errors_at_load_time(tmp_path, algorithm, rollout, fields):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, algorithm, rollout=rollout, train={"micro_batch_size": 1})
    for field in fields:
        assert field in str(info.value)


def test_estimators_without_a_group_baseline_accept_groups_of_one():
    for name in ("reinforce_pp", "rebn", "ipa_chunk"):
        assert AlgorithmConfig(advantage={"name": name}).rollout_errors(1, 64) == []
    assert AlgorithmConfig(advantage={"name": "grpo", "mean": "batch", "std": "batch"}
                           ).rollout_errors(1, 64) == []


def test_every_recipe_parses_and_names_its_method():
    recipes = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
    assert {p.stem for p in recipes} >= {"ppo", "grpo", "dr_grpo", "dapo", "lite_ppo", "rloo",
                                         "reinforce_pp", "gspo", "cispo", "topr", "asyppo"}
    for path in recipes:
        assert path.read_text().startswith("# "), path
        config = load_config(path)
        assert config.algorithm.rollout_errors(config.rollout.group_size,
                                               config.rollout.max_new_tokens) == []


def test_cli_reports_an_algorithm_error_with_exit_2(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "algorithm": {"advantage": {"name": "gae"}}}))
    result = subprocess.run([sys.executable, "-m", "reroll.cli", "train", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "algorithm.critic" in result.stderr and "Traceback" not in result.stderr


def test_every_algorithm_snippet_in_the_docs_parses():
    text = (ROOT / "docs" / "algorithms.md").read_text()
    snippets = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert len(snippets) >= 12
    for snippet in snippets:
        AlgorithmConfig.model_validate(yaml.safe_load(snippet)["algorithm"])


TEACHER = {"teacher": {"path": "no/such/teacher"}}


def test_dense_distillation_parses_with_the_offline_names():
    a = AlgorithmConfig(distill=TEACHER | {"mode": "dense", "divergence": "jsd", "beta": 0.3,
                                           "top_k": 16})
    assert a.distill.dense and (a.distill.divergence, a.distill.beta, a.distill.top_k) == \
        ("jsd", 0.3, 16)
    defaults = AlgorithmConfig(distill=TEACHER | {"mode": "dense"}).distill
    assert (defaults.divergence, defaults.top_k) == ("forward_kl", 32)  # as `reroll distill`'s


@pytest.mark.parametrize("distill, sections, message", [
    ({"mode": "pure", "top_k": 8}, {}, "distill.top_k is used by mode: dense only"),
    ({"mode": "mixed", "divergence": "jsd"}, {}, "distill.divergence is used by mode: dense"),
    ({"mode": "dense", "baseline": "mean"}, {}, "distill.baseline is used by mode: pure/mixed"),
    ({"mode": "dense", "coef": 0.5}, {}, "distill.coef is used by mode: pure/mixed"),
    ({"mode": "dense", "beta": 0.2}, {}, "beta is used by divergence: jsd only"),
    ({"mode": "dense", "top_k": 0}, {}, "top_k"),
    ({"mode": "dense", "divergence": "kl"}, {}, "forward_kl"),
    ({"mode": "pure", "task_coef": 0.5}, {}, "distill.task_coef is used by mode: dense only"),
    ({"mode": "mixed", "task_coef": 0.5}, {}, "distill.task_coef is used by mode: dense only"),
    ({"mode": "dense", "task_coef": -1}, {}, "task_coef"),
    ({"mode": "dense"}, {"entropy_coef": 0.01}, "entropy_coef > 0 would have no effect"),
    ({"mode": "dense"}, {"kl": {"coef": 0.1, "mode": "reward"}}, "kl.mode reward"),
    ({"mode": "gkd"}, {}, "dense"),
])
def test_bad_dense_distillation_settings_name_the_field(tmp_path, distill, sections, message):
    assert message in error_of(tmp_path, {"distill": TEACHER | distill, **sections})


def test_dense_distillation_needs_no_group(tmp_path):
    """`mode: dense` trains on no advantage, so one sample a prompt is fine (GKD samples one);
    the one-sample advantage modes keep GRPO's group requirement."""
    dense = load(tmp_path, {"distill": TEACHER | {"mode": "dense"}}, rollout={"group_size": 1})
    assert dense.rollout.group_size == 1
    assert "needs rollout.group_size >= 2" in error_of(
        tmp_path, {"distill": TEACHER | {"mode": "pure"}}, rollout={"group_size": 1})


def test_dense_distillation_with_the_task_loss_needs_a_group(tmp_path):
    """`task_coef` > 0 adds the task's policy loss, so its advantage is estimated again and the
    estimator's group rule is back; a group-free estimator (REINFORCE++) still takes one."""
    with_task = TEACHER | {"mode": "dense", "task_coef": 0.5}
    assert "needs rollout.group_size >= 2" in error_of(
        tmp_path, {"distill": with_task}, rollout={"group_size": 1})
    config = load(tmp_path, {"distill": with_task})
    assert config.algorithm.distill.with_task and config.algorithm.distill.task_coef == 0.5
    assert not AlgorithmConfig(distill=TEACHER | {"mode": "dense"}).distill.with_task
    single = load(tmp_path, {"distill": with_task, "advantage": {"name": "reinforce_pp"}},
                  rollout={"group_size": 1})
    assert single.rollout.group_size == 1

"""`envs:` in an agentic config: validated (one of env/envs/agent, unique names, the entry of a
bad id named, exit 2), and each step's groups drawn across the environments by weight,
deterministically, the shares following the weights (fixed, or by success rate)."""

import pytest
import yaml

from reroll.cli import main
from reroll.config import load_config
from reroll.config.agentic import AgenticConfig
from reroll.config.errors import ConfigError
from reroll.pipelines.envmix import entry_message, env_mixer
from reroll.viewer.charts import plan_charts

pytestmark = pytest.mark.unit

BASE = {"pipeline": "agentic", "steps": 1, "model": {"path": "m"},
        "rollout": {"prompts_per_step": 3, "group_size": 2}, "train": {"micro_batch_size": 6}}
TWO = [{"name": "guess", "id": "guess_number", "weight": 2},
       {"name": "lake", "id": "frozen_lake", "max_turns": 4}]


def error_of(tmp_path, data) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_env_and_envs_together_are_refused_naming_both(tmp_path, capsys):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(BASE | {"env": {"id": "guess_number"}, "envs": TWO}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "exactly one of `env:`" in err and "this config gives env and envs" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("envs, expected", [
    ([], "envs is empty"),
    ([TWO[0], TWO[0]], "the names guess are used more than once"),
    ([TWO[0] | {"name": "a/b"}], "envs.0.name"),
    ([TWO[0] | {"weight": 0}], "envs.0.weight"),
    ([TWO[0] | {"kwargs": {"max_turns": 3}}], "move the value there"),
])
def test_bad_envs_are_named(tmp_path, envs, expected):
    assert expected in error_of(tmp_path, BASE | {"envs": envs})


def test_a_learned_reward_with_several_envs_is_refused_with_the_reason(tmp_path):
    reward = {"type": "judge", "model": "m", "template": "{question} {response}"}
    message = error_of(tmp_path, BASE | {"envs": TWO, "reward": reward})
    assert "`reward:` (a learned reward of episodes) is not available with several `envs`" \
        in message


def test_a_bad_env_id_names_its_entry_and_exits_2(tmp_path, tiny_model, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(BASE | {
        "model": {"path": tiny_model}, "output_dir": str(tmp_path / "run"),
        "envs": [TWO[0], {"name": "lake", "id": "nope"}]}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "envs[1].id (lake): unknown environment 'nope'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run starts


def test_entry_message_names_the_list_entry():
    assert entry_message("env.kwargs: bad", 1, "x") == "envs[1].kwargs (x): bad"
    assert entry_message("something else", 0, "x") == "envs[0] (x): something else"


def test_one_env_is_a_one_element_list():
    config = AgenticConfig(**BASE | {"env": {"id": "gem:game:GuessTheNumber-v0"}})
    [(name, env)] = config.env_list()
    assert env is config.env and name == "GuessTheNumber-v0"
    assert AgenticConfig(**BASE | {"envs": TWO}).env_list()[1][0] == "lake"


def counts(config: AgenticConfig, steps: int, n: int = 3, success=None) -> list[list[int]]:
    mixer, out = env_mixer(config), []
    for _ in range(steps):
        out.append(mixer.counts(n))
        for k, s in enumerate(success or []):
            mixer.observe(k, s)
    return out


def test_the_draw_is_deterministic_and_follows_the_weights():
    config = AgenticConfig(**BASE | {"envs": [TWO[0], TWO[1] | {"weight": 1}]})
    drawn = counts(config, 6, n=4)
    assert drawn == counts(config, 6, n=4)  # the same draw in every run
    assert all(sum(step) == 4 for step in drawn)
    assert [sum(c[k] for c in drawn) for k in range(2)] == [16, 8]  # 2:1 exactly over 3 steps
    assert drawn[:3] == [[3, 1], [2, 2], [3, 1]]  # the rounding is carried, not lost


def test_success_rate_reweighting_gives_the_unsolved_env_more_groups():
    fixed = AgenticConfig(**BASE | {"envs": [TWO[0] | {"weight": 1}, TWO[1]]})
    adaptive = fixed.model_copy(update={"env_mix": fixed.env_mix.model_copy(
        update={"reweight": "success_rate"})})
    assert sum(c[1] for c in counts(fixed, 10, success=[1.0, 0.0])) == 15
    drawn = counts(adaptive, 10, success=[1.0, 0.0])
    assert sum(c[1] for c in drawn[3:]) > 0.8 * 3 * 7  # the solved env drops to its floor


def test_a_multi_env_run_gets_charts_with_a_curve_per_env():
    keys = ["train/reward_mean", "eval/reward_mean"]
    for e in ("guess", "lake"):
        keys += [f"train/{e}/reward_mean", f"train/{e}/success_rate", f"eval/{e}/success_rate",
                 f"train/{e}/share", f"train/{e}/turns_mean"]
    charts = {c.id: c for c in plan_charts(keys)}
    assert charts["env-success"].keys == ["train/guess/success_rate", "train/lake/success_rate",
                                          "eval/guess/success_rate", "eval/lake/success_rate"]
    assert charts["env-share"].keys == ["train/guess/share", "train/lake/share"]
    assert not any(c.id.startswith("domain-") or c.extra for c in charts.values())

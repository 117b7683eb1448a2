"""docs/config.md says what each key does for every pipeline, the turn limit lives in one
place, and config errors point at the override or the docs section that is wrong."""

import re
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.config import load_config
from reroll.config.errors import ConfigError
from reroll.config.reference import _slug, render_markdown

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "arithmetic" / "grpo.yaml"
AGENTIC = ROOT / "examples" / "agentic" / "demo.yaml"


def row(markdown: str, part: str, key: str) -> str:
    section = markdown.split(f"## {part}")[1].split("\n## ")[0]
    return next(line for line in section.splitlines() if line.startswith(f"| `{key}` |"))


def test_the_reward_row_names_every_reward_type():
    reward = row(render_markdown(), "`reroll train` (RLVR)", "reward")
    assert all(t in reward for t in ("`math`", "`code`", "`custom`", "docs/rewards.md"))


def test_the_agentic_eval_rows_do_not_send_the_user_to_data_eval():
    agentic = render_markdown().split("## `reroll train` with `pipeline: agentic`")[1]
    assert "env.eval_episodes" in row(render_markdown(), "`reroll train` with `pipeline: agentic`",
                                      "eval")
    every = next(line for line in agentic.splitlines() if line.startswith("| `eval.every_steps`"))
    assert "data.eval" not in every.split("RLVR runs without")[0]


def test_the_turn_limit_is_one_key():
    with pytest.raises(ConfigError) as error:
        load_config(AGENTIC, ["env.kwargs.max_turns=3"])
    assert "move the value there" in str(error.value) and "env.max_turns" in str(error.value)


def test_env_max_turns_reaches_the_environment():
    from reroll.envs.registry import env_arguments, make_env

    kwargs = env_arguments("guess_number", {"high": 8}, 3)
    assert kwargs == {"high": 8, "max_turns": 3}
    env = make_env("guess_number", **kwargs)
    env.reset(seed=0)
    ends = [env.step("0")[3] for _ in range(3)]  # "0" is never right: only the limit ends it
    assert ends == [False, False, True]


def test_an_invalid_override_is_reported_as_the_override(capsys):
    assert main(["train", str(GRPO), "rollout.group_size=abc"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "invalid command-line override" in err
    assert "override 'rollout.group_size=abc': rollout.group_size:" in err
    assert "invalid config (" not in err


def test_an_unknown_key_points_at_its_docs_section(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GRPO.read_text().replace("  group_size: 8", "  groupsize: 8"))
    assert main(["train", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"invalid config ({bad})" in err and "schema.py" not in err
    assert "the keys of `rollout` are engine," in err and "group_size" in err
    anchor = re.search(r"docs/config\.md#([\w-]+)", err).group(1)
    headings = [line for line in (ROOT / "docs" / "config.md").read_text().splitlines()
                if line.startswith("#")]
    assert anchor in {_slug(h) for h in headings}

"""Agentic configs take RLVR's scheduling sections (one RL run config): async training is on
with its defaults, and what cannot work with environments yet is refused at load, naming the
field (exit 2)."""

import pytest
import yaml

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.config.loading import load_config

AGENTIC = {"pipeline": "agentic", "steps": 2, "model": {"path": "m"},
           "env": {"id": "guess_number"}}


def load(tmp_path, overrides=(), data=AGENTIC):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, list(overrides))


pytestmark = pytest.mark.unit


def test_agentic_async_defaults_match_rlvr_and_turn_on_the_correction(tmp_path):
    config = load(tmp_path, ["async_training.enabled=true"])
    a = config.async_training
    assert (a.max_staleness, a.max_ahead, a.order, a.partial_rollout) == (1, None, "finish", True)
    assert a.restart_stale_episodes
    # off-policy correction on by default, as in RLVR: token TIS, cap 2
    assert config.algorithm.correction.tis is not None
    assert (config.algorithm.correction.tis.level, config.algorithm.correction.tis.cap) == \
        ("token", 2.0)
    assert load(tmp_path).algorithm.correction.tis is None  # sync, hf engine: on-policy


@pytest.mark.parametrize(("overrides", "named"), [
    (["tail_batching.enabled=true"], "tail_batching.enabled: not available in agentic runs"),
    (["scheduler.oversample=2"], "scheduler.oversample (2.0)"),
    (["scheduler.max_running_per_engine=4"], "scheduler.max_running_per_engine"),
    (["async_training.enabled=true", "async_training.max_ahead=3"],
     "async_training.max_ahead (3) must be at most async_training.max_staleness (1)"),
])
def test_combinations_that_cannot_work_are_refused_naming_the_field(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match="invalid config") as e:
        load(tmp_path, overrides)
    assert named in str(e.value)
    assert "length_budget" not in str(e.value)  # one reason, not tail batching's own checks


def test_async_with_an_agent_program_is_accepted(tmp_path):
    """It was refused ("its sessions are not versioned across weight updates") until the
    gateway's calls ran through the async producer (`reroll.rollout.async_agents`); the
    end-to-end runs are in tests/rollout/test_async_gateway_e2e.py."""
    agent = {k: v for k, v in AGENTIC.items() if k != "env"} | {
        "agent": {"entrypoint": "m:f", "tasks": "t.jsonl"}}
    config = load(tmp_path, ["async_training.enabled=true"], agent)
    assert config.async_training.enabled and config.agent is not None
    assert config.algorithm.correction.tis is not None  # off-policy correction on, as for env:


def test_the_cli_exits_2_with_one_line_naming_the_field(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(AGENTIC | {"tail_batching": {"enabled": True}}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tail_batching.enabled" in err and "Traceback" not in err

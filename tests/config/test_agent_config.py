"""`agent:` in an agentic config: exactly one of an entrypoint and a command, exactly one of
`env:` and `agent:`, and a bad entrypoint, task file or verifier named at start."""

import pytest
import yaml

from reroll.config import load_config
from reroll.config.errors import ConfigError

pytestmark = pytest.mark.unit

BASE = {"pipeline": "agentic", "steps": 1, "model": {"path": "m"}}


def error_of(tmp_path, data) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize("agent, expected", [
    ({"tasks": "t.jsonl"}, "exactly one of agent.entrypoint"),
    ({"tasks": "t.jsonl", "entrypoint": "m:f", "command": ["x"]}, "exactly one of agent.entrypoint"),
    ({"tasks": "t.jsonl", "command": []}, "agent.command is empty"),
    ({"entrypoint": "m:f"}, "agent.tasks"),
])
def test_an_agent_names_one_program_and_its_tasks(tmp_path, agent, expected):
    assert expected in error_of(tmp_path, BASE | {"agent": agent})


def test_an_agentic_run_has_an_env_or_an_agent(tmp_path):
    assert "exactly one of `env:`" in error_of(tmp_path, BASE)
    both = BASE | {"env": {"id": "guess_number"},
                   "agent": {"tasks": "t.jsonl", "entrypoint": "m:f"}}
    assert "exactly one of `env:`" in error_of(tmp_path, both)


def test_bad_entrypoint_and_tasks_are_named_at_start(tmp_path, monkeypatch):
    from reroll.config.agentic import AgenticConfig
    from reroll.pipelines.agents import AgentTask

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "hi"}\n')
    config = AgenticConfig.model_validate(BASE | {"agent": {"tasks": "tasks.jsonl",
                                                            "entrypoint": "nowhere:solve"}})
    with pytest.raises(ConfigError, match="agent.entrypoint 'nowhere:solve' cannot be imported"):
        AgentTask(config, None)
    (tmp_path / "agent_mod.py").write_text("def solve(task, base_url, api_key):\n    return 1\n")
    config = AgenticConfig.model_validate(BASE | {"agent": {"tasks": "missing.jsonl",
                                                            "entrypoint": "agent_mod:solve"}})
    with pytest.raises(ConfigError, match="agent.tasks: no such file missing.jsonl"):
        AgentTask(config, None)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{oops\n')
    config = AgenticConfig.model_validate(BASE | {"agent": {"tasks": "bad.jsonl",
                                                            "entrypoint": "agent_mod:solve"}})
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        AgentTask(config, None)

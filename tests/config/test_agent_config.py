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


def test_an_agent_task_with_held_out_tasks_is_a_whole_task(tmp_path, monkeypatch):
    """An agent run with `agent.eval_tasks` says what it evaluates (`eval_what`, read by the
    RL step at start: without it such a run died with an AttributeError), and AgentTask has
    every member of the task protocol."""
    from reroll.config.agentic import AgenticConfig
    from reroll.pipelines.agents import AgentTask
    from reroll.pipelines.task import Task

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "held.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (tmp_path / "agent_mod.py").write_text("def solve(task, base_url, api_key):\n    return 1\n")
    config = AgenticConfig.model_validate(BASE | {
        "agent": {"tasks": "tasks.jsonl", "eval_tasks": "held.jsonl", "max_context_tokens": 64,
                  "entrypoint": "agent_mod:solve"},
        "eval": {"samples_per_prompt": 2}})
    task = AgentTask(config, None)
    assert task.evaluates and task.eval_what == "2 held-out tasks x 2 samples"
    members = {name for name in dir(Task) if not name.startswith("_")} | set(Task.__annotations__)
    missing = {name for name in members if not hasattr(task, name)}
    assert not missing, missing

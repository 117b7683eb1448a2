"""A user's environment by import path (`env.id: module:Class`, `path/to/file.py:Class`): it is
built with the config's kwargs and checked against the Env protocol, and every mistake is one
ConfigError naming it (exit 2 from the CLI, no traceback). `reroll envs` shows kwargs and docs."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import uuid

import pytest

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.envs import EnvError, make_env
from reroll.envs.base import checked_reset, checked_step, reset_async, step_async
from reroll.envs.describe import docstring_params, env_report, kwarg_docs
from reroll.envs.episodes import expert_rows

GOOD = '''
import random


class Coin:
    """Call a coin flip: heads or tails.

    Args:
        bias: chance of heads.
        rounds: flips per episode.
    """

    def __init__(self, bias: float = 0.5, rounds: int = 1):
        if not 0 <= bias <= 1:
            raise ValueError(f"bias must be in [0, 1], not {bias}")
        self.bias, self.rounds = bias, rounds

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        return "heads or tails?", {}

    def step(self, action):
        side = "heads" if self.rng.random() < self.bias else "tails"
        win = action.strip() == side
        return side, float(win), True, False, {"success": win}

    def expert_action(self):
        return "heads" if self.bias >= 0.5 else "tails"


def make_coin(bias: float = 0.5):
    """A factory function works as well as a class."""
    return Coin(bias)


def make_nothing():
    pass


class NoStep:
    def reset(self, seed=None):
        return "", {}


class OddSignatures:
    def reset(self):
        return "", {}

    def step(self, action, extra):
        return "", 0.0, True, False, {}

    def astep(self, action):
        return "", 0.0, True, False, {}


class NeedsSize:
    def __init__(self, size):
        self.size = size

    def reset(self, seed=None):
        return "x" * self.size, {}

    def step(self, action):
        return "", 0.0, True, False, {}


class Crashes:
    def __init__(self):
        self.table = {}["missing"]


class OldGym:
    def reset(self, seed=None):
        return "just an observation"

    def step(self, action):
        return "obs", 1.0, True, {}


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh module named `user_envs_<random>` in a fresh working directory; sys.path and
    sys.modules are restored afterwards."""
    name = f"user_envs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def error_of(env_id: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as raised:
        make_env(env_id, **kwargs)
    return str(raised.value)


def test_a_class_from_the_working_directory_is_built_with_the_kwargs(user_module):
    env = make_env(f"{user_module}:Coin", bias=1.0)
    assert env.reset(0) == ("heads or tails?", {})
    obs, reward, terminated, _, info = env.step("heads")
    assert (obs, reward, terminated, info["success"]) == ("heads", 1.0, True, True)
    assert info["episode"]["return"] == 1.0  # wrapped in EpisodeStats like built-in envs


def test_a_factory_function_and_a_file_path_work_too(user_module, tmp_path):
    assert make_env(f"{user_module}:make_coin", bias=0.0).env.bias == 0.0
    env = make_env(f"{tmp_path / user_module}.py:Coin", bias=0.0)
    env.reset(1)
    assert env.step("tails")[1] == 1.0
    relative = make_env(f"./{user_module}.py:Coin")  # relative to the working directory
    assert type(relative.env).__name__ == "Coin"


def test_an_installed_package_works_without_the_working_directory():
    env = make_env("reroll.envs.guess_number:GuessNumberEnv", high=4)
    assert env.reset(0)[0].startswith("Guess my number between 1 and 4")


def test_malformed_id_says_the_two_forms(user_module):
    assert "module:Class" in error_of(f"{user_module}:")
    assert "path/to/file.py:Class" in error_of(f"{user_module}:not-a-name")


def test_unknown_plain_id_mentions_user_envs():
    message = error_of("my_env")
    assert "unknown environment 'my_env'" in message and "module:Class" in message


def test_missing_module_names_the_module_and_where_it_looked(user_module, tmp_path):
    message = error_of("no_such_module_xyz:Env")
    assert "no module named 'no_such_module_xyz'" in message and str(tmp_path) in message


def test_a_module_whose_own_import_fails_names_its_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "broken_import_env.py").write_text("import os\nimport not_installed_dep\n")
    (tmp_path / "broken_syntax_env.py").write_text("class Env:\n    def reset(self\n")
    try:
        message = error_of("broken_import_env:Env")
        assert "broken_import_env.py:2" in message and "not_installed_dep" in message
        message = error_of("broken_syntax_env:Env")
        assert "broken_syntax_env.py:2" in message and "SyntaxError" in message
    finally:
        sys.modules.pop("broken_import_env", None)


def test_missing_file_is_named(tmp_path):
    assert "no file nowhere/envs.py" in error_of("nowhere/envs.py:Env")
    assert "a file is named path/to/file.py:Class" in error_of("nowhere/envs:Env")


def test_missing_attribute_lists_what_the_module_defines(user_module):
    message = error_of(f"{user_module}:Coins")
    assert "has no attribute 'Coins'" in message and "Coin, Crashes" in message


def test_not_callable_says_what_it_is(user_module):
    assert "NOT_CALLABLE is a int, not a class or a function" in error_of(
        f"{user_module}:NOT_CALLABLE")


def test_unknown_kwarg_names_it_and_lists_what_the_env_takes(user_module):
    message = error_of(f"{user_module}:Coin", bias=0.5, size=3)
    assert message == (f"env.kwargs: {user_module}:Coin does not take 'size' "
                       f"(it takes: bias=0.5, rounds=1)")


def test_missing_required_kwarg_names_the_field_to_set(user_module):
    message = error_of(f"{user_module}:NeedsSize")
    assert "needs 'size' (no default; set env.kwargs.size)" in message


def test_the_envs_own_value_check_is_a_config_error(user_module):
    assert error_of(f"{user_module}:Coin", bias=2) == \
        f"env.kwargs: {user_module}:Coin: bias must be in [0, 1], not 2"


def test_a_crashing_constructor_names_the_error_and_the_line(user_module, tmp_path):
    message = error_of(f"{user_module}:Crashes")
    assert "raised KeyError: 'missing'" in message and f"{user_module}.py:" in message


def test_an_object_without_step_is_refused_naming_the_missing_method(user_module):
    message = error_of(f"{user_module}:NoStep")
    assert "what it builds (NoStep) is not an environment" in message
    assert "it has no step(action) -> (observation, reward, terminated, truncated, info)" \
        in message and "docs/agentic.md" in message


def test_a_factory_returning_none_is_refused(user_module):
    assert "it returned None" in error_of(f"{user_module}:make_nothing")


def test_wrong_signatures_and_a_sync_astep_are_each_named(user_module):
    message = error_of(f"{user_module}:OddSignatures")
    assert "its reset cannot be called as reset(seed)" in message
    assert "its step cannot be called as step(action)" in message
    assert "its astep is not an `async def`" in message


def test_wrong_return_shapes_fail_the_episode_with_a_clear_env_error(user_module):
    env = make_env(f"{user_module}:OldGym")
    with pytest.raises(EnvError, match=r"reset must return \(observation: str, info: dict\), "
                                        r"not a str"):
        asyncio.run(reset_async(env, 0))
    with pytest.raises(EnvError, match=r"step must return \(observation, reward, terminated, "
                                        r"truncated, info\), not a tuple of 4"):
        asyncio.run(step_async(env, "x"))
    with pytest.raises(EnvError, match="reward that is not a number: 'high'"):
        checked_step(("obs", "high", True, False, {}))
    assert checked_reset(("obs", None)) == ("obs", {})


def test_cli_errors_exit_2_without_a_traceback(user_module, capsys):
    assert main(["envs", "--describe", f"{user_module}:Coins"]) == 2
    assert main(["envs", "--describe", f"{user_module}:OldGym"]) == 2
    assert main(["make-episodes", "--env", f"{user_module}:NoStep", "--out", "x.jsonl"]) == 2
    assert main(["envs", "--describe", f"{user_module}:Coin", "--kwargs", "[1]"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 4
    assert "reset must return (observation: str, info: dict), not a str" in " ".join(err.split())


def test_describe_builds_resets_and_lists_kwargs_with_docs(user_module, capsys):
    report = env_report(f"{user_module}:Coin", {"bias": 0.9})
    assert report["observation"] == "heads or tails?" and report["expert"]
    assert [(k.name, k.default, k.type, k.doc) for k in report["kwargs"]] == [
        ("bias", "0.5", "float", "chance of heads."), ("rounds", "1", "int", "flips per episode.")]
    assert main(["envs", "--describe", f"{user_module}:Coin"]) == 0
    out = capsys.readouterr().out
    assert f"{user_module}:Coin: Call a coin flip: heads or tails." in out
    assert "chance of heads." in out and "reset(0) ok" in out


def test_make_episodes_plays_a_user_envs_expert(user_module):
    rows = expert_rows(f"{user_module}:Coin", 3, kwargs={"bias": 1.0})
    assert [row["messages"][-1]["content"] for row in rows] == ["heads"] * 3


def test_envs_lists_every_builtin_kwarg_with_its_default_and_doc(capsys, monkeypatch):
    from reroll.envs.registry import env_specs

    monkeypatch.setenv("COLUMNS", "300")  # a row per kwarg, unwrapped
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "module:Class" in out and "--describe" in out
    for spec in env_specs().values():
        for kwarg in kwarg_docs(spec.factory):
            assert kwarg.doc, (spec.id, kwarg.name)  # every built-in kwarg is documented
            assert f"{kwarg.name}={kwarg.default}: {kwarg.doc}" in out, (spec.id, kwarg.name)


def test_kwarg_docs_from_dataclass_and_pydantic_fields():
    from dataclasses import dataclass

    from pydantic import BaseModel, Field

    @dataclass
    class Grid:
        size: int = 4
        """side of the grid."""
        walls: bool = False

    class Maze(BaseModel):
        depth: int = Field(3, description="how deep the maze goes")

    assert [(k.name, k.default, k.doc) for k in kwarg_docs(Grid)] == [
        ("size", "4", "side of the grid."), ("walls", "False", "")]
    assert [(k.name, k.doc) for k in kwarg_docs(Maze)] == [("depth", "how deep the maze goes")]


def test_docstring_params_reads_google_numpy_and_sphinx_forms():
    google = textwrap.dedent("""\
        Summary.

        Args:
            size (int): side of the grid,
                walls included.
            seed: randomness.

        Returns:
            nothing.
        """)
    numpy = textwrap.dedent("""\
        Summary.

        Parameters
        ----------
        size : int
            side of the grid.
        seed
            randomness.

        Returns
        -------
        None
        """)
    sphinx = ":param size: side of the grid.\n:param int seed: randomness.\n"
    expected = {"size": "side of the grid, walls included.", "seed": "randomness."}
    assert docstring_params(google) == expected
    assert docstring_params(numpy) == expected | {"size": "side of the grid."}
    assert docstring_params(sphinx) == expected | {"size": "side of the grid."}


def test_eval_cli_takes_a_user_env(user_module, tiny_model, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", tiny_model, "--env", f"{user_module}:Coin",
                 "--env-kwargs", '{"bias": 1.0}', "--episodes", "2", "--max-turns", "1",
                 "--max-new-tokens", "2", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["prompts"] == 2 and results["env/errors"] == 0

"""`gem:<id>` runs environments of the gem-llm package (offline game envs)."""

from __future__ import annotations

# The set-up (Makefile) installs gem-llm: a failed import is a failure, not a skip.
import gem  # noqa: F401
import pytest

from reroll.config.errors import ConfigError
from reroll.envs import make_env


def test_gem_guess_the_number_through_the_adapter():
    env = make_env("gem:game:GuessTheNumber-v0-easy")
    obs, info = env.reset(1)
    assert "Guess The Number" in obs
    for guess in range(1, 11):
        obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
        if terminated or truncated:
            break
    assert isinstance(obs, str) and "episode" in info
    assert reset_is_seeded()


def reset_is_seeded() -> bool:
    a, b = make_env("gem:game:GuessTheNumber-v0-easy"), make_env("gem:game:GuessTheNumber-v0-easy")
    a.reset(5)
    b.reset(5)
    return [a.step(f"\\boxed{{{g}}}")[0] for g in (5, 3)] == [b.step(f"\\boxed{{{g}}}")[0]
                                                            for g in (5, 3)]


def test_unknown_gem_id_is_a_config_error():
    with pytest.raises(ConfigError, match="gem:no-such-env"):
        make_env("gem:no-such-env")

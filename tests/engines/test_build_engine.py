"""Engine choice from the config, and the errors a user gets for bad engine settings."""

import sys

import pytest

from reroll.config.errors import ConfigError
from reroll.config.schema import RolloutConfig
from reroll.engines import build_engine
from reroll.engines.hf import HFEngine

pytestmark = pytest.mark.unit


def test_default_engine_is_hf(tiny_model):
    engine = build_engine(RolloutConfig(max_batch_size=8), tiny_model)
    assert isinstance(engine, HFEngine) and engine.max_batch_size == 8


def test_unknown_engine_and_remote_without_endpoints_are_rejected():
    with pytest.raises(ValueError, match="'hf', 'vllm', 'remote'"):
        RolloutConfig(engine="sglang")
    with pytest.raises(ValueError, match="endpoints\n.*empty: list the base URLs"):
        RolloutConfig(engine="remote")
    with pytest.raises(ValueError, match="must start with http"):
        RolloutConfig(engine="remote", remote={"endpoints": ["localhost:8000"]})


def test_missing_vllm_says_run_make_vllm(monkeypatch, tiny_model):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM sees
    with pytest.raises(ConfigError, match="make vllm"):
        build_engine(RolloutConfig(engine="vllm"), tiny_model)

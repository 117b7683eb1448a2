"""Every host of a role provides what the RL step calls on it, with the protocol's parameters:
the one-process objects and the worker groups alike (a renamed or missing method fails here,
not at step N of a Ray run); and both tasks provide the pipeline's `Task` protocol."""

from __future__ import annotations

import inspect

import pytest

from reroll.distributed.groups import CriticProxy, PolicyGroup, ReferenceGroup
from reroll.pipelines.agentic import EnvTask
from reroll.pipelines.envmix import EnvMixTask
from reroll.pipelines.rlvr import PromptTask
from reroll.pipelines.task import Task
from reroll.training.critic import LocalCritic
from reroll.training.local import LocalStrategy
from reroll.training.protocols import Critic, Policy, Reference


def protocol_members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def parameters(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("protocol", "host"), [
    (Policy, LocalStrategy), (Policy, PolicyGroup),
    (Reference, ReferenceGroup),
    (Critic, LocalCritic), (Critic, CriticProxy),
    (Task, PromptTask), (Task, EnvTask), (Task, EnvMixTask),
], ids=lambda x: x.__name__)
def test_host_provides_the_protocol(protocol, host):
    members = protocol_members(protocol)
    assert members, protocol
    for name, member in members.items():
        # A data member may be set per instance (`self.num_critics = ...` in __init__).
        present = hasattr(host, name) or (isinstance(member, property) and f"self.{name} ="
                                          in inspect.getsource(host.__init__))
        assert present, f"{host.__name__} lacks {protocol.__name__}.{name}"
        if callable(member) and not isinstance(member, property):
            assert parameters(getattr(host, name)) == parameters(member), (host, name)


def test_a_local_strategy_is_a_policy(tiny_model):
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.models.loading import load_model

    strategy = LocalStrategy(load_model(tiny_model), OptimizerConfig(), TrainConfig(),
                             total_steps=1)
    assert isinstance(strategy, Policy) and strategy.data_parallel_size == 1
    assert not isinstance(strategy, Critic)

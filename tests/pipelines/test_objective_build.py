"""The objective built once (`objective.build`), the typed RL batch, and users' own estimators
and losses: every name the config schema offers has an entry; the step reads no config and tests
no batch key; a missing batch field fails where the batch is made; a user's function that does
not import or does not fit its signature is a ConfigError naming its field."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from reroll.config.algorithm import ADVANTAGE_NAMES, POLICY_LOSS_NAMES, AlgorithmConfig
from reroll.config.errors import ConfigError
from reroll.data.batch import RLBatch, Trajectory
from reroll.pipelines import advantages, objective, rl

pytestmark = pytest.mark.unit
PIPELINES = Path(__file__).resolve().parents[2] / "reroll" / "pipelines"


def test_every_estimator_and_loss_in_the_schema_has_an_entry():
    assert set(advantages.ESTIMATORS) | {"custom"} == set(ADVANTAGE_NAMES)
    assert set(objective.POLICY_LOSSES) | {"custom"} == set(POLICY_LOSS_NAMES)
    for name in ADVANTAGE_NAMES:
        if name != "custom":
            extra = {"critic": {}} if name == "gae" else {}
            built = objective.build(AlgorithmConfig(advantage={"name": name}, **extra))
            assert callable(built.estimate) and built.label.startswith(f"{name}/")
    for name in POLICY_LOSS_NAMES:
        if name != "custom":
            assert callable(objective.build(AlgorithmConfig(policy_loss={"name": name}))
                            .policy_loss)


def test_the_objective_is_frozen_and_dense_distillation_is_a_term():
    built = objective.build(AlgorithmConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.entropy_coef = 1.0  # type: ignore[misc]
    assert built.distill is None and built.advantages_first and not built.needs_old_logprobs
    dense = objective.build(AlgorithmConfig(distill={"teacher": {"path": "t"}, "mode": "dense"}))
    assert dense.distill.loss is not None and dense.policy_loss is None and dense.estimate is None
    assert not dense.advantages_first
    with_task = objective.build(AlgorithmConfig(distill={"teacher": {"path": "t"},
                                                         "mode": "dense", "task_coef": 0.5}))
    assert with_task.policy_loss is not None and with_task.estimate is not None
    pure = objective.build(AlgorithmConfig(distill={"teachers": {"a": {"path": "t"},
                                                                 "b": {"path": "u"}}}))
    assert pure.distill.advantage is not None and pure.distill.loss is None
    assert pure.distill.routed and pure.distill.names == ("a", "b")


# ----------------------------------------------------------------------------- AST checks


def _tree(name: str) -> ast.Module:
    return ast.parse((PIPELINES / name).read_text())


@pytest.mark.parametrize("name", ["rl.py", "objective.py"])
def test_no_keys_membership_tests(name):
    # Any `.keys()` call: `"x" in batch.keys()`, or `keys = batch.keys()` tested later.
    found = sorted(node.lineno for node in ast.walk(_tree(name)) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and node.func.attr == "keys")
    assert not found, f"{name}: `.keys()` at lines {found}: declare the field in RLBatch"


def _step_functions() -> list[ast.FunctionDef]:
    """rl.py's module-level functions after `Learner`: the training step."""
    tree = _tree("rl.py")
    names = [getattr(node, "name", None) for node in tree.body]
    start = names.index("Learner")
    return [node for node in tree.body[start:] if isinstance(node, ast.FunctionDef)]


def test_the_step_functions_read_no_config():
    functions = _step_functions()
    assert {"train_on", "make_batch", "collate_for_rl", "compute_logprobs_and_values",
            "estimate", "update", "update_policy"} <= {f.name for f in functions}
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.arg):
                annotation = ast.unparse(node.annotation) if node.annotation else ""
                assert node.arg != "config" and "Config" not in annotation, \
                    f"rl.{function.name} takes {node.arg}: {annotation} (take the Objective)"
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("algorithm", "rollout", "config"), \
                    f"rl.{function.name} reads .{node.attr} at line {node.lineno}"


def test_rl_py_maps_no_config_section_to_a_function():
    source = (PIPELINES / "rl.py").read_text()
    for mapping in ("TIS_LEVELS", "ratio_mask", "AlgorithmConfig", "ESTIMATORS", "POLICY_LOSSES",
                    "DIVERGENCES"):
        assert mapping not in source, mapping


# ----------------------------------------------------------------------------- the typed batch


def trajectories(rewards, lengths):
    return [Trajectory([1, 2], list(range(3, 3 + n)), [-0.5] * n, "stop", group_id=i // 2,
                       reward=r) for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]


def test_collate_for_rl_makes_a_typed_batch_with_every_required_field():
    batch, _ = rl.collate_for_rl(trajectories([1.0, 0.0, 0.0, 1.0], [3, 5, 2, 4]), 0,
                                 objective.build(AlgorithmConfig(), group_size=2))
    assert isinstance(batch, RLBatch) and set(RLBatch.REQUIRED) <= set(batch.keys())
    assert batch["turn_rewards"].tolist() == [[1.0], [0.0], [0.0], [1.0]]  # one turn each
    assert isinstance(batch[torch.tensor([True, False, True, False])], RLBatch)
    assert isinstance(batch[1:3], RLBatch)


def test_a_missing_or_misshapen_field_fails_where_the_batch_is_made():
    batch, _ = rl.collate_for_rl(trajectories([1.0, 0.0], [3, 5]), 0,
                                 objective.build(AlgorithmConfig(), group_size=2))
    fields = dict(batch.items())
    del fields["behaviour_logprobs"]
    with pytest.raises(ValueError, match=r"'behaviour_logprobs' \[B T\]"):
        RLBatch.checked(TensorDict(fields, batch_size=[2]))
    fields = dict(batch.items()) | {"loss_mask": batch["loss_mask"][:, :3]}
    with pytest.raises(ValueError, match="field 'loss_mask' has shape"):
        RLBatch.checked(TensorDict(fields, batch_size=[2]))
    # the optional `model_inputs` (a prompt's extra model inputs) travels as a nested TensorDict
    pixels = TensorDict({"pixel_values": torch.zeros(2, 3, 4, 4)}, batch_size=[2])
    with_inputs = RLBatch.checked(TensorDict(dict(batch.items()) | {"model_inputs": pixels},
                                             batch_size=[2]))
    assert with_inputs[0:1]["model_inputs", "pixel_values"].shape == (1, 3, 4, 4)


# ----------------------------------------------------------------------------- user functions


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # user modules import from the working directory
    (tmp_path / "user_objective_unit.py").write_text(
        "def centred(batch, group_size, scale=1.0):\n"
        "    r = batch['rewards'].view(-1, group_size)\n"
        "    a = (r - r.mean(-1, keepdim=True)).flatten() * scale\n"
        "    return a[:, None] * batch['response_mask']\n"
        "def too_few(batch):\n"
        "    return batch['advantages']\n"
        "def reinforce(logprobs, old_logprobs, advantages, mask, *, agg, num_tokens, num_seqs,\n"
        "              max_len, is_weights):\n"
        "    per_token = -advantages * logprobs * mask\n"
        "    return per_token.sum() / num_tokens, {'pg': per_token.sum().detach()}\n"
        "def not_a_loss(logprobs):\n"
        "    return logprobs.sum(), {}\n")
    yield "user_objective_unit"
    sys.modules.pop("user_objective_unit", None)


def test_a_user_estimator_is_called_with_the_batch_and_its_kwargs(user_module):
    config = AlgorithmConfig(advantage={"name": "custom", "function": f"{user_module}:centred",
                                        "kwargs": {"scale": 2.0}})
    built = objective.build(config, group_size=2)
    assert built.label == "custom/ppo"
    batch, _ = rl.collate_for_rl(trajectories([1.0, 0.0, 0.0, 0.0], [3, 3, 3, 3]), 0, built)
    advantages = objective.estimate_advantages(built, batch)[0]
    assert advantages[:, 2].tolist() == [1.0, -1.0, 0.0, 0.0]  # 2 x (r - group mean)


def test_a_user_loss_is_called_with_the_aggregation_keywords(user_module):
    built = objective.build(AlgorithmConfig(policy_loss={
        "name": "custom", "function": f"{user_module}:reinforce"}), group_size=2)
    assert not built.skip_zero_advantage  # exact only for the built-in losses' form
    logprobs = torch.full((2, 3), -1.0)
    loss, metrics = built.policy_loss(logprobs, logprobs, torch.ones(2, 3), torch.ones(2, 3),
                                      None, None, agg="token_mean", num_tokens=6.0,
                                      num_seqs=2.0, max_len=3)
    assert float(loss) == pytest.approx(1.0) and "pg" in metrics


@pytest.mark.parametrize(("section", "function", "message"), [
    ("advantage", "no_such_module_here:fn", "algorithm.advantage.function 'no_such_module_here:fn' "
                                            "cannot be imported"),
    ("advantage", "{m}:missing", "algorithm.advantage.function '{m}:missing' cannot be imported"),
    ("advantage", "{m}:too_few", "algorithm.advantage.function '{m}:too_few' does not fit "
                                 "estimator(batch, group_size"),
    ("policy_loss", "{m}:not_a_loss", "algorithm.policy_loss.function '{m}:not_a_loss' does not "
                                      "fit policy_loss(logprobs"),
])
def test_a_user_function_that_does_not_fit_is_a_config_error(user_module, section, function,
                                                              message):
    config = AlgorithmConfig(**{section: {"name": "custom",
                                          "function": function.format(m=user_module)}})
    with pytest.raises(ConfigError) as info:
        objective.build(config)
    assert message.format(m=user_module) in str(info.value)


def test_a_custom_estimator_with_a_kl_reward_penalty_is_refused():
    with pytest.raises(ValueError, match="algorithm.kl.mode reward"):
        AlgorithmConfig(advantage={"name": "custom", "function": "m:f"},
                        kl={"coef": 0.1, "mode": "reward"})


def test_the_documented_example_runs(tmp_path, monkeypatch):
    """docs/algorithms.md's own estimator and loss, as written there, through `build`."""
    import re

    import yaml

    text = (PIPELINES.parents[1] / "docs" / "algorithms.md").read_text()
    section = text[text.index("### Your own estimator or loss"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    snippet = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, flags=re.S).group(1))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_method.py").write_text(code)
    try:
        built = objective.build(AlgorithmConfig(**snippet["algorithm"]), group_size=2)
        batch, _ = rl.collate_for_rl(trajectories([1.0, 0.0, 0.0, 0.0], [3, 3, 3, 3]), 0, built)
        advantages = objective.estimate_advantages(built, batch)[0]
        assert advantages[:, 2].tolist() == [0.5, -0.5, 0.0, 0.0]
        logprobs = torch.full(advantages.shape, -1.0)
        loss, metrics = built.policy_loss(logprobs, logprobs, advantages, batch["loss_mask"],
                                          batch, None, agg="token_mean", num_tokens=12.0,
                                          num_seqs=4.0, max_len=3)
        assert float(loss) == pytest.approx(0.0) and "pg_loss" in metrics
    finally:
        sys.modules.pop("my_method", None)

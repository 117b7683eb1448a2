"""`model.lora`: defaults, overrides from the command line, and the values refused at load."""

from pathlib import Path

import pytest
import yaml

from reroll.config import ConfigError, load_config

pytestmark = pytest.mark.unit
MINIMAL = {"steps": 2, "model": {"path": "m", "lora": {}}, "data": {"train": "t.jsonl"}}


def load(tmp_path: Path, data: dict, overrides=()):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, list(overrides))


def error_of(tmp_path: Path, data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data, overrides)
    return str(info.value)


def test_defaults_and_command_line_overrides(tmp_path):
    lora = load(tmp_path, MINIMAL).model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.0,
                                                                            "all-linear")
    lora = load(tmp_path, MINIMAL, ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"]
                ).model.lora
    assert lora.rank == 4 and lora.target_modules == ["q_proj", "v_proj"]
    assert load(tmp_path, {**MINIMAL, "model": {"path": "m"}}).model.lora is None


@pytest.mark.parametrize("lora, expected", [
    ({"rank": 0}, "model.lora.rank"),
    ({"dropout": 1.0}, "model.lora.dropout"),
    ({"target_modules": []}, "name at least one module"),
    ({"target_modules": "q_proj"}, "model.lora.target_modules"),
    ({"ranks": 8}, "model.lora.ranks"),
])
def test_bad_values_name_the_field(tmp_path, lora, expected):
    assert expected in error_of(tmp_path, {**MINIMAL, "model": {"path": "m", "lora": lora}})


def test_lora_with_sharded_policy_workers_is_refused(tmp_path):
    data = {**MINIMAL, "distributed": {"executor": "ray", "policy": {"num_workers": 2}},
            "train": {"micro_batch_size": 8}}
    assert "distributed.policy.num_workers: 1" in error_of(tmp_path, data)


def test_sft_configs_take_lora_too(tmp_path):
    data = {"pipeline": "sft", "model": {"path": "m", "lora": {"rank": 2}},
            "data": {"train": "t.jsonl"}}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(path, expect="sft").model.lora.rank == 2


def test_the_sync_mode_defaults_to_auto_and_engine_actors_take_adapters(tmp_path):
    assert load(tmp_path, MINIMAL).model.lora.sync == "auto"
    assert load(tmp_path, MINIMAL, ["model.lora.sync=merged"]).model.lora.sync == "merged"
    assert "model.lora.sync" in error_of(tmp_path, MINIMAL, ["model.lora.sync=delta"])
    ray = load(tmp_path, {**MINIMAL, "distributed": {"executor": "ray"}},
               ["model.lora.sync=adapter"])
    assert ray.model.lora.sync == "adapter"


def test_delta_sync_to_engine_actors_needs_the_hf_engine_and_the_ray_executor(tmp_path):
    ray = {**MINIMAL, "distributed": {"executor": "ray", "weight_sync": "delta"}}
    assert load(tmp_path, ray, ["distributed.full_sync_every=3"]).distributed.full_sync_every == 3
    message = error_of(tmp_path, ray, ["rollout.engine.type=vllm"])
    assert "distributed.weight_sync: delta" in message and "rollout.engine: vllm" in message
    local = error_of(tmp_path, MINIMAL, ["distributed.weight_sync=delta"])
    assert "distributed.weight_sync is only used by the ray executor" in local

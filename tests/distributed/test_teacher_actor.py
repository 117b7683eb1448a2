"""On-policy distillation with `executor: ray`: the teacher is a Ray actor placed as
`distributed.reference` says (not a model in the driver), and the run is the one-process run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from small_runs import small_run_config

from reroll.config import ConfigError
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, tiny_model) -> str:
    """The tiny model with its weights moved: the same tokenizer, other distributions."""
    from reroll.models.loading import load_model

    out = tmp_path_factory.mktemp("models") / "other"
    shutil.copytree(tiny_model, out)
    model, generator = load_model(str(out)), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.1 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(out)
    return str(out)


def actors_after_the_teachers_start(monkeypatch) -> dict:
    """{"actors": the Ray cluster's named actors right after the run built its teachers}."""
    import ray

    from reroll.pipelines import roles

    seen, build = {}, roles.teachers

    def teachers_seen(c, plan, cluster):
        teacher = build(c, plan, cluster)
        seen["actors"] = set(ray.util.list_named_actors())
        return teacher

    monkeypatch.setattr(roles, "teachers", teachers_seen)
    return seen


def distill_run(tmp_path, tiny_model, arithmetic, name, teacher, **distributed):
    return small_run_config(tmp_path, tiny_model, arithmetic, name, steps=2, algorithm={
        "distill": {"teacher": {"path": teacher}, "mode": "dense", "top_k": 4}}, **distributed)


def test_the_teacher_is_an_actor_placed_as_the_reference_and_scores_as_in_one_process(
        ray_session, tmp_path, tiny_model, arithmetic, other_model, monkeypatch):
    local = distill_run(tmp_path, tiny_model, arithmetic, "local", other_model)
    train(local)
    seen = actors_after_the_teachers_start(monkeypatch)
    train(distill_run(tmp_path, tiny_model, arithmetic, "ray", other_model, executor="ray",
                      reference={"num_cpus": 0.5}, rollout={"colocate_with": "policy"}))
    assert "reroll-ray-teacher-0" in seen["actors"], seen
    local_rows, ray_rows = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["step"] for r in ray_rows] == [1, 2]
    # Step 1 samples from the same weights: the teacher's top-k and the loss are the same.
    for key in ("distill/forward_kl", "distill/teacher_tokens", "train/loss"):
        assert ray_rows[0][key] == pytest.approx(local_rows[0][key], abs=1e-5), key


def test_the_teachers_cpus_are_counted_with_the_other_roles(ray_session, tmp_path, tiny_model,
                                                          arithmetic, other_model):
    """A teacher reserves the reference's CPUs: asking for more than the cluster has (4 CPUs
    here) stops the run at start naming the teacher, instead of an actor that waits forever."""
    config = distill_run(tmp_path, tiny_model, arithmetic, "too_many", other_model,
                         executor="ray", policy={"num_cpus": 1}, rollout={"num_cpus": 1},
                         reference={"num_cpus": 2.5})
    with pytest.raises(ConfigError,
                       match=r"reserve 4\.5 CPUs .*teacher \(distributed\.reference\) 2\.5"):
        train(config)


def test_teachers_routed_by_tag_are_one_actor_each(ray_session, tmp_path, tiny_model, arithmetic,
                                                  other_model, monkeypatch):
    rows = [json.loads(line) for line in open(arithmetic["train"])]
    tagged = tmp_path / "tagged.jsonl"
    tagged.write_text("".join(json.dumps(row | {"tag": ("odd", "even")[i % 2]}) + "\n"
                              for i, row in enumerate(rows)))
    config = small_run_config(tmp_path, tiny_model, {**arithmetic, "train": str(tagged)},
                              "routed", steps=1, algorithm={"distill": {
                                  "teachers": {"odd": {"path": other_model},
                                               "even": {"path": tiny_model}},
                                  "mode": "dense", "top_k": 4}},
                              executor="ray", reference={"num_cpus": 0.5},
                              rollout={"colocate_with": "policy"})
    seen = actors_after_the_teachers_start(monkeypatch)
    train(config)
    assert {"reroll-routed-teacher-odd-0", "reroll-routed-teacher-even-0"} <= seen["actors"]
    step = read_metrics(tmp_path / "routed")[0]
    assert step["distill/samples/odd"] + step["distill/samples/even"] == 16

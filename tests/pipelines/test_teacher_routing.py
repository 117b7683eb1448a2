"""Several teachers of on-policy distillation routed by the prompt rows' `tag`: each sample's
teacher logprobs are its own teacher's, the rows are checked at start (a misspelt or missing tag
names its file and line), and the config says what is missing."""

from __future__ import annotations

import json

import pytest
import torch

from reroll.cli import main
from reroll.config import ConfigError
from reroll.config.schema import RLConfig
from reroll.data.batch import Trajectory, collate
from reroll.data.datasets import load_prompts
from reroll.distributed.cluster import Cluster, LocalExecutor, WorkerSpec
from reroll.distributed.groups import ReferenceGroup
from reroll.pipelines.roles import RoutedTeacher
from reroll.pipelines.validation import check_teacher_tags
from reroll.workers.reference import ReferenceWorker

pytestmark = pytest.mark.unit


def teacher(path: str) -> ReferenceGroup:
    return ReferenceGroup(Cluster(WorkerSpec(ReferenceWorker, dict(
        model_path=path, dtype="float32", micro_batch_size=2), role="teacher"), 1,
        LocalExecutor()))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    from reroll.models.factory import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "other", "tiny", seed=1))


def test_each_sample_gets_the_logprobs_of_the_teacher_its_tag_names(tiny_model, other_model):
    tags = ["math", None, "code", "math", "code"]
    trajectories = [Trajectory([1, 5 + i, 7], [9, 4 + i, 2][: 2 + i % 2], [0.0] * (2 + i % 2),
                               "stop", group_id=i, tag=tag) for i, tag in enumerate(tags)]
    batch, _ = collate(trajectories, pad_token_id=0)
    math, code = teacher(tiny_model), teacher(other_model)
    routed = RoutedTeacher({None: math, "math": math, "code": code})
    batch["teacher_route"] = routed.routes(tags)
    assert batch["teacher_route"].tolist() == [1, 0, 2, 1, 2]
    out = routed.logprobs(batch, temperature=1.0)
    alone = {"math": math.logprobs(batch), "code": code.logprobs(batch)}
    for i, tag in enumerate(tags):
        assert torch.allclose(out[i], alone[tag or "math"][i], atol=1e-5), (i, tag)
    assert not torch.allclose(alone["math"][2], alone["code"][2])  # the teachers differ
    assert routed.samples == {None: 1, "math": 2, "code": 2}
    top = routed.top_k(batch, 3)  # `mode: dense`: each sample's top-k from its own teacher
    alone_top = {"math": math.top_k(batch, 3), "code": code.top_k(batch, 3)}
    assert top["ids"].shape == (5, batch["input_ids"].shape[1], 3)
    for i, tag in enumerate(tags):
        assert torch.equal(top["ids"][i], alone_top[tag or "math"]["ids"][i]), (i, tag)
        assert torch.allclose(top["logprobs"][i], alone_top[tag or "math"]["logprobs"][i],
                              atol=1e-5)
    response = batch["response_mask"].bool()
    assert (top["logprobs"][response] < 0).all() and not top["logprobs"][~response].any()


def rows(tmp_path, *tags):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"} |
                                       ({} if tag is None else {"tag": tag})) + "\n"
                            for i, tag in enumerate(tags)))
    return load_prompts(path)


def distill(**section):
    return RLConfig(model={"path": "m"}, data={"train": "t.jsonl"}, steps=1,
                    algorithm={"distill": section}).algorithm.distill


def test_rows_are_checked_against_the_teachers(tmp_path):
    both = distill(teachers={"math": {"path": "a"}, "code": {"path": "b"}})
    check_teacher_tags(both, "data.train", rows(tmp_path, "math", "code", "math"))
    with pytest.raises(ConfigError, match=r"train.jsonl:3 has tag 'maths', which names none of "
                                          r"algorithm.distill.teachers \(math, code\)"):
        check_teacher_tags(both, "data.train", rows(tmp_path, "math", "code", "maths"))
    with pytest.raises(ConfigError, match="train.jsonl:2 has no `tag` column"):
        check_teacher_tags(both, "data.train", rows(tmp_path, "math", None))
    with_default = distill(teacher={"path": "c"}, teachers={"math": {"path": "a"}})
    check_teacher_tags(with_default, "data.train", rows(tmp_path, "math", None))
    with pytest.raises(ConfigError, match="tag 'code'"):  # a tag is never sent to the default
        check_teacher_tags(with_default, "data.train", rows(tmp_path, "code"))
    assert with_default.route("math") == "math" and with_default.route(None) is None


def test_the_distill_section_needs_a_teacher_and_agentic_runs_take_one(tmp_path):
    with pytest.raises(ValueError, match="give a `teacher`"):
        distill()
    config = tmp_path / "agentic.yaml"
    config.write_text("pipeline: agentic\nsteps: 1\nmodel: {path: m}\nenv: {id: guess_number}\n"
                      "algorithm: {distill: {teachers: {a: {path: m}}}}\n")
    from reroll.config import load_config
    with pytest.raises(ConfigError, match="agentic episodes have no rows"):
        load_config(config)


def test_an_unknown_tag_exits_2_before_any_model_loads(tmp_path, tiny_model, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "1", "tag": "mth"}) + "\n")
    config = tmp_path / "rl.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\nsteps: 1\nmodel: {{path: {tiny_model}}}\n"
                      f"data: {{train: {data}}}\n"
                      f"algorithm: {{distill: {{teachers: {{math: {{path: {tiny_model}}}}}}}}}\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl:1 has tag 'mth'" in err and "Traceback" not in err

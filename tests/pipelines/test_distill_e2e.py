"""`reroll distill`: a fresh tiny student distilled from the arithmetic-SFT'd teacher on the
teacher's data closes most of the teacher-student gap in held-out reward; the run resumes
exactly; a teacher with another tokenizer is refused with the reason. On-policy distillation
(`algorithm.distill`): the one-sample advantage (`pure`), the dense GKD loss (`dense`), and
teachers routed by tag."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from test_recipes_e2e import shared_warm_model

from reroll.config import load_config
from reroll.config.errors import ConfigError
from reroll.data.tasks import write_arithmetic
from reroll.evaluation import EvalSpec, evaluate
from reroll.models.loading import load_tokenizer
from reroll.pipelines.distill import check_same_tokenizer, train_distill
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def warm_model(session_cache, tiny_model):
    return shared_warm_model(session_cache, tiny_model)


def distill_config(tmp_path, student: str, teacher: dict, steps: int, batch_size: int,
                   every: int, **distill) -> str:
    """`steps` of `batch_size` rows at lr 3e-3 (5 warm-up steps, then cosine decay: the last
    steps settle the student instead of leaving it wherever the last batch took it), a
    checkpoint every `every` steps (0: at the end only)."""
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump({
        "pipeline": "distill", "output_dir": str(tmp_path / "run"), "model": {"path": student},
        "teacher": {"path": teacher["model"]}, "distill": {"top_k": 8, **distill},
        "data": {"train": teacher["train"], "eval": teacher["eval"], "response_key": "solution"},
        "steps": steps, "batch_size": batch_size,
        "optimizer": {"lr": 3e-3, "warmup_steps": 5, "schedule": "cosine"},
        "checkpoint": {"every_steps": every},
        "tracking": {"progress": False, "tensorboard": False}}))
    return str(path)


def held_out_reward(model: str, eval_file: str) -> float:
    summary, _ = evaluate(EvalSpec(model=model, task=eval_file, max_new_tokens=24))
    return summary["mean@1"]


# pytest-timeout is a hang guard (600 s in pyproject); this test does minutes of real
# training, so its guard is wider: on a loaded machine a longer version of it ran past 600 s
# while still making progress.
@pytest.mark.timeout(1800)
def test_a_distilled_student_closes_most_of_the_gap(tmp_path, tiny_model, warm_model):
    """The teacher had 112 SFT steps of 32 rows on these rows; the fresh student gets 220
    distillation steps of 16 of the same rows (prompt + the teacher's data), the learning rate
    decayed to 0 by the last, judged on 256 new prompts. 2026-11-28: teacher 0.36, student
    0.00 -> 0.29 (80% of the gap; with the run's seed 1, 94%). 64 prompts were too few for a
    60% bar: runs of these settings measured 54-96% on them, on 256 (two sets, two seeds)
    77-94%. (Until then: 220 steps of 32 rows at a constant rate, twice the rows.)"""
    held_out = str(write_arithmetic(tmp_path / "held_out", train_size=1, eval_size=256, seed=7,
                                    levels=(1,))["eval"])
    teacher = held_out_reward(warm_model["model"], held_out)
    student_before = held_out_reward(tiny_model, held_out)
    config = distill_config(tmp_path, tiny_model, warm_model, 220, batch_size=16, every=0)
    summary = train_distill(load_config(config, expect="distill"))
    student_after = held_out_reward(summary["final_model"], held_out)
    rows = [r for r in read_metrics(tmp_path / "run") if "distill/divergence" in r]
    assert rows[-1]["distill/teacher_tokens"] > rows[0]["distill/teacher_tokens"] > 0
    assert rows[-1]["distill/divergence"] < rows[0]["distill/divergence"] / 2
    closed = (student_after - student_before) / max(teacher - student_before, 1e-9)
    print({"teacher": teacher, "before": student_before, "after": student_after,
           "closed": closed})
    assert teacher > student_before + 0.15
    assert closed >= 0.6


def test_distill_resumes_exactly(tmp_path, tiny_model, warm_model):
    """6 steps of 8 rows, cut after step 3 (inside the warm-up: the learning rate differs at
    every step), resume to the same numbers."""
    def config(root: Path) -> str:
        return distill_config(root, tiny_model, warm_model, 6, batch_size=8, every=3,
                              divergence="jsd", sft_coef=0.5)

    full = tmp_path / "full"
    full.mkdir()
    train_distill(load_config(config(full), expect="distill"))
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(full / "run", cut / "run")
    shutil.rmtree(cut / "run" / "checkpoints" / "step_6")
    lines = (cut / "run" / "metrics.jsonl").read_text().splitlines()[:3]
    (cut / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = train_distill(load_config(config(cut), ["resume=true"], expect="distill"))
    assert summary["resumed_from_step"] == 3
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in read_metrics(cut / "run")] == \
        [strip(r) for r in read_metrics(full / "run")]


@pytest.mark.unit
def test_a_teacher_with_another_tokenizer_is_refused(tiny_model):
    student = load_tokenizer(tiny_model)
    student.add_tokens(["<not-in-the-teacher>"])
    with pytest.raises(ConfigError, match="teacher.path: the teacher's tokenizer .* must share"):
        check_same_tokenizer(tiny_model, student, 10, 10)
    with pytest.raises(ConfigError, match="12 logits and the student's 10"):
        check_same_tokenizer(tiny_model, load_tokenizer(tiny_model), 12, 10)


@pytest.fixture(scope="module")
def weak_student(tmp_path_factory, tiny_model, warm_model) -> str:
    """The tiny model after 25 SFT steps on the teacher's data: it writes the answer format but
    gets few sums right (the teacher had 112 steps)."""
    from reroll.pipelines.sft import train_sft

    root = tmp_path_factory.mktemp("weak")
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(root / "sft"), "model": {"path": tiny_model},
        "data": {"train": warm_model["train"], "response_key": "solution"}, "steps": 25,
        "batch_size": 32, "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "tracking": {"progress": False, "tensorboard": False}}))
    return train_sft(load_config(config, expect="sft"))["final_model"]


def test_on_policy_distillation_moves_the_student_toward_the_teacher(tmp_path, warm_model,
                                                                     weak_student):
    """GRPO's loop with `algorithm.distill` (pure): no task reward in the advantage, only the
    teacher's per-token log-ratio on the student's own samples; the held-out (math-verified)
    reward still rises, and the teacher's cost is counted."""
    from reroll.pipelines.rlvr import train

    held_out = str(write_arithmetic(tmp_path / "held_out", train_size=1, eval_size=64, seed=7,
                                    levels=(1,))["eval"])
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "steps": 12, "model": {"path": weak_student},
        "data": {"train": warm_model["train"], "eval": held_out},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 24},
        "optimizer": {"lr": 1e-3}, "eval": {"every_steps": 12, "max_prompts": 64,
                                            "temperature": 0.0},
        "algorithm": {"distill": {"teacher": {"path": warm_model["model"]}, "mode": "pure"}},
        "tracking": {"progress": False, "tensorboard": False}}))
    summary = train(load_config(config))
    rows = [r for r in read_metrics(tmp_path / "run") if "distill/reverse_kl" in r]
    print({"eval_start": summary["eval_reward_start"], "eval_end": summary["eval_reward_end"],
           "reverse_kl": [round(r["distill/reverse_kl"], 3) for r in rows],
           "teacher_tokens": rows[-1]["distill/teacher_tokens"]})
    assert rows[-1]["distill/teacher_tokens"] == sum(r["train/response_len_mean"] * 32
                                                     for r in rows)
    assert sum(r["distill/reverse_kl"] for r in rows[-3:]) < sum(r["distill/reverse_kl"]
                                                                 for r in rows[:3])
    assert summary["eval_reward_end"] > summary["eval_reward_start"]


def dense_runner(tmp_path: Path, warm_model: dict, weak_student: str, steps: int, **distill):
    """A function (out, resume) -> summary: RLVR with `mode: dense` from the weak student
    toward the SFT'd teacher (top-8), a checkpoint every `steps` // 2 steps."""
    from reroll.pipelines.rlvr import train

    def run(out: Path, resume: bool = False) -> dict:
        config = tmp_path / "rl.yaml"
        config.write_text(yaml.safe_dump({
            "output_dir": str(out), "steps": steps, "model": {"path": weak_student},
            "data": {"train": warm_model["train"]},
            "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 24},
            "optimizer": {"lr": 1e-3}, "checkpoint": {"every_steps": steps // 2},
            "algorithm": {"distill": {"teacher": {"path": warm_model["model"]}, "mode": "dense",
                                      "top_k": 8, **distill}},
            "tracking": {"progress": False, "tensorboard": False}}))
        return train(load_config(config, ["resume=true"] if resume else []))

    return run


def assert_resumes_exactly(tmp_path: Path, run, rows: list[dict], steps: int) -> None:
    """The run in tmp_path/run, cut back to its middle checkpoint, resumes to the same rows."""
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    shutil.rmtree(cut / "checkpoints" / f"step_{steps}")
    lines = (cut / "metrics.jsonl").read_text().splitlines()[:steps // 2 + 1]
    (cut / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert run(cut, resume=True)["resumed_from_step"] == steps // 2
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in read_metrics(cut)] == [strip(r) for r in rows]


def test_dense_on_policy_distillation_lowers_the_divergence_and_resumes(tmp_path, warm_model,
                                                                        weak_student):
    """`mode: dense` (GKD): the divergence to the teacher's top-8 at every position of the
    student's own samples is the whole loss; it falls over 8 steps, the teacher's cost is the
    response tokens it scored (as in `pure`), and a run cut after step 4 resumes to the same
    numbers."""
    run = dense_runner(tmp_path, warm_model, weak_student, 8)
    run(tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    print({"forward_kl": [round(r["distill/forward_kl"], 3) for r in rows],
           "teacher_tokens": rows[-1]["distill/teacher_tokens"]})
    assert rows[-1]["distill/teacher_tokens"] == sum(r["train/response_len_mean"] * 32
                                                     for r in rows)
    assert "distill/reverse_kl" not in rows[0]  # no one-sample advantage in this mode
    assert sum(r["distill/forward_kl"] for r in rows[-3:]) < 0.8 * sum(
        r["distill/forward_kl"] for r in rows[:3])
    assert_resumes_exactly(tmp_path, run, rows, 8)


def test_dense_distillation_plus_the_task_loss_logs_both_parts_and_resumes(tmp_path, warm_model,
                                                                           weak_student):
    """`mode: dense` with `task_coef: 0.5`: the task's GRPO advantage is estimated again and its
    policy loss joins the divergence; both parts are logged every step and finite, the loss is
    their weighted sum, and a run cut after step 2 resumes to the same numbers."""
    run = dense_runner(tmp_path, warm_model, weak_student, 4, task_coef=0.5)
    run(tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    print({"divergence_loss": [round(r["distill/divergence_loss"], 4) for r in rows],
           "task_loss": [round(r["distill/task_loss"], 4) for r in rows]})
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        parts = r["distill/divergence_loss"] + 0.5 * r["distill/task_loss"]
        assert math.isfinite(r["train/loss"]) and r["train/loss"] == pytest.approx(parts, abs=1e-5)
        assert r["distill/divergence_loss"] > 0 and "distill/forward_kl" in r
    assert any(r["distill/task_loss"] != 0 for r in rows)  # the task advantage is not all zero
    assert_resumes_exactly(tmp_path, run, rows, 4)


def test_teachers_routed_by_tag_score_their_own_rows(tmp_path, warm_model, weak_student):
    """Two teachers routed by the rows' `tag`: `strong` (the SFT'd teacher) and `self` (the
    student's own weights). Each scores only its rows: on-policy, the student's own weights
    give a reverse KL of 0 on theirs, the strong teacher a positive one (one step: what is
    asserted is its first)."""
    from reroll.pipelines.rlvr import train

    rows = [json.loads(line) for line in Path(warm_model["train"]).read_text().splitlines()]
    tagged = tmp_path / "tagged.jsonl"
    tagged.write_text("".join(json.dumps(row | {"tag": ("strong", "self")[i % 2]}) + "\n"
                              for i, row in enumerate(rows[:64])))
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "steps": 1, "model": {"path": weak_student},
        "data": {"train": str(tagged)},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 24},
        "optimizer": {"lr": 1e-3},
        "algorithm": {"distill": {"teachers": {"strong": {"path": warm_model["model"]},
                                               "self": {"path": weak_student}}}},
        "tracking": {"progress": False, "tensorboard": False}}))
    train(load_config(config))
    first = read_metrics(tmp_path / "run")[0]
    assert first["distill/samples/strong"] + first["distill/samples/self"] == 32
    assert first["distill/samples/strong"] > 0 and first["distill/samples/self"] > 0
    assert abs(first["distill/reverse_kl/self"]) < 1e-3
    assert first["distill/reverse_kl/strong"] > 0.05

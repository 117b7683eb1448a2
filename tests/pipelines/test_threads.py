"""The torch thread count on a shared machine (issue 49): every core was ~3x slower than one
thread on a busy machine. Unset, `train.num_threads` (and `reroll eval --threads`) takes the cores
left idle by the load found at the start and says so; a run whose step meets an oversubscribed
machine with more than one thread says once that one thread is often faster.

The machine is faked (its cores and load); the run loop is the real one, around a step that only
records the thread count it trained with."""

from __future__ import annotations

import pytest
import torch

from reroll import settings
from reroll.cli import build_parser
from reroll.config.pipelines import KINDS
from reroll.evaluation_settings import default_threads, spec_from_args
from reroll.pipelines.run import Run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cores, load, threads", [
    (8, 0.0, 8), (8, 0.4, 8),  # quiet: every core
    (8, 0.5, 7), (8, 3.2, 5), (8, 7.4, 1),  # the cores left idle
    (8, 7.6, 1), (8, 30.0, 1),  # busier than its cores: still 1
    (2, 0.3, 2), (2, 1.0, 1), (2, 2.4, 1),  # the shared 2-core machine of the issue
    (1, 0.0, 1), (1, 5.0, 1),
])
def test_threads_are_the_cores_left_idle_at_least_one(cores, load, threads):
    assert settings.threads_for(cores, load) == threads


@pytest.mark.parametrize("cores, load, is_busy", [
    (2, 2.0, False), (2, 2.9, False), (2, 3.0, True), (8, 8.5, False), (8, 12.0, True)])
def test_busy_means_a_core_beyond_the_cores(cores, load, is_busy):
    """A run using every core makes a load about its cores by itself: that is not busy."""
    assert settings.busy(cores, load) is is_busy


@pytest.fixture
def machine(monkeypatch):
    """`machine(cores, load)`: the machine this process sees, read afresh; torch's thread count
    is put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the test command sets it
    settings.contention.cache_clear()

    def fake(cores: int, load: float | None) -> None:
        monkeypatch.setattr(settings, "cores", lambda: cores)
        monkeypatch.setattr(settings, "load", lambda: load)

    yield fake
    settings.contention.cache_clear()
    torch.set_num_threads(before)


class ThreadsSeen:
    """A step that trains nothing and keeps the torch thread count of each of its steps."""

    label, eval_every, eval_what, phase, start_row = "fake", 0, "", "training", False

    def __init__(self, steps: int):
        self.steps, self.threads = steps, []

    def next_batch(self, step):
        return step

    def train(self, batch, step):
        self.threads.append(torch.get_num_threads())
        return {"train/loss": 0.0}

    def record(self, step, batch):
        pass

    def status(self, metrics):
        return ""

    def state_dict(self):
        return {}

    def save(self, directory, state):
        directory.mkdir(parents=True, exist_ok=True)

    def save_final(self, directory):
        return {}

    def summary_keys(self, start, end):
        return {}

    def close(self):
        pass


def run(tmp_path, steps: int = 3, **train) -> ThreadsSeen:
    config = KINDS["sft"].config.model_validate({
        "pipeline": "sft", "steps": steps, "output_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model")}, "data": {"train": str(tmp_path / "d.jsonl")},
        "tracking": {"tensorboard": False}, "train": train})
    seen = []

    def factory(c):
        def build(run_dir, inputs):
            seen.append(ThreadsSeen(c.steps))
            return seen[-1]
        return build

    Run(config, step=factory).run()
    return seen[0]


def said(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "machine is busy" in line]


def test_a_busy_machine_gives_the_run_the_idle_cores_and_says_so(tmp_path, machine, capsys):
    machine(4, 1.2)
    step = run(tmp_path)
    assert step.threads == [3, 3, 3]
    assert said(capsys) == ["reroll: the machine is busy (load 1.2 on 4 cores): using 3 torch "
                            "threads; set train.num_threads: N to choose"]


def test_a_quiet_machine_keeps_torch_s_default_and_says_nothing(tmp_path, machine, capsys):
    machine(4, 0.2)
    default = torch.get_num_threads()
    assert run(tmp_path).threads == [default] * 3
    assert said(capsys) == []


def test_the_load_is_read_once_before_the_run_adds_its_own(tmp_path, machine, capsys):
    """A run restarted in its process (`supervise`) must not count its own threads as load."""
    machine(4, 0.2)
    default = torch.get_num_threads()
    run(tmp_path)
    machine(4, 4.0)  # this run's own threads: not read again
    assert run(tmp_path / "again").threads == [default] * 3


def test_a_set_num_threads_wins_over_the_load(tmp_path, machine, capsys):
    machine(4, 3.0)
    assert run(tmp_path, num_threads=2).threads == [2, 2, 2]
    assert not any("using" in line for line in said(capsys))


def test_omp_num_threads_exported_is_the_user_s_choice(tmp_path, machine, monkeypatch, capsys):
    machine(4, 3.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)  # what torch does at start with OMP_NUM_THREADS=2
    assert run(tmp_path).threads == [2, 2, 2]
    assert not any("using" in line for line in said(capsys))


def test_a_step_on_an_oversubscribed_machine_hints_once(tmp_path, machine, capsys):
    machine(2, 3.5)  # the load a core and more beyond the cores
    assert run(tmp_path, steps=4, num_threads=2).threads == [2] * 4
    assert said(capsys) == ["reroll: the machine is busy (load 3.5 on 2 cores): "
                            "train.num_threads: 1 is often faster here"]


@pytest.mark.parametrize("num_threads, load", [(1, 3.5), (2, 2.4)])
def test_no_hint_with_one_thread_or_a_load_within_the_cores(tmp_path, machine, capsys,
                                                              num_threads, load):
    machine(2, load)
    run(tmp_path, num_threads=num_threads)
    assert said(capsys) == []


def test_an_unknown_load_changes_nothing(tmp_path, machine, capsys):
    machine(4, None)
    default = torch.get_num_threads()
    assert run(tmp_path, num_threads=None).threads == [default] * 3
    assert said(capsys) == []


def test_eval_threads_default_to_the_same_choice(tmp_path, machine):
    flags = ["eval", "--model", str(tmp_path / "model"), "--task", str(tmp_path / "t.jsonl")]
    parser = build_parser(only=["eval"])
    machine(4, 1.2)
    assert spec_from_args(parser.parse_args(flags)).threads == 3
    assert default_threads(None) == (
        3, "the machine is busy (load 1.2 on 4 cores): using 3 torch threads; set --threads N "
           "to choose")
    assert spec_from_args(parser.parse_args([*flags, "--threads", "2"])).threads == 2
    assert default_threads(2) == (2, None)
    settings.contention.cache_clear()
    machine(4, 0.1)
    assert spec_from_args(parser.parse_args(flags)).threads is None  # torch's default


def test_a_process_pinned_to_some_cores_counts_their_share_of_the_load(monkeypatch):
    """getloadavg is the whole machine's: 32 runnable tasks on a 64-core host leave about half
    of a 4-core container's cores idle, not none."""
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(settings.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(settings.os, "getloadavg", lambda: (32.0, 0.0, 0.0))
    assert settings.load() == 2.0
    assert settings.threads_for(settings.cores(), settings.load()) == 2

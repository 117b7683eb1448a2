"""The reward as a Ray Serve deployment (`distributed.reward.serve`): a GRPO run whose reward is
served by autoscaling replicas scores every sample as the one-process run does; killing a
replica while it has calls in flight costs exactly those calls (failed, counted as
`reward/errors` and `reward/lost_calls`) and the run goes on to its last step."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from small_runs import small_run_config

from reroll.config.schema import MathReward
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.rlvr import train
from reroll.rewards import build_reward
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

SERVED = {"executor": "ray", "reward": {"num_cpus": 0.5,
                                        "serve": {"min_replicas": 1, "max_replicas": 2}}}


def make_config(tmp_path: Path, tiny_model: str, arithmetic: dict, name: str, steps: int = 2,
                **distributed):
    return small_run_config(tmp_path, tiny_model, arithmetic, name, steps=steps, **distributed)


def test_served_reward_scores_as_the_one_process_run(ray_session, tmp_path, tiny_model,
                                                     arithmetic):
    local = train(make_config(tmp_path, tiny_model, arithmetic, "local"))
    served = train(make_config(tmp_path, tiny_model, arithmetic, "served", **SERVED))
    rows, local_rows = read_metrics(tmp_path / "served"), read_metrics(tmp_path / "local")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["train/reward_mean"] for r in rows] == [r["train/reward_mean"] for r in local_rows]
    assert (served["eval_reward_start"], served["eval_reward_end"]) == (
        local["eval_reward_start"], local["eval_reward_end"])
    assert all(r["reward/errors"] == 0 and r["reward/lost_calls"] == 0 for r in rows)
    assert all(1 <= r["reward/replicas"] <= 2 for r in rows)


class SlowReward:
    """The math reward after `delay_s`, with a marker file named after its replica for as long
    as the call is in flight (so a test knows which replica to kill, and when)."""

    def __init__(self, marks: str, delay_s: float):
        self.inner = build_reward(MathReward())
        self.name, self.marks, self.delay_s = "slow_math", Path(marks), delay_s

    async def __call__(self, sample):
        import ray

        mark = self.marks / f"{ray.get_runtime_context().get_actor_name()}@{uuid.uuid4().hex}"
        mark.touch()
        await asyncio.sleep(self.delay_s)
        result = await self.inner(sample)
        mark.unlink()
        return result


def test_killed_replica_costs_only_its_calls_in_flight(ray_session, tmp_path, tiny_model,
                                                       arithmetic, monkeypatch):
    import ray

    from reroll.tracking import Tracker

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas rebuild SlowReward
    marks = tmp_path / "marks"
    marks.mkdir()
    two = {"executor": "ray", "reward": {"num_cpus": 0.5, "serve": {
        "min_replicas": 2, "max_replicas": 2, "max_ongoing_requests": 16}}}
    config = make_config(tmp_path, tiny_model, arithmetic, "kill", steps=3, **two)
    killed: dict[str, str] = {}
    run_over, replaced = threading.Event(), threading.Event()

    def kill_a_busy_replica():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = (tmp_path / "kill" / "metrics.jsonl").exists() and read_metrics(
                tmp_path / "kill")
            busy = [p.name.split("@")[0] for p in marks.iterdir()]
            if done and busy:  # after step 1, while a replica has calls in flight
                killed["replica"] = busy[0]
                killed_at = time.monotonic()
                ray.kill(ray.get_actor(busy[0], namespace="serve"), no_restart=True)
                break
            time.sleep(0.05)
        # Serve starts a replacement: a second live replica besides the survivor. (Whether it is
        # RUNNING before the 3-step run ends is a race with the run, not what is tested here.)
        prefix = "SERVE_REPLICA::reroll-kill-reward#"
        while "replica" in killed and not run_over.is_set():
            others = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(prefix) and a["name"] != killed["replica"]]
            if len(others) >= 2:
                killed["replaced"] = f"after {time.monotonic() - killed_at:.1f} s"
                replaced.set()
                return
            time.sleep(0.1)

    log = Tracker.log

    def log_then_wait_for_the_replacement(self, step, metrics):
        log(self, step, metrics)
        # The kill falls in step 2; step 3 starts once Serve has a replacement, or after a minute:
        # under load the 3-step run could otherwise end (and its application be deleted) first.
        if step == 2 and "replica" in killed:
            replaced.wait(timeout=60)

    monkeypatch.setattr(Tracker, "log", log_then_wait_for_the_replacement)

    killer = threading.Thread(target=kill_a_busy_replica, daemon=True)
    killer.start()
    summary = train(config, TaskInputs(functools.partial(SlowReward, str(marks), 0.5)))
    run_over.set()
    killer.join(timeout=5)
    assert killed, "no replica was killed"
    rows = read_metrics(tmp_path / "kill")
    assert [r["step"] for r in rows] == [1, 2, 3]  # the run went on to its end
    assert summary["restarts"] == 0
    last = rows[-1]
    lost = [p for p in marks.iterdir() if p.name.startswith(killed["replica"] + "@")]
    # The calls in flight on the killed replica failed, each counted, and nothing else did: the
    # other replica scored the rest of the step (16 calls) and every later one.
    # Marks are not lost calls one for one: a replica starts a call as soon as it accepts it, and
    # Serve's router retries on another replica a call whose replica died before the router read
    # that acceptance (ray/serve/_private/router.py, ActorDiedError). Measured (marks, lost calls,
    # errors): (5, 4, ?) in a fresh clone, then (8, 8, 8), (3, 1, 1), (1, 1, 1) on 2026-11-25.
    print({"marks": len(lost), "lost_calls": last["reward/lost_calls"],
           "errors": last["reward/errors"], "replaced": killed.get("replaced")})
    # Each lost call is counted and is an error; none beyond those in flight on the killed
    # replica. (1, 0, 0) was seen once, on 2026-11-28 under load: the one call in flight was
    # retried by the router, so a lost call is not required.
    assert len(lost) >= 1 and last["reward/lost_calls"] == last["reward/errors"] <= len(lost)
    assert rows[0]["reward/errors"] == 0 and last["reward/timeouts"] == 0
    assert killed.get("replaced"), "Serve did not replace the killed replica"
    assert rows[0]["reward/replicas"] == 2 and last["reward/replicas"] >= 1


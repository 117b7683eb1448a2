"""GRPO on a Ray cluster of three nodes started on this machine (`ray.cluster_utils.Cluster`,
each node with one CPU and its own custom resources or labels): the policy on the `train` node,
the engine on the `rollout` node, the reference (by resource) and the reward (by label) on the
CPU node, as `distributed.<role>.resources` / `labels` say. The run gives the same numbers as the
one-process run (the weights cross nodes through the object store, fingerprint-checked at every
sync), and so does one with two engines on two `rollout` nodes; a placement no node can meet
stops at start naming the role and what is missing (exit 2 from the CLI); losing the node that
hosts the engine mid-run re-places it on a live node and resumes from the last checkpoint; a
reward actor whose node is lost is restarted by Ray on another node."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml
from small_runs import small_run_config

from reroll.config import ConfigError, load_config
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.e2e]

NODE_CPUS = 1
PLACED = {
    "executor": "ray",
    "policy": {"resources": {"train": 1}},
    "rollout": {"num_cpus": 0.5, "resources": {"rollout": 1}},
    "reference": {"num_cpus": 0.5, "resources": {"cpu_node": 1}},
    "reward": {"num_cpus": 0.5, "labels": {"pool": "cpu"}},
}


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver, and the `train` node) plus a `rollout` node and a CPU-only node; shut
    down whole at the end (no raylet outlives the module)."""
    import ray
    from ray.cluster_utils import Cluster

    from reroll.distributed.ray_runtime import ensure_ray

    single_node = ray.is_initialized()  # the ray tier's session instance, in a run of both
    ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "resources": {"train": 1}, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=NODE_CPUS, resources={"rollout": 1})
        nodes.add_node(num_cpus=NODE_CPUS, resources={"cpu_node": 2}, labels={"pool": "cpu"})
        ray.init(address=nodes.address, include_dashboard=False, logging_level="WARNING")
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if single_node:  # give the ray tests that follow their instance back (conftest's size)
            ensure_ray(num_cpus=4)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model, arithmetic):
    """The one-process run every layout must reproduce: (summary, metrics rows)."""
    root = tmp_path_factory.mktemp("local")
    summary = train(make_config(root, tiny_model, arithmetic, "local"))
    return summary, read_metrics(root / "local")


@pytest.fixture(scope="module")
def second_rollout_node(cluster):
    """Another node offering `rollout` (a second engine's, or the engine's after a loss)."""
    return cluster.add_node(num_cpus=NODE_CPUS, resources={"rollout": 1})


def make_config(tmp_path: Path, tiny_model: str, arithmetic: dict, name: str, **distributed):
    return small_run_config(tmp_path, tiny_model, arithmetic, name, steps=3, checkpoint_every=1,
                            kl_coef=0.05, **distributed)


class NodeWatch:
    """Records the Ray node of each named role actor of a run while it runs."""

    ROLES = {"policy": "policy-0", "rollout": "rollout-0", "reference": "reference-0",
             "reward": "reward-0"}

    def __init__(self, run_name: str):
        self.prefix, self.nodes = f"reroll-{run_name}", {}
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import ray

        deadline = time.monotonic() + 120
        while len(self.nodes) < len(self.ROLES) and time.monotonic() < deadline:
            for role, suffix in self.ROLES.items():
                if role in self.nodes:
                    continue
                try:
                    actor = ray.get_actor(f"{self.prefix}-{suffix}")
                    method = actor.info if role == "reward" else actor.node_id
                    node = ray.get(method.remote(), timeout=30)
                except (ValueError, ray.exceptions.RayError):
                    continue  # not started yet
                self.nodes[role] = node["node_id"] if isinstance(node, dict) else node
            time.sleep(0.05)


def nodes_with(resource: str) -> set[str]:
    """The live nodes offering `resource`."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]}


def node_of(resource: str) -> str:
    [node] = nodes_with(resource)
    return node


def assert_same_run(rows: list[dict], summary: dict, local_run) -> None:
    """The numbers of the one-process run: the same samples (rewards, lengths) at every step
    mean every engine had the policy's exact weights; losses to float tolerance."""
    local, local_rows = local_run
    assert [r["step"] for r in rows] == [r["step"] for r in local_rows]
    for key in ("train/reward_mean", "train/response_len_mean"):
        assert [r[key] for r in rows] == [r[key] for r in local_rows], key
    for key in ("train/loss", "actor/kl_ref", "actor/entropy"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in local_rows], abs=1e-5)
    assert (summary["eval_reward_start"], summary["eval_reward_end"]) == (
        local["eval_reward_start"], local["eval_reward_end"])


def test_grpo_across_three_nodes_reproduces_the_one_process_run(cluster, tmp_path, tiny_model,
                                                                arithmetic, local_run):
    watch = NodeWatch("mn")
    spread = train(make_config(tmp_path, tiny_model, arithmetic, "mn", **PLACED))
    watch.thread.join(timeout=5)
    assert watch.nodes == {"policy": node_of("train"), "rollout": node_of("rollout"),
                           "reference": node_of("cpu_node"), "reward": node_of("cpu_node")}
    rows = read_metrics(tmp_path / "mn")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every sync checked the engine's fingerprint against the policy's (a mismatch stops the run).
    assert all(r["time/weight_sync_s"] > 0 and r["reward/errors"] == 0 for r in rows)
    assert_same_run(rows, spread, local_run)


def test_two_engines_on_two_nodes_serve_one_run(cluster, second_rollout_node, tmp_path,
                                               tiny_model, arithmetic, local_run):
    """`rollout.num_workers: 2`: an engine on each `rollout` node behind one pool; each request
    carries its own seed, so the run is still the one-process run."""
    import ray

    placed = {**PLACED, "rollout": {"num_workers": 2, "num_cpus": 0.5,
                                    "resources": {"rollout": 1}}}
    nodes: dict[str, str] = {}

    def watch_engines():
        deadline = time.monotonic() + 120
        while len(nodes) < 2 and time.monotonic() < deadline:
            for name in ("reroll-pool-rollout-0", "reroll-pool-rollout-1"):
                try:
                    nodes[name] = ray.get(ray.get_actor(name).node_id.remote(), timeout=30)
                except (ValueError, ray.exceptions.RayError):
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_engines, daemon=True)
    watcher.start()
    summary = train(make_config(tmp_path, tiny_model, arithmetic, "pool", **placed))
    watcher.join(timeout=5)
    assert set(nodes.values()) == nodes_with("rollout")  # one engine on each rollout node
    assert second_rollout_node.node_id in nodes_with("rollout")
    assert_same_run(read_metrics(tmp_path / "pool"), summary, local_run)


def test_a_placement_no_node_meets_stops_before_any_actor_waits(cluster, tmp_path, tiny_model,
                                                                arithmetic, capsys):
    import ray

    from reroll.cli import main

    config = make_config(tmp_path, tiny_model, arithmetic, "nowhere",
                         **{**PLACED, "rollout": {"resources": {"gpu_node": 1}}})
    with pytest.raises(ConfigError, match=r"distributed.rollout.resources: no node .* 'gpu_node'"):
        train(config)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("reroll-nowhere")]
    # From the command line: exit 2 and the message, no traceback. The reward is placed before
    # the models load, so its labels are checked first.
    make_config(tmp_path, tiny_model, arithmetic, "nolabel",
                **{**PLACED, "reward": {"labels": {"pool": "tpu"}}})
    assert main(["train", str(tmp_path / "nolabel.yaml")]) == 2
    out = "".join(capsys.readouterr())
    assert "distributed.reward.labels: no node of the Ray cluster has the label pool=tpu" in out
    assert "pool=cpu" in out and "Traceback" not in out
    assert not [a for a in ray.util.list_named_actors() if a.startswith("reroll-nolabel")]


def test_losing_the_engines_node_replaces_it_on_a_live_node_and_resumes(
        cluster, second_rollout_node, tmp_path, tiny_model, arithmetic):
    """With two `rollout` nodes, the node the engine lands on is removed after the step-2
    checkpoint; the restarted run finds the engine a place on the other one."""
    import ray

    config = make_config(tmp_path, tiny_model, arithmetic, "lost", **PLACED, max_restarts=1)
    config.steps = 4
    marker = tmp_path / "lost" / "checkpoints" / "step_2" / "trainer_state.pt"
    lost: dict[str, str] = {}

    def remove_the_engines_node():
        while not marker.exists():
            time.sleep(0.05)
        engine = ray.get_actor("reroll-lost-rollout-0")
        lost["node"] = ray.get(engine.node_id.remote())
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == lost["node"]))
        deadline = time.monotonic() + 120
        while "replaced" not in lost and time.monotonic() < deadline:
            try:  # the restarted run's engine
                node = ray.get(ray.get_actor("reroll-lost-rollout-0").node_id.remote(), timeout=10)
            except (ValueError, ray.exceptions.RayError):
                node = None
            if node not in (None, lost["node"]):
                lost["replaced"] = node
            time.sleep(0.05)

    killer = threading.Thread(target=remove_the_engines_node, daemon=True)
    killer.start()
    summary = train(config)
    killer.join(timeout=5)
    assert summary["restarts"] == 1
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert lost["node"] not in alive and len(alive) == 3
    assert "rollout" in alive[lost["replaced"]]  # the other rollout node took the engine
    rows = read_metrics(tmp_path / "lost")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps after the checkpoint were redone
    assert all(r.get("fault/restarts") == 1 for r in rows[2:])
    assert "fault/restarts" not in rows[0]
    assert lost["replaced"] in nodes_with("rollout")


def test_a_reward_actor_whose_node_is_lost_is_restarted_on_a_live_node(cluster):
    """Rewards are pure functions of the sample: Ray restarts the actor where the role's
    resource is still offered, and calls go on (`reward/actor_restarts` counts it)."""
    import asyncio
    import functools

    from reroll.config.schema import MathReward
    from reroll.distributed.reward_actor import start_reward_actors
    from reroll.rewards import build_reward
    from reroll.rewards.base import RewardSample

    first = cluster.add_node(num_cpus=NODE_CPUS, resources={"scorer": 1})
    second = cluster.add_node(num_cpus=NODE_CPUS, resources={"scorer": 1})
    sample = RewardSample(prompt="2+2?", response="\\boxed{4}", answer="4")
    reward = start_reward_actors(functools.partial(build_reward, MathReward()),
                                 [{"num_cpus": 0.5, "resources": {"scorer": 1}}])
    [actor] = reward.actors
    try:
        assert asyncio.run(reward(sample)).score == 1.0
        [node] = reward.node_ids()
        assert reward.queue_metrics()["reward/actor_restarts"] == 0
        cluster.remove_node(first if node == first.node_id else second)
        assert asyncio.run(reward(sample)).score == 1.0  # retried on the restarted actor
        [moved] = reward.node_ids()
        assert moved != node and moved in {first.node_id, second.node_id}
        assert reward.queue_metrics()["reward/actor_restarts"] == 1
    finally:
        reward.close()
    assert gone(actor)  # closed for good (`ray.kill` takes effect asynchronously)


def gone(actor, wait_s: float = 30) -> bool:
    """Whether the actor is dead within `wait_s` (and stays dead: no restart answers)."""
    import ray

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=wait_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


def agentic_config(tmp_path: Path, tiny_model: str, name: str, **distributed):
    data = {
        "pipeline": "agentic", "name": name, "output_dir": str(tmp_path / name), "seed": 3,
        "steps": 2, "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "algorithm": {"advantage": {"name": "rebn"}},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 2}, "checkpoint": {"every_steps": 0},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": distributed,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_environments_run_on_the_nodes_their_placement_names(cluster, tmp_path, tiny_model):
    """`distributed.env: {labels: {pool: cpu}}` (per-environment placement): every episode's
    environment lives in the env host on the CPU node, and the run is the one-process run."""
    import ray

    from reroll.pipelines.agentic import train_agentic

    hosts: list[str] = []

    def watch_env_host():
        deadline = time.monotonic() + 120
        while not hosts and time.monotonic() < deadline:
            try:
                host = ray.get_actor("reroll-agent-env-env-0")
                hosts.append(ray.get(host.info.remote(), timeout=30)["node_id"])
            except (ValueError, ray.exceptions.RayError):
                time.sleep(0.05)

    local = train_agentic(agentic_config(tmp_path, tiny_model, "agent-local"))
    watcher = threading.Thread(target=watch_env_host, daemon=True)
    watcher.start()
    placed = train_agentic(agentic_config(
        tmp_path, tiny_model, "agent-env", executor="ray",
        policy={"resources": {"train": 1}}, rollout={"num_cpus": 0.5, "resources": {"rollout": 1}},
        env={"num_cpus": 0.5, "labels": {"pool": "cpu"}}))
    watcher.join(timeout=5)
    assert hosts == [node_of("cpu_node")]
    rows, local_rows = read_metrics(tmp_path / "agent-env"), read_metrics(tmp_path / "agent-local")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("train/reward_mean", "env/turns_mean"):
        assert [r[key] for r in rows] == [r[key] for r in local_rows], key
    assert all(r["env/errors"] == 0 for r in rows)
    assert placed["eval_reward_end"] == local["eval_reward_end"]

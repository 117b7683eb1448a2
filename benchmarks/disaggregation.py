"""RollArt on this machine: an agentic rollout whose environment steps are CPU-heavy and whose
rewards come in bursts, run monolithic (every role on every node, taking turns) vs disaggregated
(generation on accelerator nodes, environments and rewards on a CPU node, the reward a Ray Serve
deployment that autoscales), on the same hardware and the same episodes.

The hardware: 2 modelled accelerators and this machine's 2 cores, split among the Ray nodes of
a `ray.cluster_utils.Cluster` started for each mode's run (its nodes alone, so the other mode's
idle actors and daemons take none of its cores). Every process of a node is pinned to that
node's cores (`os.sched_setaffinity`), so a node cannot borrow another node's core.

- monolithic: nodes `mono0` and `mono1`, each 1 accelerator + 1 core, each running half of the
  episodes as a synchronous loop: per turn, the accelerator decodes the node's batch while its
  core waits, then the core steps each environment while the accelerator waits; at the end the
  core scores the node's episodes (the burst of rewards).
- disaggregated: node `rollout` (2 accelerators: an engine each, continuous batching) and node
  `env` (both cores: 2 environment workers, and the reward's Serve replicas, MIN_REPLICAS to
  MAX_REPLICAS as calls queue up, through reroll's `start_reward_service` and `RewardRunner`).
  Each episode runs on its own (fine-grained asynchrony): its next turn is sent to an engine as
  soon as its environment step is done, and its reward is asked for as soon as it ends.

What is real: the environment steps and the rewards are CPU work (sha256 chains holding the GIL
for ENV_CPU_S and REWARD_CPU_S of their thread's CPU time, or `--work hashes`: ENV_HASHES and
REWARD_HASHES, whose time swings with the speed of this machine's CPU), Ray actors, nodes,
placement by node labels, the Serve deployment and its autoscaling, every call and its
queueing. What is modelled: the accelerators. This machine has none, so a decoding step is
a wait of STEP_S + PER_SEQ_S x b seconds for a batch of b sequences, holding the node's
accelerator but no CPU (a memory-bound GPU decode: a bigger batch costs little more per step),
and a response takes a step per token. Responses differ in length as a policy's do (uniform
over TOKENS x (1 +- LENGTH_SPREAD), the same lengths in both modes; `--length-spread 0` makes
them all TOKENS long): a monolithic node's turn lasts until its longest response is done, while
a disaggregated episode goes on as soon as its own is. The actions are a hash of the
observation (the policy's output depends on what the environment said). Not modelled: network
transfer between nodes (everything is on loopback), prefill, a real policy and real tasks.

The result depends on the share of accelerator time to CPU time: the monolithic run pays the sum
of the two, the disaggregated one at best their maximum. With the figures below they are close
(the regime RollArt targets: agentic tasks whose environments cost as much as the decoding). The
first decode of every episode finds the CPU with nothing to do in either mode, so the longer
the episodes (`--turns`), the closer the disaggregated run gets to that maximum.
Both modes compute the same rewards (checked). The modes alternate ROUNDS times; each keeps its
fastest run. Last line: JSON with `speedup` (monolithic time / disaggregated time) and, per
run, the CPU seconds of each part (`cpu_s`: the benchmark's work, the modelled engines' event
loops, Ray's and Serve's daemons, the driver, and other work on the machine, which a figure taken
beside it should be read against).

    .venv/bin/python benchmarks/disaggregation.py [--rounds R] [--episodes N] [--turns T]
        [--length-spread S] [--work cpu-time|hashes]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import threading
import time

import psutil
from rich.console import Console

from reroll.config.distributed import RewardServe
from reroll.distributed.reward_serve import start_reward_service
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.runner import RewardRunner

TURNS = 8
"""Turns of an episode (`--turns`): a decode and an environment step each."""
TOKENS, STEP_S, PER_SEQ_S = 48, 0.012, 0.0002
"""Decoding: a response of TOKENS tokens on average; a decoding step costs STEP_S + PER_SEQ_S
per sequence in the batch."""
LENGTH_SPREAD = 0.5
"""Responses are TOKENS x (1 +- LENGTH_SPREAD) tokens long, uniformly (`--length-spread`; 0: all
TOKENS long)."""
ENV_CPU_S, REWARD_CPU_S = 0.025, 0.030
"""CPU work of one environment step and of one reward: seconds of its thread's CPU time."""
ENV_HASHES, REWARD_HASHES = 50_000, 60_000
"""The same work as a fixed number of hashes (`--work hashes`): about 25 ms and 30 ms of one idle
core when the figures above were set; 27-54 ms and 32-65 ms on this machine since, from one
minute to the next."""
MIN_REPLICAS, MAX_REPLICAS = 2, 4
CORES = (0, 1)
console = Console(stderr=True)


def burn(seed: str, hashes: int) -> int:
    """`hashes` rounds of sha256 from `seed` (CPU work holding the GIL); a number from the end."""
    h = hashlib.sha256(seed.encode()).digest()
    for _ in range(hashes):
        h = hashlib.sha256(h).digest()
    return int.from_bytes(h[:4], "big")


def burn_cpu_s(seed: str, seconds: float) -> int:
    """`seconds` of this thread's CPU time hashing (holding the GIL); a number from `seed` alone.
    The cost is core-time, as the accelerator's is wall time: the speed of this machine's CPU
    swings by 2x from minute to minute, and a fixed count of hashes would move the workload
    between regimes (CPU-bound, decode-bound) from one round to the next. Two threads on one
    core each still get their `seconds` of it, so sharing a core still costs what it costs."""
    result = burn(seed, 1)
    end, h = time.thread_time() + seconds, seed.encode()
    while time.thread_time() < end:
        for _ in range(200):
            h = hashlib.sha256(h).digest()
    return result


def cpu_work(seed: str, seconds: float, hashes: int, cpu_time: bool) -> int:
    """The work of a step or a reward, as `--work` measures it: seconds of CPU time or hashes."""
    return burn_cpu_s(seed, seconds) if cpu_time else burn(seed, hashes)


def action_of(episode: int, turn: int, observation: int) -> int:
    """The modelled policy's output: a function of the episode's last observation."""
    return burn(f"a{episode}/{turn}/{observation}", 1) % 1000


def tokens_of(episode: int, turn: int, spread: float) -> int:
    """The length of an episode's response in a turn, from the seed alone (the same in both
    modes): uniform over the integers TOKENS x (1 +- spread), whose mean is TOKENS."""
    half = round(TOKENS * spread)
    return TOKENS - half + burn(f"n{episode}/{turn}", 1) % (2 * half + 1)


def env_step(episode: int, turn: int, action: int, cpu_time: bool) -> int:
    return cpu_work(f"e{episode}/{turn}/{action}", ENV_CPU_S, ENV_HASHES, cpu_time)


def decode_s(lengths: list[int]) -> float:
    """Decoding a batch that starts together to its last token: a step per token of the longest
    response, each costing PER_SEQ_S for every response not yet finished."""
    return STEP_S * max(lengths) + PER_SEQ_S * sum(lengths)


def pin(cores) -> None:
    os.sched_setaffinity(0, set(cores))


class BurnReward:
    """A stateless CPU-heavy reward (a verifier): a score in [0, 1) from the final observation."""

    name = "burn"

    def __init__(self, cores, cpu_time: bool):
        pin(cores)
        self.cpu_time = cpu_time

    def score(self, sample: RewardSample) -> float:
        return cpu_work(f"r{sample.prompt}/{sample.response}", REWARD_CPU_S, REWARD_HASHES,
                        self.cpu_time) % 1000 / 1000

    async def __call__(self, sample: RewardSample) -> RewardResult:
        # off the event loop, as reroll's own verifiers run (in a pool): a replica whose loop
        # is busy hashing cannot answer the Serve router's queue probes, and every call waits
        return RewardResult(await asyncio.to_thread(self.score, sample))


def sample_of(episode: int, observation: int) -> RewardSample:
    return RewardSample(prompt=str(episode), response=str(observation))


class MonolithicNode:
    """Every role on one node, taking turns: the accelerator decodes, then the core steps the
    environments, then (after the last turn) the core scores the episodes."""

    def __init__(self, cores, cpu_time: bool, spread: float):
        pin(cores)
        self.cpu_time, self.spread = cpu_time, spread
        self.reward = BurnReward(cores, cpu_time)

    def run(self, episodes: list[int], turns: int) -> dict[int, float]:
        observations = dict.fromkeys(episodes, 0)
        for turn in range(turns):
            actions = {e: action_of(e, turn, observations[e]) for e in episodes}
            # the accelerator, until the longest response is done; the core waits
            time.sleep(decode_s([tokens_of(e, turn, self.spread) for e in episodes]))
            for e in episodes:  # the core; the accelerator waits
                observations[e] = env_step(e, turn, actions[e], self.cpu_time)
        return {e: self.reward.score(sample_of(e, observations[e])) for e in episodes}


class Engine:
    """One modelled accelerator with continuous batching: each decoding step (STEP_S + PER_SEQ_S
    per sequence in the batch) serves every sequence in flight, and a request that arrives during
    a step joins at the next one. The modelled accelerator holds no CPU, so neither does its
    loop: it does not run at every step but only when a sequence is due to finish (a timer), and
    then replays the steps since it last ran (each arrival joining at its step). The timing is
    that of a step-by-step loop: the timer is set for the first finish if no more requests
    arrive; an arrival that could finish sooner (a short response) replays at once and moves it
    earlier, one that makes the steps slower leaves it early (the replay finds nothing due and
    sets it again)."""

    def __init__(self):
        self.active: list[list] = []  # [steps left, future, action] of the batch decoding now
        self.waiting: list[tuple[float, list]] = []  # (arrival time, sequence) to join the batch
        self.start = 0.0  # when the step in progress began (the event loop's clock)
        self.timer = None  # the loop's handle of the wake set for `self.due`
        self.due = 0.0

    async def generate(self, episode: int, turn: int, observation: int, tokens: int) -> int:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        now = loop.time()
        self.waiting.append((now, [tokens, future, action_of(episode, turn, observation)]))
        # it cannot finish before now + tokens steps of STEP_S: only an engine that is idle, or
        # whose wake is later than that, needs to replay and set its wake now
        if self.timer is None or now + tokens * STEP_S < self.due:
            self._schedule()
        return await future

    def _wake(self) -> None:
        self.timer = None
        self._schedule()

    def _schedule(self) -> None:
        """Replay to now, then make sure the timer fires by the next finish."""
        loop = asyncio.get_running_loop()
        self._replay(loop.time())
        if not self.active:
            return
        due = self._next_finish()
        if self.timer is not None:
            if self.due <= due:
                return
            self.timer.cancel()
        self.timer, self.due = loop.call_at(due, self._wake), due

    def _join(self) -> None:
        """The waiting sequences that arrived by the start of the step about to run join it."""
        while self.waiting and self.waiting[0][0] <= self.start:
            self.active.append(self.waiting.pop(0)[1])

    def _replay(self, now: float) -> None:
        """Every step that ended by `now`, in order; the sequences they finished get their
        result."""
        while True:
            if not self.active:
                if not self.waiting:
                    return
                self.start = max(self.start, self.waiting[0][0])  # idle: the arrival starts one
            self._join()
            end = self.start + STEP_S + PER_SEQ_S * len(self.active)
            if end > now:
                return
            self.start = end
            for seq in self.active:
                seq[0] -= 1
            for seq in self.active:
                if seq[0] == 0:
                    seq[1].set_result(seq[2])
            self.active = [seq for seq in self.active if seq[0] > 0]

    def _next_finish(self) -> float:
        """When the first sequence finishes if no more arrive: one in the batch after the step in
        progress and its steps left but one, or one waiting after it joins at the end of that
        step, and its steps; every step from there on with all of them."""
        end = self.start + STEP_S + PER_SEQ_S * len(self.active)
        steps = min([seq[0] - 1 for seq in self.active] + [seq[0] for _, seq in self.waiting])
        return end + steps * (STEP_S + PER_SEQ_S * (len(self.active) + len(self.waiting)))


class EnvWorker:
    """Environment steps on the CPU node."""

    def __init__(self, cores, cpu_time: bool):
        pin(cores)
        self.cpu_time = cpu_time

    def step(self, episode: int, turn: int, action: int) -> int:
        return env_step(episode, turn, action, self.cpu_time)


NODES = {
    "monolithic": [dict(num_cpus=1, resources={"accel": 1}, labels={"pool": "mono0"}),
                   dict(num_cpus=1, resources={"accel": 1}, labels={"pool": "mono1"})],
    "disaggregated": [dict(num_cpus=0, resources={"accel": 2}, labels={"pool": "rollout"}),
                      dict(num_cpus=2, labels={"pool": "env"})],
}
"""Each mode's Ray nodes: the same 2 modelled accelerators and 2 cores, split two ways."""


def start_cluster(mode: str):
    """A Ray cluster of `mode`'s nodes alone (and a head with no CPUs for the driver): each mode
    runs on its own deployment of the machine, so no idle node, actor or daemon of the other
    mode takes its cores."""
    import ray
    from ray.cluster_utils import Cluster

    # Quieter daemons, for both modes: no task events, metrics or event statistics from Ray;
    # Serve's controller deciding 4 times a second and its replicas reporting their load once
    # (10 and 10 times by default). Measured: Ray's and Serve's CPU in a 4-turn disaggregated
    # run 0.56-0.63 -> 0.35-0.41 core-s. The cluster's processes inherit this environment.
    os.environ.update(RAY_SERVE_CONTROL_LOOP_INTERVAL_S="0.25",
                      RAY_SERVE_METRICS_EXPORT_INTERVAL_MS="1000")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": {
            "task_events_report_interval_ms": 0, "enable_metrics_collection": False,
            "event_stats": False}})
    for node in NODES[mode]:
        cluster.add_node(**node)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    return cluster


class Monolithic:
    def __init__(self, cpu_time: bool, spread: float):
        import ray

        self.nodes = [ray.remote(MonolithicNode).options(
            num_cpus=1, resources={"accel": 1}, label_selector={"pool": f"mono{i}"}).remote(
            (CORES[i],), cpu_time, spread) for i in range(2)]

    def run(self, episodes: int, turns: int) -> dict[int, float]:
        import ray

        halves = [list(range(i, episodes, 2)) for i in range(2)]
        parts = ray.get([node.run.remote(half, turns)
                         for node, half in zip(self.nodes, halves, strict=True)])
        return {e: s for part in parts for e, s in part.items()}


class Disaggregated:
    def __init__(self, cpu_time: bool, spread: float):
        import ray

        self.spread = spread
        self.engines = [ray.remote(Engine).options(
            num_cpus=0, resources={"accel": 1}, label_selector={"pool": "rollout"},
            max_concurrency=1000).remote() for _ in range(2)]
        self.envs = [ray.remote(EnvWorker).options(
            num_cpus=0.5, label_selector={"pool": "env"},
            allow_out_of_order_execution=True).remote(CORES, cpu_time) for _ in range(2)]
        self.served = start_reward_service(
            functools.partial(BurnReward, CORES, cpu_time),
            # a replica per core of the env node stands ready for the burst (a new one takes
            # seconds to start, longer than the burst lasts), up to MAX_REPLICAS as calls queue;
            # each replica queues up to 8 calls itself, so the driver's router does not re-probe
            # the busy replicas for every queued call
            RewardServe(min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS,
                        target_ongoing_requests=2, max_ongoing_requests=8, upscale_delay_s=0.5,
                        downscale_delay_s=3),
            {"num_cpus": 0.25, "label_selector": {"pool": "env"}}, app="bench-reward")
        self.runner = RewardRunner(self.served, timeout_s=60)

    def run(self, episodes: int, turns: int) -> dict[int, float]:
        return asyncio.run(self._run(episodes, turns))

    async def _run(self, episodes: int, turns: int) -> dict[int, float]:
        # Each episode is a chain of calls, each taking the previous call's result: Ray's owner
        # (the driver's core worker) sends a call on as soon as its argument is ready, without
        # waking the driver's Python; the driver wakes once an episode, for its reward. The
        # calls go out turn by turn, the order in which they become ready; the environment
        # workers run theirs in the order their arguments arrive (allow_out_of_order_execution).
        observations = dict.fromkeys(range(episodes), 0)
        for turn in range(turns):
            for e in range(episodes):
                action = self.engines[e % 2].generate.remote(
                    e, turn, observations[e], tokens_of(e, turn, self.spread))
                observations[e] = self.envs[e % 2].step.remote(e, turn, action)

        async def reward(e: int) -> float:
            return (await self.runner.reward(sample_of(e, await observations[e]))).score

        scores = await asyncio.gather(*(reward(e) for e in range(episodes)))
        return dict(enumerate(scores))


ROLE_OF_PROCESS = (("MonolithicNode", "work"), ("EnvWorker", "work"), ("ServeReplica", "work"),
                   ("Engine", "engines"), ("raylet", "ray"), ("gcs_server", "ray"),
                   ("ServeController", "ray"), ("DashboardAgent", "ray"), ("log_monitor", "ray"),
                   ("ray::", "ray"), ("ray/", "ray"))
"""Which part of the run a process is, by its command line: the benchmark's own CPU work (the
environment steps and rewards, in whichever mode), the modelled engines' event loops, Ray's and
Serve's daemons and idle workers; the driver is this process; anything else is other work on
the machine."""


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's command line and CPU seconds so far."""
    out = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        times, cmd = proc.info["cpu_times"], " ".join(proc.info["cmdline"] or [])
        if times is not None:
            out[proc.pid] = (cmd, times.user + times.system)
    return out


def cpu_by_part(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each part of the run used between two `cpu_seconds()` snapshots."""
    parts = dict.fromkeys(("work", "engines", "ray", "driver", "other"), 0.0)
    for pid, (cmd, seconds) in after.items():
        part = "driver" if pid == os.getpid() else next(
            (p for key, p in ROLE_OF_PROCESS if key in cmd), "other")
        parts[part] += seconds - before.get(pid, (cmd, 0.0))[1]
    return {k: round(v, 2) for k, v in parts.items()}


class ReplicaWatch:
    """The most reward replicas alive at once (started or running) while a run lasts."""

    def __init__(self, served):
        self.served, self.most, self.stop = served, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        # once a second, the replicas' actors by name from Ray's GCS (0.5 ms a read): asking
        # Serve's controller for the application's status instead (`served.replicas()`, 29 ms a
        # read here) makes it build the details of every deployment, CPU on the 2 cores that the
        # monolithic run does not spend
        while not self.stop.wait(1.0):
            self.most = max(self.most, len(self.served.replica_names()))

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--length-spread", type=float, default=LENGTH_SPREAD,
                        help="responses are TOKENS x (1 +- this) tokens long (0: all the same)")
    parser.add_argument("--work", choices=("cpu-time", "hashes"), default="cpu-time",
                        help="an environment step and a reward cost their seconds of CPU time "
                             "(ENV_CPU_S, REWARD_CPU_S) or a fixed number of hashes")
    args = parser.parse_args()
    import ray

    modes = {"monolithic": Monolithic, "disaggregated": Disaggregated}
    cpu_time = args.work == "cpu-time"
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[dict]] = {m: [] for m in modes}
    replicas: list[int] = []
    scores, errors = {}, 0
    for _ in range(args.rounds):
        for name, mode_class in modes.items():
            cluster = start_cluster(name)
            try:
                mode = mode_class(cpu_time, args.length_spread)
                mode.run(2, args.turns)  # warm up every actor
                time.sleep(5)  # the new cluster's daemons settle, the replicas to their minimum
                served = getattr(mode, "served", None)
                watch = ReplicaWatch(served) if served else None
                before, start = cpu_seconds(), time.perf_counter()
                scores[name] = mode.run(args.episodes, args.turns)
                times[name].append(round(time.perf_counter() - start, 3))
                cpu[name].append(cpu_by_part(before, cpu_seconds()))
                if watch:
                    replicas.append(watch.close())
                    errors += mode.runner.counters.failed()
                    served.close()
            finally:
                ray.shutdown()
                cluster.shutdown()
            console.print(f"{name}: {times[name][-1]:.2f} s, CPU s {cpu[name][-1]}",
                          highlight=False)
        if scores["monolithic"] != scores["disaggregated"]:
            raise SystemExit("the two modes scored the episodes differently")
    mono, disagg = min(times["monolithic"]), min(times["disaggregated"])
    # the monolithic node of the even episodes: its accelerator's seconds in a run
    accel_s = sum(decode_s([tokens_of(e, turn, args.length_spread)
                            for e in range(0, args.episodes, 2)]) for turn in range(args.turns))
    print(json.dumps({
        "speedup": round(mono / disagg, 3), "monolithic_s": mono, "disaggregated_s": disagg,
        "runs": times, "cpu_s": cpu, "episodes": args.episodes, "turns": args.turns,
        "work": args.work, "length_spread": args.length_spread,
        "reward_replicas_max": replicas, "reward_failures": errors,
        "modelled_accelerator_s_per_node": round(accel_s, 3),
        "mean_reward": round(sum(scores["monolithic"].values()) / args.episodes, 4),
        "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()

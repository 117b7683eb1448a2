"""Several environments in one agentic run (`envs:`), mixed into every step by weight.

`EnvMixTask` is the task (`reroll.pipelines.task.Task`) the RL pipeline runs when an agentic
config has `envs:`. It holds one `agentic.EnvTask` per environment (its env id, turn limit,
context policy, seeds, eval set and failure counters) and, each step, splits
`rollout.prompts_per_step` groups between them with RLVR's domain mixer (`data.mixing`: fixed
weights, or weights that follow each env's moving success rate), the shares carried over so
each env's count stays within one group of its weighted share. The step's groups of every env
run concurrently in one event loop, as one env's groups do; every trajectory's
`reward_info["env"]` names its env. Metrics come per environment (`train/<name>/...`,
`eval/<name>/...`) besides the overall ones. An env that keeps failing stops the run, naming it
(its `max_failure_rate_*` bounds, as with one env). The mixer's state and each env's seed
stream and counters are in the checkpoint.

With `async_training`, one asynchronous source runs every env's groups: its producer draws env
seeds from a `MixedStream` (blocks of `prompts_per_step` groups split by the same mixer) and
each group's episodes run in its env's `EpisodeWork` (`EnvMixWork`); the checkpoint then keeps
the producer's mixer and streams and the groups it owed a resumed run.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from operator import itemgetter
from typing import Any

from reroll.config.agentic import AgenticConfig, EnvConfig
from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory, infra_failed
from reroll.data.mixing import DomainMixer
from reroll.engines.base import Engine, SamplingParams
from reroll.pipelines.task import EvalSet, held_out, rollout_row
from reroll.rollout.agent_loop import AgentStats, run_group
from reroll.rollout.async_episodes import EpisodeWork, add_stats
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.groups import Group, request_seed
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import MixedStream

SEED_STRIDE = 7919
"""Environment k draws its env seeds with `seed + k * SEED_STRIDE` (as RLVR's domains)."""


def env_mixer(config: AgenticConfig) -> DomainMixer:
    """The mixer of `envs` by `weight` and `env_mix` (`success_rate` observes each env's
    success rate where RLVR's `mean_reward` observes a domain's mean reward)."""
    m = config.env_mix
    return DomainMixer([e.weight for e in config.envs or []],
                       "fixed" if m.reweight == "fixed" else "mean_reward",
                       m.reweight_floor, m.reweight_momentum)


def where(k: int, name: str) -> str:
    return f"envs[{k}] ({name})"


def build_env(env_task, config: AgenticConfig, tokenizer, k: int, name: str, spec: EnvConfig):
    """Environment k's task (an `env_task`, `agentic.EnvTask`); a bad id, argument or context
    names its entry (`envs[1].id`)."""
    try:
        task = env_task(config, tokenizer, env=spec, seed_offset=k * SEED_STRIDE)
    except ConfigError as e:
        raise ConfigError(entry_message(str(e), k, name)) from None
    return task


def entry_message(message: str, k: int, name: str) -> str:
    """`env.id: ...` -> `envs[k].id (name): ...`: the error names the list entry."""
    found = re.match(r"env\.([\w.]+)(:?)", message)
    if found:
        return f"envs[{k}].{found.group(1)} ({name}){found.group(2)}{message[found.end():]}"
    return f"{where(k, name)}: {message}"


def run_mixed(jobs: list, seeds: list[list[int]], group_size: int, run_seed: int, step: int,
              redundancy: list[int]) -> list[tuple[list[Trajectory], AgentStats]]:
    """Each env's groups (`jobs[k]` on `seeds[k]`), all concurrently; group ids and request
    seeds count across the envs, so the step's groups stay distinct."""
    stats = [AgentStats() for _ in jobs]

    async def run() -> list[list[Trajectory]]:
        calls, g = [], 0
        for k, (job, env_seeds) in enumerate(zip(jobs, seeds, strict=True)):
            for seed in env_seeds:
                calls.append(run_group(job, seed, group_size, g,
                                       request_seed(run_seed, step, g * 1_000), stats[k],
                                       redundancy[k]))
                g += 1
        return await asyncio.gather(*calls)

    groups, out, start = asyncio.run(run()), [], 0
    for k, env_seeds in enumerate(seeds):
        part = groups[start:start + len(env_seeds)]
        out.append(([t for group in part for t in group], stats[k]))
        start += len(env_seeds)
    return out


def merged(stats: list[AgentStats]) -> AgentStats:
    """The counters of several calls summed (the step's `env/*` metrics over every env)."""
    total = AgentStats()
    for s in stats:
        add_stats(total, s)
    return total


def outcome(trajectories: list[Trajectory]) -> dict[str, float]:
    """Mean return, success rate and turns of the episodes that did not fail (infrastructure)."""
    valid = [t for t in trajectories if not infra_failed(t)]
    n = max(len(valid), 1)
    return {"reward_mean": sum(t.reward for t in valid) / n,
            "success_rate": sum(bool(t.reward_info.get("success", False)) for t in valid) / n}


class EnvMixTask:
    """The environments of `envs:`, mixed into every step by weight."""

    label = ""

    def __init__(self, config: AgenticConfig, tokenizer, inputs=None, *, env_task):
        """`env_task`: the task of one environment (`agentic.EnvTask`, which builds this)."""
        if inputs is not None and inputs.env_factory is not None:
            raise ConfigError("envs: environments passed as Python objects are not available "
                              "with several environments; give each entry an `id`")
        self.config, self.tokenizer = config, tokenizer
        self.names: list[str] = []
        self.tasks: list = []
        try:
            for k, (name, spec) in enumerate(config.env_list()):
                self.tasks.append(build_env(env_task, config, tokenizer, k, name, spec))
                self.names.append(name)
        except BaseException:
            self.close()
            raise
        self.mixer = env_mixer(config)
        self.source: AsyncSource | None = None
        """With `async_training`: the one producer of every env's episodes."""
        self.eval_sets: list[EvalSet] = []
        self._metrics: dict[str, float] = {}

    @property
    def evaluates(self) -> bool:
        return any(t.evaluates for t in self.tasks)

    @property
    def eval_what(self) -> str:
        return held_out(sum(len(t.eval_seeds) for t in self.tasks), "episode",
                        self.config.eval.samples_per_prompt)

    def start(self, engine: Engine) -> Engine:
        if self.config.async_training.enabled:
            stream = MixedStream([t.stream for t in self.tasks], self.mixer,
                                 self.config.rollout.prompts_per_step)
            self.source = AsyncSource(SourceSettings.of(self.config), engine, None,
                                      self.tokenizer, stream,
                                      work=lambda source: EnvMixWork(source, self.tasks,
                                                                     self.names))
            engine = self.source.engine
            for t in self.tasks:  # each evaluates through the producer's engine
                t.engine = engine
            return engine
        for t in self.tasks:
            t.start(engine)
        return engine

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        """Each env's share of the step's groups (`counts`), run together (async: taken from
        the producer, which drew them by the mixer)."""
        c = self.config
        if self.source is not None:
            sampled = self.source.next_batch(step, step - 1, params)
            results = [([t for t in sampled if t.reward_info["env"] == name], work.take_stats())
                       for name, work in zip(self.names, self.source.work.works, strict=True)]
            counts = [len({t.group_id for t in trajectories}) for trajectories, _ in results]
            observe = self.source.stream.observe  # the producer draws by the mixer meanwhile
        else:
            counts = self.mixer.counts(c.rollout.prompts_per_step)
            seeds = [t.sampler.next_batch(n) if n else [] for t, n in zip(self.tasks, counts,
                                                                           strict=True)]
            results = run_mixed([t.job(params) for t in self.tasks], seeds,
                                c.rollout.group_size, c.seed, step,
                                [t.env.redundancy for t in self.tasks])
            observe = self.mixer.observe
        batch, metrics = [], {}
        for k, (task, (trajectories, stats)) in enumerate(zip(self.tasks, results, strict=True)):
            task.account(stats)
            task.check_failure_rate(step)  # an env that keeps failing stops the run, named
            name = self.names[k]
            for t in trajectories:
                t.reward_info = {**t.reward_info, "env": name}
            if trajectories:
                observe(k, outcome(trajectories)["success_rate"])
            metrics |= self.env_metrics(k, counts[k], trajectories, stats)
            batch += trajectories
        everything = merged([s for _, s in results])
        success = [bool(t.reward_info.get("success", False)) for t in batch]
        self._metrics = metrics | everything.metrics() | {
            "train/success_rate": sum(success) / max(len(success), 1),
            "env/errors_total": float(sum(t.counters.env_errors for t in self.tasks))}
        if self.source is not None:
            self._metrics |= self.source.metrics() | {
                "rollout/episodes_restarted": float(self.source.work.restarted)}
        return batch

    def env_metrics(self, k: int, count: int, trajectories: list[Trajectory],
                    stats: AgentStats) -> dict[str, float]:
        p, s = f"train/{self.names[k]}/", stats.metrics()
        metrics = {p + "groups": float(count),
                   p + "share": count / self.config.rollout.prompts_per_step,
                   p + "env_errors": s["env/errors"],
                   p + "infra_failure_frac": s["env/infra_failure_frac"]}
        if trajectories:
            metrics |= {p + key: value for key, value in outcome(trajectories).items()}
            metrics[p + "turns_mean"] = s["env/turns_mean"]
        return metrics

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Each env's held-out metrics (`eval/<name>/...`) and the overall mean return and
        success rate over every held-out episode that did not fail."""
        metrics: dict[str, float] = {}
        self.eval_sets, everything = [], []
        for name, task in zip(self.names, self.tasks, strict=True):
            if not task.evaluates:
                continue
            own = task.evaluate(params)
            metrics |= {f"eval/{name}/" + key.removeprefix("eval/"): value
                        for key, value in own.items()}
            for s in task.eval_sets:  # one set per env, named as its metrics are
                for t in s.trajectories():
                    t.reward_info = {**t.reward_info, "env": name}
                    everything.append(t)
                self.eval_sets.append(replace(s, name=name))
        return metrics | {"eval/" + key: value for key, value in outcome(everything).items()}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        """Up to `count` rows, taken from the envs in turn (every env shows)."""
        by_env: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            by_env.setdefault(t.reward_info.get("env", ""), []).append(t)
        rows, queues = [], list(by_env.values())
        while len(rows) < count and any(queues):
            for queue in queues:
                if queue and len(rows) < count:
                    t = queue.pop(0)
                    rows.append(rollout_row(t) | {"env": t.reward_info.get("env")})
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Each env's counters and seed stream, and the mixer (async: the source's state, taken
        at one instant on the producer's loop: its mixer and streams, and the owed groups)."""
        envs = {name: task.state_dict() for name, task in zip(self.names, self.tasks,
                                                              strict=True)}
        if self.source is not None:
            return {"envs": envs, "async_source": self.source.state_dict()}
        return {"mixer": self.mixer.state_dict(), "envs": envs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("envs")
        if saved is None or set(saved) != set(self.names):
            raise ConfigError(f"resume: the checkpoint's environments ({sorted(saved or [])}) "
                              f"are not the config's envs ({self.names})")
        if (self.source is not None) != ("async_source" in state):
            raise ConfigError("resume: the checkpoint was written with async_training "
                              f"{'off' if self.source is not None else 'on'}; a run of several "
                              f"environments resumes in the mode it was written in")
        for name, task in zip(self.names, self.tasks, strict=True):
            task.load_state_dict(saved[name])
        if self.source is not None:  # after the tasks': the producer's positions win
            self.source.load_state_dict(state["async_source"])
        else:
            self.mixer.load_state_dict(state["mixer"])

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        for task in self.tasks:
            task.close()


class EnvMixWork:
    """The async producer's groups of several environments (`async_source.GroupWork`): a row is
    `(env index, env seed)` (`MixedStream`), and its group's episodes run in its env's
    `EpisodeWork`; every trajectory names its env (`reward_info["env"]`)."""

    def __init__(self, source: AsyncSource, tasks: list, names: list[str]):
        self.names = names
        self.works = [EpisodeWork(source, make_job=t.job, redundancy=t.env.redundancy,
                                  seed_of=itemgetter(1)) for t in tasks]

    def new_group(self, index: int, row: tuple[int, int], version: int) -> Group:
        return self.works[row[0]].new_group(index, row, version)

    async def run(self, group: Group, params: SamplingParams) -> bool:
        return await self.works[group.row[0]].run(group, params)

    def gives_up(self, group: Group, floor: int) -> bool:
        return self.works[group.row[0]].gives_up(group, floor)

    def trajectories(self, group: Group, group_id: int) -> list[Trajectory]:
        k = group.row[0]
        return [replace(t, reward_info=t.reward_info | {"env": self.names[k]})
                for t in self.works[k].trajectories(group, group_id)]

    @property
    def restarted(self) -> int:
        """Episodes restarted for staleness, over the envs."""
        return sum(w.restarted for w in self.works)

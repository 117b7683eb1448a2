"""Asynchronous agentic training: the async source's groups (`reroll.rollout.async_source`) as
an env seed's episodes instead of a prompt's responses. The producer, its buffer, the staleness
bound, `max_ahead`, `order` and the checkpoint's owed groups are the async source's, unchanged;
this file says what one group is.

Every turn's request goes through the scheduler (`RolloutScheduler.generate_turn`), so a weight
update preempts it like an RLVR response: the turn keeps its tokens and resumes under the new
weights (partial rollout), and an episode's later turns sample from the newest weights. Each
token records the version that sampled it (`Trajectory.token_versions`, and the episode's
`Sample.token_versions`, from which the group's staleness is measured).

An episode that would hold tokens older than `async_training.max_staleness` versions behind the
engine cannot be trained. With `async_training.restart_stale_episodes` (the default) it starts
again from its reset on the current weights, with the same env seed and sampling seeds, at its
next turn or resumed request (or, when it had ended while a sibling ran on, once the group
ends); otherwise its group is aborted and dropped, as RLVR's is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reroll.data.batch import Trajectory
from reroll.engines.base import Completion, Request, SamplingParams
from reroll.rollout.agent_loop import AgentJob, AgentStats, run_episode, run_group
from reroll.rollout.groups import Group, Sample, request_seed

if TYPE_CHECKING:
    from reroll.rollout.async_source import AsyncSource


class _Restart(Exception):
    """The episode grew too stale: start it again from its reset."""


class EpisodeGroups:
    """What the async source's groups of episodes share, whoever plays them (an env here, an
    agent program through the gateway in `reroll.rollout.async_agents`): `rollout.group_size`
    episodes (plus `redundancy` spares) seeded by the group's launch index, the staleness
    bound, the finished groups' trajectories and their episodes' counters (`stats`: the
    counters' class) until the trainer takes them."""

    def __init__(self, source: AsyncSource, redundancy: int = 0, stats: type = AgentStats):
        c = source.settings
        self.source, self.redundancy, self.stats = source, redundancy, stats
        self.size, self.seed = c.rollout.group_size, c.seed
        self.max_staleness = c.async_training.max_staleness
        self.restart = c.async_training.restart_stale_episodes
        self.results: dict[int, tuple[list[Trajectory], Any]] = {}
        self.taken = stats()
        """The episodes of the groups handed to the trainer since the last `take_stats`."""
        self.restarted = 0

    def new_group(self, index: int, row: Any, version: int) -> Group:
        """`row` is what the episodes play (an env seed, an agent's task); the group's sampling
        seeds come from its launch index, so a resumed run's owed group samples with the seeds
        it had."""
        base = request_seed(self.seed, -2, index * 1_000)
        samples = [Sample(base + k) for k in range(self.size + self.redundancy)]
        return Group(index, row, [], 0, samples, start_version=version)

    def floor(self) -> int:
        """The oldest version the trainer can still take a group of (the engine's next trainer
        holds at least the engine's version)."""
        return self.source.engine.version - self.max_staleness

    def stale(self, sample: Sample) -> bool:
        oldest = sample.oldest_version
        return oldest is not None and oldest < self.floor()

    def gives_up(self, group: Group, floor: int) -> bool:
        """With restarts, a stale episode starts again (its group is not given up)."""
        if self.restart:
            return False
        return any(s.token_versions for s in group.samples) and group.version < floor

    def trajectories(self, group: Group, group_id: int) -> list[Trajectory]:
        trajectories, stats = self.results.pop(group.index)
        add_stats(self.taken, stats)
        return [dataclasses.replace(t, group_id=group_id, policy_version=group.version,
                                    reward_info=t.reward_info | _versions(t))
                for t in trajectories]

    def take_stats(self):
        stats, self.taken = self.taken, self.stats()
        return stats

    async def turn(self, group: Group, sample: Sample, request: Request,
                   check: Callable[[], None]) -> Completion:
        """One request of episode `sample` through the scheduler (preempted and resumed at a
        weight update; `check` may raise to give it up), its tokens recorded on the sample."""
        completion = await self.source.scheduler.generate_turn(group, sample, request, check)
        sample.tokens += completion.token_ids
        sample.logprobs += completion.logprobs
        sample.token_versions += completion.token_versions or []
        return completion


class EpisodeWork(EpisodeGroups):
    """An env seed's `rollout.group_size` episodes (plus `redundancy` spares) as one group of
    the async source. `make_job(params)` is the task's AgentJob (env, format, limits)."""

    def __init__(self, source: AsyncSource, make_job: Callable[[SamplingParams], AgentJob],
                 redundancy: int = 0, seed_of: Callable[[Any], int] = lambda row: row):
        """`seed_of`: a group's env seed from its row (the row is the seed; several envs'
        rows are `(env index, seed)`, `reroll.rollout.stream.MixedStream`)."""
        super().__init__(source, redundancy)
        self.make_job, self.seed_of = make_job, seed_of

    async def run(self, group: Group, params: SamplingParams) -> bool:
        job = self.make_job(params)
        stats = AgentStats()
        job = dataclasses.replace(job, engine=_GroupEngine(self, group))
        played: dict[int, list[Trajectory]] = {}

        async def episode(k: int, on_request: Callable[[str], None]) -> list[Trajectory]:
            played[k] = await self._episode(job, group, k, stats, on_request)
            return played[k]

        trajectories = await run_group(job, self.seed_of(group.row), self.size, group.index,
                                       group.samples[0].seed, stats, self.redundancy, episode)
        if self.restart:  # episodes that ended while a sibling ran on, and went stale meanwhile
            kept = [k for k, result in sorted(played.items())
                    if any(result[0] is t for t in trajectories)]
            while not group.cancelled and (stale := [k for k in kept
                                                     if self.stale(group.samples[k])]):
                self.restarted += len(stale)
                for k in stale:
                    group.samples[k].tokens, group.samples[k].token_versions = [], []
                await asyncio.gather(*(episode(k, lambda _: None) for k in stale))
            trajectories = [t for k in kept for t in played[k]]
        if group.cancelled:  # the source is closing
            return False
        self.results[group.index] = trajectories, stats
        return True

    async def _episode(self, job: AgentJob, group: Group, k: int, stats: AgentStats,
                       on_request: Callable[[str], None]) -> list[Trajectory]:
        sample = group.samples[k]
        while True:
            engine = _EpisodeEngine(self, group, sample, job.engine)
            try:
                return await run_episode(dataclasses.replace(job, engine=engine),
                                         self.seed_of(group.row),
                                         sample.seed, group.index, stats, on_request)
            except _Restart:
                self.restarted += 1
                sample.tokens, sample.logprobs, sample.token_versions = [], [], []


def _versions(t: Trajectory) -> dict[str, list[int]]:
    """`policy_versions`: [oldest, newest] version of the episode's policy tokens (in its
    rollout row: how many weight updates it spanned)."""
    versions = [v for v in t.token_versions or [] if v >= 0]
    return {"policy_versions": [min(versions), max(versions)]} if versions else {}


def add_stats(total, more) -> None:
    """Episode counters (a dataclass of numbers, lists and dicts of numbers) summed into `total`."""
    for f in dataclasses.fields(total):
        mine, theirs = getattr(total, f.name), getattr(more, f.name)
        if isinstance(mine, dict):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value
        else:
            setattr(total, f.name, mine + theirs)


class _GroupEngine:
    """The group's engine as its AgentJob sees it: `abort` (a redundant episode's) by the id of
    the request it started, whatever piece of it runs now."""

    def __init__(self, work: EpisodeWork, group: Group):
        self.work, self.group = work, group
        self.samples: dict[str, Sample] = {}

    @property
    def version(self) -> int:
        return self.work.source.engine.version

    async def generate(self, request: Request) -> Completion:
        raise RuntimeError("episodes generate through their own _EpisodeEngine")

    def abort(self, request_id: str) -> None:
        sample = self.samples.get(request_id)
        if sample is not None:
            sample.dropped = True
            if sample.request_id is not None:
                self.work.source.scheduler.engines[self.group.engine].abort(sample.request_id)


class _EpisodeEngine:
    """One episode's engine: each turn through the scheduler (preempted and resumed at a weight
    update), its tokens' versions recorded on the episode's `Sample`; a turn that would start
    or resume with tokens out of the staleness bound restarts the episode (`_Restart`)."""

    def __init__(self, work: EpisodeWork, group: Group, sample: Sample, group_engine):
        self.work, self.group, self.sample = work, group, sample
        self.group_engine: _GroupEngine = group_engine

    @property
    def version(self) -> int:
        return self.work.source.engine.version

    async def generate(self, request: Request) -> Completion:
        self._check()
        self.group_engine.samples[request.request_id] = self.sample
        return await self.work.turn(self.group, self.sample, request, self._check)

    def _check(self) -> None:
        if self.work.restart and self.work.stale(self.sample):
            raise _Restart

    def abort(self, request_id: str) -> None:
        self.sample.dropped = True
        if self.sample.request_id is not None:
            self.work.source.scheduler.engines[self.group.engine].abort(self.sample.request_id)

"""Asynchronous training of an agent program through the gateway (`agent:` with
`async_training`): the async source's groups (`reroll.rollout.async_source`) as a task row's
harness episodes. The producer, its buffer, the staleness bound, `max_ahead`, `order` and the
checkpoint's owed groups are the async source's, unchanged (as for `env:` episodes,
`reroll.rollout.async_episodes`); this file says what one group is and how its calls reach the
engine.

Each episode opens its own gateway session whose engine (`Session.engine`) sends every call
through the producer's scheduler (`RolloutScheduler.generate_turn`), so a weight update treats a
call in flight as it treats an RLVR response: with `partial_rollout` (the default) it is
preempted, keeps its tokens and resumes under the new weights; with `partial_rollout: false` it
finishes under the old ones before the load; with `in_flight_updates` the new weights load
between two decoding steps. Each completion token records the version that sampled it
(`Call.token_versions`, then `Trajectory.token_versions`), and the episode's `Sample` gathers
them, so the group's staleness and the off-policy correction see what an env episode's see.

A harness cannot be rewound, so an episode that would hold tokens older than
`async_training.max_staleness` versions behind the engine is restarted whole: its session is
ended (the harness's next call, or the one resuming, gets 409 `session_ended`), the harness is
let finish, and the episode runs again from the start in a fresh session with the same task and
seeds (`rollout/episodes_restarted`). Without `restart_stale_episodes` its group is aborted and
never trained, as RLVR's is. A harness that crashes, times out or gives no reward stays an
infrastructure failure (masked, counted in `gateway/*`), as in a synchronous run.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NoReturn

from reroll.data.batch import Trajectory
from reroll.engines.base import Completion, Request, SamplingParams
from reroll.engines.http import OpenAIError
from reroll.rollout.async_episodes import EpisodeGroups, add_stats
from reroll.rollout.gateway.agents import (
    AgentSpec,
    GatewayEpisodeStats,
    neutral_failures,
    run_episode,
)
from reroll.rollout.gateway.app import Gateway
from reroll.rollout.gateway.session import Session
from reroll.rollout.groups import Group, Sample

if TYPE_CHECKING:
    from reroll.rollout.async_source import AsyncSource


class AgentWork(EpisodeGroups):
    """A task row's `rollout.group_size` harness episodes as one group of the async source,
    each in its own session of `gateway`, run by `spec`."""

    def __init__(self, source: AsyncSource, gateway: Gateway, spec: AgentSpec):
        super().__init__(source, stats=GatewayEpisodeStats)
        self.gateway, self.spec = gateway, spec

    async def run(self, group: Group, params: SamplingParams) -> bool:
        played = await asyncio.gather(*(self._episode(group, k, params)
                                        for k in range(self.size)))
        # Episodes that ended while a sibling ran on, and went stale meanwhile, play again.
        while self.restart and not group.cancelled and (
                stale := [k for k in range(self.size) if self.stale(group.samples[k])]):
            self.restarted += len(stale)
            for k in stale:
                _forget(group.samples[k])
            again = await asyncio.gather(*(self._episode(group, k, params) for k in stale))
            for k, result in zip(stale, again, strict=True):
                played[k] = result
        if group.cancelled:  # aborted as stale, or the source is closing
            return False
        stats = GatewayEpisodeStats()
        for _, own in played:
            add_stats(stats, own)
        trajectories = [t for samples, _ in played for t in samples]
        neutral_failures(trajectories)
        self.results[group.index] = trajectories, stats
        return True

    async def _episode(self, group: Group, k: int, params: SamplingParams
                       ) -> tuple[list[Trajectory], GatewayEpisodeStats]:
        """Episode k of the group (its samples and counters), restarted while it goes stale."""
        sample = group.samples[k]
        while True:
            session = self.gateway.open(group.row, sample.seed)
            engine = _SessionEngine(self, group, sample, session)
            session.engine, session.params = engine, params
            stats = GatewayEpisodeStats()
            samples = await run_episode(self.gateway, self.spec, group.row, sample.seed,
                                        group.index, stats, session=session)
            if not engine.restarted or group.cancelled:
                return samples, stats
            self.restarted += 1
            _forget(sample)


def _forget(sample: Sample) -> None:
    sample.tokens, sample.logprobs, sample.token_versions = [], [], []


class _SessionEngine:
    """One episode's engine, called by the gateway for its session: each call runs on the
    producer's loop through the scheduler (preempted and resumed at a weight update), its
    tokens' versions recorded on the episode's `Sample`. A call that would start or resume with
    tokens out of the staleness bound, or whose group was aborted, ends the session (409)."""

    def __init__(self, work: AgentWork, group: Group, sample: Sample, session: Session):
        self.work, self.group, self.sample, self.session = work, group, sample, session
        self.restarted = False

    async def generate(self, request: Request) -> Completion:
        loop = self.work.source.loop
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._turn(request),
                                                                          loop))

    async def _turn(self, request: Request) -> Completion:
        self._check()
        completion = await self.work.turn(self.group, self.sample, request, self._check)
        self._check()  # aborted while it ran: the harness must not go on
        return completion

    def _check(self) -> None:
        if self.group.cancelled:
            self._end("its group was aborted (too stale to train, or the run is stopping)")
        if self.work.restart and self.work.stale(self.sample):
            self.restarted = True
            self._end("the episode is restarted on the current weights: its tokens fell "
                      "past async_training.max_staleness")

    def _end(self, why: str) -> NoReturn:
        self.work.gateway.end(self.session)
        raise OpenAIError(409, f"session {self.session.id}: {why}", code="session_ended")

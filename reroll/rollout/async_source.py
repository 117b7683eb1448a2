"""The asynchronous rollout source (ROLL Flash): a producer thread keeps the rollout engine busy
in the background; kept groups wait in a `VersionedBuffer` and the trainer takes those within
`async_training.max_staleness` versions. At a weight update the running requests are aborted,
keep their tokens and resume under the new weights (partial rollout).

It exposes what the synchronous source (`reroll.rollout.scheduler.SyncSource`) does: `engine`
(what the pipeline loads weights into and evaluates with), `next_batch`, `metrics` and `close`;
only the source differs between the two modes, and both run groups on a `RolloutScheduler`.
The buffer (`VersionedBuffer`, at the end) is this source's alone.

A checkpoint keeps the trainer's position, not the producer's: the groups launched but not yet
trained (buffered or still running) are owed to the resumed run, which launches them again
first, under their own indices and seeds; their samples are regenerated, not kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow
from reroll.engines.base import Engine, Request, SamplingParams, WeightSyncError, fingerprint
from reroll.rewards.runner import RewardRunner
from reroll.rollout.groups import Group, State, request_seed
from reroll.rollout.metrics import staleness_metrics
from reroll.rollout.scheduler import RolloutScheduler, shutdown_engine, signal_keep
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream, encode_prompt
from reroll.rollout.tail_batching import AsyncTail, TailBatcher


class AsyncSource:
    """A producer on its own thread and event loop generates groups continuously; the trainer
    takes them from the buffer. `engine` is a facade over the rollout engine: generating through
    it (evaluation) runs on the producer's loop, and loading weights into it preempts the
    running requests, loads, and lets them resume."""

    def __init__(self, settings: SourceSettings, engine: Engine, rewards: RewardRunner | None,
                 tokenizer, stream: PromptStream, version: int = 0,
                 work: Callable[[AsyncSource], GroupWork] | None = None):
        """`work`: what one group is and how it runs (default: a prompt's responses, scored by
        `rewards`; agentic runs: an env seed's episodes, `reroll.rollout.async_episodes`)."""
        self.settings, self.stream, self.tokenizer = settings, stream, tokenizer
        a = settings.async_training
        self.groups_per_step = settings.rollout.prompts_per_step
        self.scheduler = RolloutScheduler([engine], rewards, tokenizer,
                                          settings.scheduler.max_running_per_engine)
        self.buffer = VersionedBuffer(a.max_staleness, self.groups_per_step * (a.max_staleness + 1),
                                      in_order=a.order == "start")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-producer",
                                       daemon=True)
        self.thread.start()
        self.engine = _ProducerEngine(engine, self, version)
        self.stop = threading.Event()
        self.consumed, self.in_flight = 0, 0
        self.next_index = 0
        """Groups launched so far (a group's index is its launch order; it sets its seeds)."""
        self.owed: deque[tuple[int, PromptRow]] = deque()
        """Groups a checkpoint owed this run (launched before it, never trained): launched first."""
        self._producer: asyncio.Future | None = None
        self.running: dict[asyncio.Task, Group] = {}
        """The producer's groups being generated (touched on the producer's loop only)."""
        self.stale_groups_aborted = 0
        tail = settings.tail_batching
        self.tail = AsyncTail(TailBatcher(tail.length_budget, tail.use_history),
                              self.groups_per_step) if tail.enabled else None
        """Tail batching (prompt groups only: the config refuses it for episodes and domains)."""
        self.work: GroupWork = (work or PromptWork)(self)
        self._params: SamplingParams | None = None
        self._metrics: dict[str, float] = {}
        self._idle_mark = 0.0

    # -- the trainer's side ----------------------------------------------------------------------

    def next_batch(self, step: int, version: int, params: SamplingParams) -> list[Trajectory]:
        if self._producer is None:
            # A resumed run's weights load first: nothing is generated from the initial ones.
            self.engine.wait_for_load()
            self._params = params
            self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)
            self._producer.add_done_callback(lambda f: self.buffer.close(
                f.exception() if not f.cancelled() else None))
        wait0 = self.buffer.wait_s
        taken = self.buffer.take(self.groups_per_step, version)
        self.consumed += len(taken)
        idle = self.scheduler.idle_seconds()
        groups = [b.group for b in taken]
        self._metrics = (staleness_metrics(groups, version) | self.scheduler.lifecycle_metrics()
                         | {"time/trainer_idle_s": self.buffer.wait_s - wait0,
                            "time/engine_idle_s": idle - self._idle_mark,
                            "rollout/stale_groups_dropped": float(self.buffer.dropped_stale_groups),
                            "rollout/stale_groups_aborted": float(self.stale_groups_aborted),
                            "rollout/buffered_groups": float(len(self.buffer))}
                         | (self.tail.metrics() if self.tail is not None else {}))
        self._idle_mark = idle
        return [t for i, b in enumerate(taken) for t in self.work.trajectories(b.group, i)]

    def metrics(self) -> dict[str, float]:
        return self._metrics

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the stream's position (the producer's), and the groups
        launched but not trained, which the resumed run owes. Taken on the producer's loop, so
        the stream and the groups are seen at one instant; the trainer is not taking then."""
        return asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop).result()

    async def _snapshot(self) -> dict:
        # The trainer's next batch is at version consumed // groups_per_step: what it would drop
        # as stale, or what the producer aborts as hopeless, is not owed.
        floor = self.consumed // self.groups_per_step - self.settings.async_training.max_staleness
        owed = dict(self.owed)
        owed |= {g.index: g.row for g in self.buffer.waiting(floor)}
        owed |= {g.index: g.row for task, g in self.running.items()
                 if not task.done() and not g.cancelled and not self.work.gives_up(g, floor)}
        if self.tail is not None:  # set aside for a long launch: owed under its first index
            owed |= dict(self.tail.waiting_groups())
        return {"sampler": self.stream.state_dict(),
                "async": {"consumed": self.consumed, "next_index": self.next_index,
                          "owed": [[i, self.stream.row_id(owed[i])] for i in sorted(owed)]}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` (before the first batch): the owed groups first."""
        self.stream.load_state_dict(state["sampler"])
        saved = state.get("async")
        if saved is None:  # a sync run's checkpoint, or one written before the groups were kept
            return
        self.consumed, self.next_index = saved["consumed"], saved["next_index"]
        self.owed = deque((i, self.stream.row(r)) for i, r in saved["owed"])
        indices = [i for i, _ in self.owed]
        first = min(indices, default=self.next_index)
        self.buffer.start_at(first, set(range(first, self.next_index)) - set(indices))

    def close(self) -> None:
        """Wait for the last weight load (its error is the run's), then stop the producer: abort
        what is running, end its tasks, stop its loop."""
        try:
            self.engine.wait_for_load()
        finally:
            self._stop_producer()

    def _stop_producer(self) -> None:
        self.stop.set()
        if self._producer is not None:
            try:
                self._producer.result(timeout=60)
            except BaseException:  # noqa: BLE001 - its failure was already handed to the trainer
                pass
        try:  # what is left (streams of aborted requests) ends before its loop closes
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self.loop).result(timeout=30)
        except BaseException:  # noqa: BLE001 - shutting down: a stuck task must not block it
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()
        shutdown_engine(self.engine.inner)

    # -- the producer's side (runs on self.loop) -------------------------------------------------

    async def _produce(self) -> None:
        running = self.running
        try:
            while not self.stop.is_set():
                if not self._may_start():
                    await asyncio.sleep(0.01)
                    continue
                index, row = self._next_row()
                group = self.work.new_group(index, row, self.engine.version)
                self.in_flight += 1
                task = asyncio.ensure_future(self._finish(group))
                running[task] = group
                task.add_done_callback(lambda t: running.pop(t, None))
                await asyncio.sleep(0)
        finally:
            self.scheduler.release()
            await self.scheduler.abort_groups(list(running.values()), dict(running))

    def _next_row(self) -> tuple[int, PromptRow]:
        """The next group's index and prompt: what a checkpoint owed first, then (tail
        batching) the prompts due for a long launch, then the stream."""
        tail = self.tail
        while True:
            if self.owed:
                return self.owed.popleft()
            long = tail.next_long() if tail is not None else None
            self.next_index += 1
            index = self.next_index - 1
            if long is not None:
                tail.launched_long(index)
                return index, long
            row = next(self.stream)
            if tail is None or not tail.sets_aside_known(index, row):
                return index, row
            self.buffer.skip(index)

    def abort_hopeless(self, version: int) -> None:
        """After the engine moved to `version`: running groups with tokens older than
        version - max_staleness can never be trained on (the next trainer holds `version`), so
        they are aborted now rather than decoded to the end and dropped."""
        floor = version - self.settings.async_training.max_staleness
        hopeless = {task: group for task, group in self.running.items()
                    if self.work.gives_up(group, floor)}
        if hopeless:
            self.stale_groups_aborted += len(hopeless)
            asyncio.ensure_future(self.scheduler.abort_groups(list(hopeless.values())))

    def _may_start(self) -> bool:
        """Start a group only if it will be taken within `max_ahead` (default: max_staleness)
        versions of the engine's: it will be taken at about step
        (consumed + buffered + running) // groups_per_step + 1."""
        a = self.settings.async_training
        ahead = a.max_staleness if a.max_ahead is None else a.max_ahead
        bound = ahead + self.engine.version + 1
        outstanding = self.consumed + len(self.buffer) + self.in_flight
        return outstanding < self.groups_per_step * bound

    async def _finish(self, group: Group) -> None:
        kept = False
        try:
            params = self._params if self.tail is None else self.tail.params(group.index,
                                                                              self._params)
            passed = await self.work.run(group, params)
            if group.cancelled:  # the source is closing
                return
            if self.tail is not None and self.tail.sets_aside(group):
                self.scheduler.lifecycle[State.FILTERED.value] += group.mark(State.FILTERED)
            elif passed:
                self.scheduler.lifecycle[State.KEPT.value] += group.mark(State.KEPT)
                self.buffer.put(BufferedGroup(group, group.version))
                kept = True
            else:
                self.scheduler.lifecycle[State.FILTERED.value] += group.mark(State.FILTERED)
        finally:
            self.in_flight -= 1
            if not kept:  # filtered, aborted or failed: an in-order buffer stops waiting for it
                self.buffer.skip(group.index)


class GroupWork(Protocol):
    """What the producer's groups are: how one is made from its row, run, given up as stale and
    turned into the trainer's trajectories."""

    def new_group(self, index: int, row, version: int) -> Group: ...

    async def run(self, group: Group, params: SamplingParams) -> bool:
        """Generate and score the group; whether it is kept (passes dynamic sampling)."""
        ...

    def gives_up(self, group: Group, floor: int) -> bool:
        """Whether the running group can no longer be trained (tokens older than `floor`)."""
        ...

    def trajectories(self, group: Group, group_id: int) -> list[Trajectory]: ...


class PromptWork:
    """RLVR's groups: a prompt's `rollout.group_size` responses, each scored as it finishes,
    kept by dynamic sampling."""

    def __init__(self, source: AsyncSource):
        c = source.settings
        self.source, self.size = source, c.rollout.group_size
        self.keep = signal_keep(c.refill_filter, self.size)
        # Async runs are not reproducible (timing decides versions); seeds stay distinct.
        self.seed_fn = functools.partial(request_seed, c.seed, -2)

    def new_group(self, index: int, row: PromptRow, version: int) -> Group:
        s = self.source
        prompt = encode_prompt(s.tokenizer, row, s.settings.prompt_budget())
        return s.scheduler.new_group(index, row, prompt, self.size, self.seed_fn, version=version)

    async def run(self, group: Group, params: SamplingParams) -> bool:
        await self.source.scheduler.run_group(group, params)
        return all(s.state is State.REWARDED for s in group.samples) and self.keep(group)

    def gives_up(self, group: Group, floor: int) -> bool:
        return _hopeless(group, floor)

    def trajectories(self, group: Group, group_id: int) -> list[Trajectory]:
        return group.trajectories(group_id)


def _hopeless(group: Group, floor: int) -> bool:
    """Whether the running group already has tokens older than version `floor`."""
    return any(s.token_versions for s in group.samples) and group.version < floor


def _copied(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights, copied: it goes on updating them in place while the copy loads."""
    return [(name, tensor.detach().clone()) for name, tensor in named_tensors]


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _ProducerEngine:
    """The rollout engine as seen from the trainer's thread (implements the Engine protocol)."""

    def __init__(self, inner: Engine, source: AsyncSource, version: int):
        self.inner, self.source, self.version = inner, source, version
        self._fingerprint: str | None = None
        self._pending_load: concurrent.futures.Future | None = None

    async def generate(self, request: Request):
        if self._pending_load is not None:  # evaluation samples from the latest weights
            await asyncio.wrap_future(self._pending_load)
        future = asyncio.run_coroutine_threadsafe(self.inner.generate(request), self.source.loop)
        return await asyncio.wrap_future(future)

    @property
    def publishes_weights(self) -> bool:
        """Whether weights can be handed over without waiting for the load (in-flight updates)."""
        return self.source.settings.async_training.in_flight_updates

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                        version: int) -> None:
        """Hand the weights over and return: the producer loads them between two decoding steps
        and checks there that the engine's fingerprint is that of the weights sent (a mismatch
        stops the producer, and the trainer's next batch raises it). At most one load is
        outstanding: the trainer first waits for the previous one, and gets its error."""
        self.wait_for_load()
        self._pending_load = asyncio.run_coroutine_threadsafe(
            self._swap(_copied(named_tensors), version, check=True), self.source.loop)

    def wait_for_load(self) -> None:
        """Block until the last published weights are loaded; raises what the load raised."""
        pending, self._pending_load = self._pending_load, None
        if pending is not None:
            pending.result()

    def abort(self, request_id: str) -> None:
        self.source.loop.call_soon_threadsafe(self.inner.abort, request_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        asyncio.run_coroutine_threadsafe(self._swap(_copied(named_tensors), version),
                                         self.source.loop).result()

    async def _swap(self, named: list, version: int, check: bool = False) -> None:
        try:
            await self._swap_now(named, version)
            if check and self._fingerprint != fingerprint(named):
                raise WeightSyncError(
                    f"after the weight load of step {version} the engine's weights fingerprint "
                    f"does not match the policy's: the engine would sample from stale weights")
        except BaseException as e:
            self.source.buffer.close(e)  # the waiting trainer raises it
            raise

    async def _swap_now(self, named: list, version: int) -> None:
        scheduler = self.source.scheduler
        a = self.source.settings.async_training
        t0 = time.perf_counter()
        if a.in_flight_updates:
            await self._load_between_steps(named, version)
        else:
            await (scheduler.preempt() if a.partial_rollout  # resumed under the new weights
                   else scheduler.drain())  # the running requests finish under the old ones
            try:
                await asyncio.to_thread(self.inner.load_weights, named, version)
                # Fingerprinted while nothing runs: checked later, it would compete with
                # decoding for the engine's CPU (seconds per step with an engine actor of 1 CPU).
                self._fingerprint = await asyncio.to_thread(self.inner.weights_fingerprint)
            finally:
                scheduler.release()
        self.version = version
        self.source.abort_hopeless(version)
        self.swap_s = time.perf_counter() - t0

    async def _load_between_steps(self, named: list, version: int) -> None:
        """In-flight update: nothing stops; the running requests' next tokens use the new weights."""
        if not getattr(self.inner, "in_flight_updates", False):
            raise ConfigError("async_training.in_flight_updates: this engine cannot load weights "
                              "while requests run; turn it off to use partial_rollout")
        if hasattr(self.inner, "actor"):  # in its own process, whose loop loads between steps
            await asyncio.to_thread(self.inner.load_weights, named, version)
            self._fingerprint = await asyncio.to_thread(self.inner.weights_fingerprint)
        else:  # this loop runs the engine's steps too, so none is running now
            self.inner.load_weights(named, version)
            self._fingerprint = self.inner.weights_fingerprint()

    def weights_fingerprint(self) -> str:
        """The fingerprint taken right after the last load (the weights cannot change until the
        next one), or the engine's own before any."""
        return self._fingerprint or self.inner.weights_fingerprint()


# -- the buffer between the producer and the trainer ---------------------------------------------


@dataclass
class BufferedGroup:
    group: Group
    version: int
    """Oldest policy version that generated any token of the group."""


class StaleBatchError(RuntimeError):
    """The producer stopped before the trainer got a batch (it failed or was closed)."""


class VersionedBuffer:
    """Completed groups wait here tagged with the policy version behind their oldest token. The
    trainer at version v takes only groups with staleness v - version <= max_staleness; older
    ones are dropped (and counted), never trained on. Producer and consumer run in different
    threads.

    Groups are handed out in the order they finished, or with `in_order` in the order they were
    started (`Group.index`, counted from 0): a finished group waits until every group started
    before it was put or skipped (`skip`: it will never come)."""

    def __init__(self, max_staleness: int, capacity_groups: int, in_order: bool = False):
        self.max_staleness = max_staleness
        self.capacity = capacity_groups
        self.in_order = in_order
        self._groups: deque[BufferedGroup] = deque()
        """Groups the trainer may take, in the order it takes them."""
        self._waiting: dict[int, BufferedGroup | None] = {}
        """In order: groups (None: skipped) finished after one started before them, by index."""
        self._next_index = 0
        self._cond = threading.Condition()
        self._closed: BaseException | bool = False
        self.dropped_stale_groups = 0
        self.wait_s = 0.0

    def put(self, group: BufferedGroup) -> None:
        with self._cond:
            if self.in_order:
                self._waiting[group.group.index] = group
                self._release_in_order()
            else:
                self._groups.append(group)
            self._cond.notify_all()

    def skip(self, index: int) -> None:
        """The group started as `index` will never be put (filtered, aborted or failed)."""
        if self.in_order:
            with self._cond:
                self._waiting[index] = None
                self._release_in_order()
                self._cond.notify_all()

    def _release_in_order(self) -> None:
        while self._next_index in self._waiting:
            group = self._waiting.pop(self._next_index)
            if group is not None:
                self._groups.append(group)
            self._next_index += 1

    def start_at(self, index: int, skipped: set[int]) -> None:
        """In order, after a resume: the first group to hand out is `index`; the groups in
        `skipped` (trained or given up before the checkpoint) will never come."""
        with self._cond:
            self._next_index = index
            self._waiting = dict.fromkeys(skipped)
            self._release_in_order()

    def waiting(self, floor: int) -> list[Group]:
        """The groups finished and not taken whose oldest token is of version `floor` or later
        (those the trainer may still take)."""
        with self._cond:
            buffered = list(self._groups) + [g for g in self._waiting.values() if g is not None]
            return [b.group for b in buffered if b.version >= floor]

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups) + sum(g is not None for g in self._waiting.values())

    def take(self, num_groups: int, version: int, timeout_s: float | None = None
             ) -> list[BufferedGroup]:
        """Block until `num_groups` groups with staleness <= max_staleness are available at
        trainer version `version`; groups found too stale on the way are dropped."""
        start = time.perf_counter()
        with self._cond:
            while True:
                self._drop_stale(version)
                if len(self._groups) >= num_groups:
                    taken = [self._groups.popleft() for _ in range(num_groups)]
                    self._cond.notify_all()
                    self.wait_s += time.perf_counter() - start
                    return taken
                if self._closed:
                    raise StaleBatchError(f"the rollout producer stopped: {self._closed!r}") \
                        from (self._closed if isinstance(self._closed, BaseException) else None)
                if not self._cond.wait(timeout_s):
                    raise TimeoutError(f"no batch of {num_groups} groups within {timeout_s}s")

    def _drop_stale(self, version: int) -> None:
        fresh = deque(g for g in self._groups if version - g.version <= self.max_staleness)
        self.dropped_stale_groups += len(self._groups) - len(fresh)
        self._groups = fresh

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed = error or True
            self._cond.notify_all()

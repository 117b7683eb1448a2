"""Rollout sources: what the pipeline loop asks for the next batch of scored trajectories.

- `SyncSource`: each step runs its own rounds on the engine (the trainer waits), optionally with
  dynamic-sampling refills, over-sampling and tail batching. Deterministic for a given seed.
- `AsyncSource` (ROLL Flash): a producer thread keeps the rollout engine busy in the background;
  kept groups wait in a `VersionedBuffer` and the trainer takes those within
  `async_training.max_staleness` versions. At a weight update the running requests are aborted,
  keep their tokens and resume under the new weights (partial rollout).

Both expose `engine` (what the pipeline loads weights into and evaluates with), `next_batch`,
`metrics` and `close`; only the source differs between the two modes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

import torch

from reroll import algorithms
from reroll.config.algorithm import DynamicSamplingConfig
from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.engines.base import Engine, Request, SamplingParams, WeightSyncError, fingerprint
from reroll.rewards.runner import RewardRunner
from reroll.rollout.buffer import BufferedGroup, VersionedBuffer
from reroll.rollout.sampling import encode_prompt, request_seed
from reroll.rollout.scheduler import CollectResult, Group, KeepFn, RolloutScheduler, State
from reroll.rollout.stream import PromptStream
from reroll.rollout.tail_batching import TailBatcher


def signal_keep(config: DynamicSamplingConfig | None, group_size: int) -> KeepFn:
    """Dynamic sampling's test of one group (the catalogue's filter), or keep-all."""
    if config is None:
        return lambda group: True

    def keep(group: Group) -> bool:
        return bool(algorithms.dynamic_sampling_keep(
            torch.tensor(group.rewards), group_size, drop_all_equal=config.drop_all_equal,
            min_mean=config.min_mean, max_mean=config.max_mean, min_std=config.min_std,
            max_std=config.max_std, atol=config.atol)[0])

    return keep


def staleness_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Staleness (trainer version - version of the oldest token) and the off-policy token share."""
    stale = [version - g.version for g in groups]
    tokens = sum(len(s.tokens) for g in groups for s in g.samples)
    behind = sum(v < version for g in groups for s in g.samples for v in s.token_versions)
    resumed = sum(s.resumes > 0 for g in groups for s in g.samples)
    return {"staleness/mean": sum(stale) / max(len(stale), 1),
            "staleness/max": float(max(stale, default=0)),
            "staleness/off_policy_token_frac": behind / max(tokens, 1),
            "rollout/resumed_samples": float(resumed)}


def lifecycle_metrics(scheduler: RolloutScheduler) -> dict[str, float]:
    """How many samples entered each state of their life since the last call (one step)."""
    counts = {f"rollout/samples_{s.value}": float(scheduler.lifecycle[s.value]) for s in State}
    scheduler.lifecycle.clear()
    return counts


def engine_metrics(engine) -> dict[str, float]:
    """What an engine reports of itself, if it does (an ElasticEngine: how much it lent)."""
    report = getattr(engine, "metrics", None)
    return report() if callable(report) else {}


def _shutdown(engine) -> None:
    shutdown = getattr(engine, "shutdown", None)  # an engine in its own process
    if shutdown is not None:
        shutdown()


class SyncSource:
    def __init__(self, config, engine: Engine, rewards: RewardRunner, tokenizer,
                 stream: PromptStream):
        self.config, self.engine, self.stream, self.tokenizer = config, engine, stream, tokenizer
        self.scheduler = RolloutScheduler([engine], rewards, tokenizer,
                                          config.scheduler.max_running_per_engine)
        tail = config.tail_batching
        self.tail = TailBatcher(tail.length_budget, tail.use_history) if tail.enabled else None
        self._metrics: dict[str, float] = {}

    def next_batch(self, step: int, version: int, params: SamplingParams) -> list[Trajectory]:
        c = self.config
        n, size = c.rollout.prompts_per_step, c.rollout.group_size
        signal = signal_keep(c.algorithm.dynamic_sampling if c.scheduler.refill_filtered else None,
                             size)
        if self.tail is None:
            result = self._collect(iter(self.stream), n, params, signal, step)
            self.stream.push_front(result.unused_rows)
            groups, metrics = result.groups, result.metrics
        elif self.tail.long_round_due(n):
            groups, metrics = self._long_round(n, params, signal, step)
        else:
            groups, metrics = self._regular_round(n, params, signal, step)
        self._metrics = (metrics | staleness_metrics(groups, version)
                         | lifecycle_metrics(self.scheduler))
        if self.tail is not None:
            self._metrics |= self.tail.metrics()
        return [t for i, g in enumerate(groups) for t in g.trajectories(i)]

    def _collect(self, rows, num_groups: int, params: SamplingParams, keep: KeepFn, step: int,
                 first_index: int = 0, oversample: float | None = None,
                 spare: int = 0) -> CollectResult:
        """One `scheduler.collect`; `first_index` offsets the seeds of a second wave in a step."""
        s, size = self.config.scheduler, self.config.rollout.group_size
        return asyncio.run(self.scheduler.collect(
            rows, self.encode, num_groups, size, params,
            lambda i: request_seed(self.config.seed, step, first_index * (size + spare) + i),
            keep=keep, oversample=s.oversample if oversample is None else oversample,
            max_groups=math.ceil(num_groups * s.max_groups_factor), spare=spare))

    def _regular_round(self, n: int, params: SamplingParams, signal: KeepFn, step: int):
        """A round under the length budget. Groups that reach it are deferred, not filtered: they
        do not count against `scheduler.max_groups_factor`, and more waves run until the batch is
        full (bounded by one pass over the data, in case nearly every prompt runs long)."""
        tail = self.tail
        params = replace(params, max_new_tokens=min(tail.budget, params.max_new_tokens))
        keep = lambda g: not tail.too_long(g) and signal(g)  # noqa: E731
        groups, metrics, launched = [], Counter(), 0
        limit = len(self.stream.sampler.rows) + math.ceil(n * self.config.scheduler.max_groups_factor)
        size = self.config.rollout.group_size
        spare = math.ceil(size * self.config.tail_batching.response_oversample) - size
        while len(groups) < n and launched < limit:
            result = self._collect(tail.regular_rows(self.stream), n - len(groups), params, keep,
                                   step, first_index=launched, spare=spare)
            self.stream.push_front(result.unused_rows)
            tail.observe(result.groups + result.dropped)
            deferred = [g for g in result.dropped if tail.too_long(g)]
            for group in deferred:
                tail.defer(group.row)
            groups += result.groups
            metrics.update(result.metrics)
            launched += int(result.metrics["rollout/groups_launched"])
            if not deferred:  # short only if dynamic sampling's cap was reached (documented)
                break
        return groups, dict(metrics) | {"tail/long_round": 0.0}

    def _long_round(self, n: int, params: SamplingParams, signal: KeepFn, step: int):
        """The deferred prompts with the full `max_new_tokens`. No over-sampling unless dynamic
        sampling may drop groups: every group here is slow, so extra ones only add work."""
        c = self.config
        refill = c.algorithm.dynamic_sampling is not None and c.scheduler.refill_filtered
        result = self._collect(self.tail.long_round_rows(self.stream), n, params, signal, step,
                               oversample=None if refill else 1.0)
        self.tail.hand_back(result.unused_rows, self.stream)
        self.tail.observe(result.groups + result.dropped)
        return result.groups, result.metrics | {"tail/long_round": 1.0}

    def encode(self, row) -> list[int]:
        return encode_prompt(self.tokenizer, row, self.config.data.max_prompt_tokens)

    def metrics(self) -> dict[str, float]:
        return self._metrics | engine_metrics(self.engine)

    def close(self) -> None:
        _shutdown(self.engine)


class AsyncSource:
    """A producer on its own thread and event loop generates groups continuously; the trainer
    takes them from the buffer. `engine` is a facade over the rollout engine: generating through
    it (evaluation) runs on the producer's loop, and loading weights into it preempts the
    running requests, loads, and lets them resume."""

    def __init__(self, config, engine: Engine, rewards: RewardRunner, tokenizer,
                 stream: PromptStream, version: int = 0):
        self.config, self.stream, self.tokenizer = config, stream, tokenizer
        a = config.async_training
        self.groups_per_step = config.rollout.prompts_per_step
        self.scheduler = RolloutScheduler([engine], rewards, tokenizer,
                                          config.scheduler.max_running_per_engine)
        self.buffer = VersionedBuffer(a.max_staleness, self.groups_per_step * (a.max_staleness + 1))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-producer",
                                       daemon=True)
        self.thread.start()
        self.engine = _ProducerEngine(engine, self, version)
        self.stop = threading.Event()
        self.consumed, self.in_flight = 0, 0
        self._producer: asyncio.Future | None = None
        self.running: dict[asyncio.Task, Group] = {}
        """The producer's groups being generated (touched on the producer's loop only)."""
        self.stale_groups_aborted = 0
        self._params: SamplingParams | None = None
        self._metrics: dict[str, float] = {}
        self._idle_mark = 0.0

    # -- the trainer's side ----------------------------------------------------------------------

    def next_batch(self, step: int, version: int, params: SamplingParams) -> list[Trajectory]:
        if self._producer is None:
            self._params = params
            self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)
            self._producer.add_done_callback(lambda f: self.buffer.close(
                f.exception() if not f.cancelled() else None))
        wait0 = self.buffer.wait_s
        taken = self.buffer.take(self.groups_per_step, version)
        self.consumed += len(taken)
        idle = self.scheduler.idle_seconds()
        groups = [b.group for b in taken]
        self._metrics = (staleness_metrics(groups, version) | lifecycle_metrics(self.scheduler)
                         | {"time/trainer_idle_s": self.buffer.wait_s - wait0,
                            "time/engine_idle_s": idle - self._idle_mark,
                            "rollout/stale_groups_dropped": float(self.buffer.dropped_stale_groups),
                            "rollout/stale_groups_aborted": float(self.stale_groups_aborted),
                            "rollout/buffered_groups": float(len(self.buffer))})
        self._idle_mark = idle
        return [t for i, b in enumerate(taken) for t in b.group.trajectories(i)]

    def metrics(self) -> dict[str, float]:
        return self._metrics

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
        _shutdown(self.engine.inner)

    # -- the producer's side (runs on self.loop) -------------------------------------------------

    async def _produce(self) -> None:
        c, size = self.config, self.config.rollout.group_size
        keep = signal_keep(c.algorithm.dynamic_sampling if c.scheduler.refill_filtered else None,
                           size)
        running = self.running
        index = 0
        try:
            while not self.stop.is_set():
                if not self._may_start():
                    await asyncio.sleep(0.01)
                    continue
                row = next(self.stream)
                # Async runs are not reproducible (timing decides versions); seeds stay distinct.
                seed_fn = functools.partial(request_seed, c.seed, -2)
                group = self.scheduler.new_group(index, row, self._encode(row), size, seed_fn,
                                                 version=self.engine.version)
                index += 1
                self.in_flight += 1
                task = asyncio.ensure_future(self._finish(group, keep))
                running[task] = group
                task.add_done_callback(lambda t: running.pop(t, None))
                await asyncio.sleep(0)
        finally:
            self.scheduler.release()
            await self.scheduler.abort_groups(list(running.values()), dict(running))

    def abort_hopeless(self, version: int) -> None:
        """After the engine moved to `version`: running groups with tokens older than
        version - max_staleness can never be trained on (the next trainer holds `version`), so
        they are aborted now rather than decoded to the end and dropped."""
        floor = version - self.config.async_training.max_staleness
        hopeless = {task: group for task, group in self.running.items()
                    if any(s.token_versions for s in group.samples) and group.version < floor}
        if hopeless:
            self.stale_groups_aborted += len(hopeless)
            asyncio.ensure_future(self.scheduler.abort_groups(list(hopeless.values())))

    def _may_start(self) -> bool:
        """Start a group only if it will be taken within `max_ahead` (default: max_staleness)
        versions of the engine's: it will be taken at about step
        (consumed + buffered + running) // groups_per_step + 1."""
        a = self.config.async_training
        ahead = a.max_staleness if a.max_ahead is None else a.max_ahead
        bound = ahead + self.engine.version + 1
        outstanding = self.consumed + len(self.buffer) + self.in_flight
        return outstanding < self.groups_per_step * bound

    async def _finish(self, group: Group, keep: KeepFn) -> None:
        try:
            await self.scheduler.run_group(group, self._params)
            if group.cancelled:  # the source is closing
                return
            if all(s.state is State.REWARDED for s in group.samples) and keep(group):
                self.scheduler.lifecycle[State.KEPT.value] += group.mark(State.KEPT)
                self.buffer.put(BufferedGroup(group, group.version))
            else:
                self.scheduler.lifecycle[State.FILTERED.value] += group.mark(State.FILTERED)
        finally:
            self.in_flight -= 1

    def _encode(self, row) -> list[int]:
        return encode_prompt(self.tokenizer, row, self.config.data.max_prompt_tokens)


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
        return self.source.config.async_training.in_flight_updates

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
        a = self.source.config.async_training
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


def build_source(config, engine: Engine, rewards: RewardRunner, tokenizer, stream: PromptStream,
                 version: int = 0) -> SyncSource | AsyncSource:
    """The source over `engine`, the engine the roles were built with (in its own process when
    `scheduler.engine_process` says so)."""
    if config.async_training.enabled:
        return AsyncSource(config, engine, rewards, tokenizer, stream, version)
    return SyncSource(config, engine, rewards, tokenizer, stream)

"""The synchronous rollout: the source the pipeline asks for each step's rewarded groups
(`SyncSource`), and the scheduler that runs them (`RolloutScheduler`). Each prompt becomes a group
of n requests whose samples move through
queued -> running -> finished -> rewarded -> kept | filtered | aborted (`reroll.rollout.groups`).

- `SyncSource`: each step runs its own rounds on the engine (the trainer waits), optionally with
  dynamic-sampling refills, over-sampling and tail batching (`reroll.rollout.tail_batching`).
  Deterministic for a given seed. The asynchronous source (`reroll.rollout.async_source`) runs
  the same scheduler on a producer thread instead.
- A cap on running requests per engine; a group's requests all go to one engine (prompt
  affinity, so the engine can reuse the prompt's prefix cache).
- Each completion is scored as soon as it finishes, while the others are still generating.
- `collect` fills a batch of groups that pass a keep test (dynamic sampling): it starts more
  groups than needed (over-sampling), replaces dropped groups, and aborts the remainder once the
  batch is full. The batch is the first groups *in launch order* that pass, so which groups are
  kept does not depend on timing: with per-request seeds a run stays deterministic.
- Speculative responses (RollPacker): a group may start more samples than it needs and keep
  the first ones to stop on their own, aborting the rest (`collect(spare=...)`).
- Partial rollout: `preempt` aborts every running request (before a weight update); the
  samples keep their tokens and logprobs and resume, as prompt + partial tokens, once `release`
  is called.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from reroll import algorithms
from reroll.config.algorithm import DynamicSamplingConfig
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow
from reroll.engines.base import Completion, Engine, Request, SamplingParams
from reroll.rewards.base import RewardSample
from reroll.rewards.runner import RewardRunner
from reroll.rollout.groups import (
    ENDED,
    CollectResult,
    Group,
    KeepFn,
    Sample,
    SeedFn,
    State,
    keep_all,
    request_seed,
)
from reroll.rollout.metrics import staleness_metrics
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import EncodedPrompt, PromptStream, encode_prompt
from reroll.rollout.tail_batching import TailBatcher


class SyncSource:
    """Each step runs its own rounds on the engine while the trainer waits: the batch is the
    first kept groups in launch order, so a run is deterministic for its seed."""

    def __init__(self, settings: SourceSettings, engine: Engine, rewards: RewardRunner,
                 tokenizer, stream: PromptStream):
        self.settings, self.engine, self.stream, self.tokenizer = (settings, engine, stream,
                                                                   tokenizer)
        self.scheduler = RolloutScheduler([engine], rewards, tokenizer,
                                          settings.scheduler.max_running_per_engine)
        tail = settings.tail_batching
        self.tail = TailBatcher(tail.length_budget, tail.use_history) if tail.enabled else None
        self._metrics: dict[str, float] = {}
        self.sampled: list[Group] = []
        """Every group the last `next_batch` collected, those dynamic sampling dropped included
        (what a domain's reward metrics describe: a step whose groups were all dropped for
        all-equal rewards still says what they scored)."""

    def next_batch(self, step: int, version: int, params: SamplingParams,
                   groups: int | None = None) -> list[Trajectory]:
        """`groups`: how many groups this step (None: `rollout.prompts_per_step`; a domain of
        a multi-domain run passes its share)."""
        c = self.settings
        self.sampled = []
        n, size = groups or c.rollout.prompts_per_step, c.rollout.group_size
        signal = signal_keep(c.refill_filter, size)
        if self.tail is None:
            result = self._collect(iter(self.stream), n, params, signal, step)
            self.stream.push_front(result.unused_rows)
            groups, metrics = result.groups, result.metrics
        elif self.tail.long_round_due(n):
            groups, metrics = self._long_round(n, params, signal, step)
        else:
            groups, metrics = self._regular_round(n, params, signal, step)
        self._metrics = (metrics | staleness_metrics(groups, version)
                         | self.scheduler.lifecycle_metrics())
        if self.tail is not None:
            self._metrics |= self.tail.metrics()
        return [t for i, g in enumerate(groups) for t in g.trajectories(i)]

    def _collect(self, rows, num_groups: int, params: SamplingParams, keep: KeepFn, step: int,
                 first_index: int = 0, oversample: float | None = None,
                 spare: int = 0) -> CollectResult:
        """One `scheduler.collect`; `first_index` offsets the seeds of a second wave in a step."""
        s, size = self.settings.scheduler, self.settings.rollout.group_size
        result = asyncio.run(self.scheduler.collect(
            rows, self.encode, num_groups, size, params,
            lambda i: request_seed(self.settings.seed, step, first_index * (size + spare) + i),
            keep=keep, oversample=s.oversample if oversample is None else oversample,
            max_groups=math.ceil(num_groups * s.max_groups_factor), spare=spare))
        self.sampled += result.groups + result.dropped
        return result

    def _regular_round(self, n: int, params: SamplingParams, signal: KeepFn, step: int):
        """A round under the length budget. Groups that reach it are deferred, not filtered: they
        do not count against `scheduler.max_groups_factor`, and more waves run until the batch is
        full (bounded by one pass over the data, in case nearly every prompt runs long)."""
        tail = self.tail
        params = replace(params, max_new_tokens=min(tail.budget, params.max_new_tokens))
        keep = lambda g: not tail.too_long(g) and signal(g)  # noqa: E731
        groups, metrics, launched = [], Counter(), 0
        c = self.settings
        limit = len(self.stream.sampler.rows) + math.ceil(n * c.scheduler.max_groups_factor)
        size = c.rollout.group_size
        spare = math.ceil(size * c.tail_batching.response_oversample) - size
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
        refill = self.settings.refill_filter is not None
        result = self._collect(self.tail.long_round_rows(self.stream), n, params, signal, step,
                               oversample=None if refill else 1.0)
        self.tail.hand_back(result.unused_rows, self.stream)
        self.tail.observe(result.groups + result.dropped)
        return result.groups, result.metrics | {"tail/long_round": 1.0}

    def encode(self, row) -> list[int]:
        return encode_prompt(self.tokenizer, row, self.settings.prompt_budget())

    def metrics(self) -> dict[str, float]:
        return self._metrics | engine_metrics(self.engine)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the stream's position (a step consumes exactly its rows)."""
        return {"sampler": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["sampler"])

    def close(self) -> None:
        shutdown_engine(self.engine)


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


def engine_metrics(engine) -> dict[str, float]:
    """What an engine reports of itself, if it does (an ElasticEngine: how much it lent)."""
    report = getattr(engine, "metrics", None)
    return report() if callable(report) else {}


def shutdown_engine(engine) -> None:
    """Stop an engine that runs in its own process (a no-op for one in this process)."""
    shutdown = getattr(engine, "shutdown", None)  # an engine in its own process
    if shutdown is not None:
        shutdown()


class RolloutScheduler:
    """Runs groups of requests on one or more engines and scores each completion as it finishes."""

    def __init__(self, engines: list[Engine], rewards: RewardRunner, tokenizer,
                 max_running_per_engine: int | None = None):
        self.engines, self.rewards, self.tokenizer = engines, rewards, tokenizer
        self.cap = max_running_per_engine
        self.lifecycle: Counter[str] = Counter()
        self._loop_state: _LoopState | None = None

    # -- one group -----------------------------------------------------------------------------

    def new_group(self, index: int, row: PromptRow, prompt: list[int] | EncodedPrompt,
                  group_size: int, seed_fn: SeedFn, version: int = 0) -> Group:
        """A queued group of `prompt` (its ids, or ids and model inputs), placed on the engine
        with the fewest running groups (affinity: all its requests go there)."""
        prompt = EncodedPrompt.of(prompt)
        state = self._state()
        engine = min(range(len(self.engines)), key=lambda e: (state.groups[e], e))
        state.groups[engine] += 1
        samples = [Sample(seed_fn(index * group_size + k), engine) for k in range(group_size)]
        self.lifecycle[State.QUEUED.value] += group_size
        return Group(index, row, prompt.ids, engine, samples, start_version=version,
                     model_inputs=prompt.model_inputs, images=prompt.images)

    async def run_group(self, group: Group, params: SamplingParams, needed: int | None = None
                        ) -> Group:
        """Generate and score the group's samples. With `needed` (fewer than its samples: the
        rest are speculative spares), the group keeps the first `needed` samples to stop on their
        own and aborts the others. Once too many have run to `max_new_tokens` for that, it ends
        at once (aborting the rest) and keeps every sample, so the ones that ran long show."""
        runs = [asyncio.ensure_future(self._run_sample(group, s, params)) for s in group.samples]
        try:
            if needed is None or needed >= len(group.samples):
                await asyncio.gather(*runs)
            else:
                await self._race(group, runs, needed)
        finally:
            self._state().groups[group.engine] -= 1
        return group

    async def _race(self, group: Group, runs: list[asyncio.Future], needed: int) -> None:
        """Wait until `needed` samples have stopped (EOS or a stop token), or until that can no
        longer happen; then abort the rest. Of the samples stopped by then, the first `needed` in
        index order are kept, so the choice does not depend on timing within a decoding step."""
        pending = set(runs)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for run in done:
                run.result()
            stopped = sum(_stopped(s) for s in group.samples)
            if stopped >= needed or stopped + len(pending) < needed:
                break
        for sample in group.samples:
            if sample.state not in (*ENDED, State.REWARDED, State.FINISHED):
                sample.dropped = True
                if sample.request_id is not None:
                    self.engines[group.engine].abort(sample.request_id)
        await asyncio.gather(*pending)
        kept = [s for s in group.samples if _stopped(s)][:needed]
        if len(kept) == needed:
            for sample in group.samples:
                if sample not in kept and sample.state is not State.ABORTED:
                    self._move(sample, State.ABORTED)
            group.samples = kept

    async def _run_sample(self, group: Group, sample: Sample, params: SamplingParams) -> None:
        state, engine = self._state(), self.engines[group.engine]
        async with state.slots[group.engine]:
            self._move(sample, State.RUNNING)
            while True:
                await state.open.wait()  # closed while the weights are being replaced
                if group.cancelled or sample.dropped:
                    sample.finish_reason = "abort"
                    break
                remaining = params.max_new_tokens - len(sample.tokens)
                request = Request(group.prompt_ids + sample.tokens,
                                  replace(params, max_new_tokens=remaining),
                                  seed=sample.seed + 7919 * sample.resumes,
                                  model_inputs=group.model_inputs, images=group.images)
                sample.request_id = request.request_id
                state.in_engine += 1
                try:
                    completion = await engine.generate(request)
                finally:
                    state.in_engine -= 1
                    state.changed.set()
                sample.request_id = None
                sample.add(completion)
                preempted = sample in state.preempted
                state.preempted.discard(sample)
                resumable = preempted and not (group.cancelled or sample.dropped)
                if completion.finish_reason == "abort" and resumable:
                    sample.resumes += 1
                    continue  # partial rollout: resume under the new weights
                break
        if sample.finish_reason == "abort":
            self._move(sample, State.ABORTED)
            return
        self._move(sample, State.FINISHED)
        sample.response_text = self.tokenizer.decode(sample.tokens, skip_special_tokens=True)
        result = await (group.scorer or self.rewards).reward(RewardSample(
            prompt=group.row.prompt_text, response=sample.response_text, answer=group.row.answer,
            finish_reason=sample.finish_reason, metadata=group.row.metadata))
        sample.reward, sample.reward_info = result.score, result.info
        self._move(sample, State.REWARDED)

    async def generate_turn(self, group: Group, sample: Sample, request: Request,
                            before_resume: Callable[[], None] | None = None) -> Completion:
        """One request of a multi-turn episode (`sample`: the episode's record), preempted and
        resumed around a weight update as `run_group`'s samples are: the pieces' tokens, logprobs
        and versions are joined into one completion (finish `abort` when the group was
        cancelled or the sample dropped). `before_resume` may raise to give the request up."""
        state, engine = self._state(), self.engines[group.engine]
        tokens, logprobs, versions, finish, version = [], [], [], "abort", 0
        piece, resumes = request, 0
        while True:
            await state.open.wait()  # closed while the weights are being replaced
            if group.cancelled or sample.dropped:
                break
            sample.request_id = piece.request_id
            self._enter(sample)
            state.in_engine += 1
            try:
                completion = await engine.generate(piece)
            finally:
                state.in_engine -= 1
                state.changed.set()
                sample.request_id = None
                self._leave(sample)
            tokens += completion.token_ids
            logprobs += completion.logprobs
            versions += (completion.token_versions
                         or [completion.policy_version] * len(completion.token_ids))
            finish, version = completion.finish_reason, completion.policy_version
            preempted = sample in state.preempted
            state.preempted.discard(sample)
            if finish != "abort" or not preempted or group.cancelled or sample.dropped:
                break
            if before_resume is not None:
                before_resume()
            resumes += 1
            sample.resumes += 1
            piece = Request(request.prompt_ids + tokens,
                            replace(request.params,
                                    max_new_tokens=request.params.max_new_tokens - len(tokens)),
                            seed=request.seed + 7919 * resumes)
        return Completion(request.request_id, request.prompt_ids, tokens, logprobs, finish,
                          version, versions)

    # -- a batch of groups -----------------------------------------------------------------------

    async def collect(self, rows: Iterator[PromptRow],
                      encode: Callable[[PromptRow], list[int] | EncodedPrompt],
                      num_groups: int, group_size: int, params: SamplingParams, seed_fn: SeedFn,
                      keep: KeepFn = keep_all, oversample: float = 1.0,
                      max_groups: int | None = None, spare: int = 0) -> CollectResult:
        """The first `num_groups` groups in launch order that pass `keep`.

        `oversample` x `num_groups` groups run at once; a dropped group is replaced by a new one;
        at most `max_groups` are started (then the batch may be short). Once the batch is
        decided, the groups still running are aborted. With `spare`, each group starts
        `group_size + spare` samples and keeps the first `group_size` to stop (`run_group`);
        its seeds are `seed_fn(index * (group_size + spare) + k)`.
        """
        target = max(num_groups, math.ceil(num_groups * oversample))
        max_groups = max(max_groups or num_groups, target)
        launched: list[Group] = []
        tasks: dict[asyncio.Task, Group] = {}

        def launch() -> None:
            row = next(rows)
            group = self.new_group(len(launched), row, encode(row), group_size + spare, seed_fn)
            launched.append(group)
            run = self.run_group(group, params, needed=group_size if spare else None)
            tasks[asyncio.ensure_future(run)] = group

        for _ in range(min(target, max_groups)):
            launch()
        kept: list[Group] | None = None
        while tasks and kept is None:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            _retrieve_errors(done)
            for task in done:
                group = tasks.pop(task)
                task.result()
                group.kept = keep(group)
                if not group.kept:
                    self.lifecycle[State.FILTERED.value] += group.mark(State.FILTERED)
            kept = _first_kept(launched, num_groups)
            undecided = sum(g.kept is None for g in launched)
            passed = sum(bool(g.kept) for g in launched)
            while kept is None and passed + undecided < target and len(launched) < max_groups:
                launch()
                undecided += 1
        if kept is not None:
            last = kept[-1].index
        else:  # out of groups to start: the batch is short, and every launched row was used
            kept, last = [g for g in launched if g.kept], len(launched) - 1
        await self.abort_groups(list(tasks.values()), tasks)
        for g in kept:
            self.lifecycle[State.KEPT.value] += g.mark(State.KEPT)
        surplus = [g for g in launched if g.index > last and g.kept]
        for g in surplus:
            self.lifecycle[State.ABORTED.value] += g.mark(State.ABORTED)
        metrics = {"rollout/groups_launched": float(len(launched)),
                   "rollout/groups_kept": float(len(kept)),
                   "rollout/groups_filtered": float(sum(g.kept is False for g in launched)),
                   "rollout/groups_aborted": float(len(tasks) + len(surplus))}
        dropped = [g for g in launched if g.kept is False and g.index <= last]
        return CollectResult(kept, [g.row for g in launched if g.index > last], metrics, dropped)

    async def abort_groups(self, groups: list[Group], tasks: dict | None = None) -> None:
        """Abort every running request of these groups and wait until their tasks have ended."""
        for group in groups:
            group.cancelled = True
            for sample in group.samples:
                if sample.request_id is not None:
                    self.engines[group.engine].abort(sample.request_id)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for group in groups:
            for sample in group.samples:
                if sample.state not in (State.ABORTED, State.KEPT, State.FILTERED):
                    self._move(sample, State.ABORTED)

    # -- partial rollout around a weight update --------------------------------------------------

    async def preempt(self) -> int:
        """Stop generating: abort every running request and wait until the engines are idle.
        The aborted samples keep their tokens and wait; returns how many were preempted."""
        state = self._state()
        state.open.clear()
        count = 0
        for sample in list(state.running):
            if sample.request_id is not None:
                state.preempted.add(sample)
                self.engines[sample.engine].abort(sample.request_id)
                count += 1
        await self.drain()
        return count

    async def drain(self) -> None:
        """Start no new request and wait until the running ones have returned."""
        state = self._state()
        state.open.clear()
        while state.in_engine:
            state.changed.clear()
            await state.changed.wait()

    def release(self) -> None:
        """Let preempted and queued requests go on (under whatever weights the engines now hold)."""
        self._state().open.set()

    # -- bookkeeping -----------------------------------------------------------------------------

    def lifecycle_metrics(self) -> dict[str, float]:
        """How many samples entered each state of their life since the last call (one step)."""
        counts = {f"rollout/samples_{s.value}": float(self.lifecycle[s.value]) for s in State}
        self.lifecycle.clear()
        return counts

    def _move(self, sample: Sample, state: State) -> None:
        sample.move(state)
        self.lifecycle[state.value] += 1
        if state is State.RUNNING:
            self._enter(sample)
        else:
            self._leave(sample)

    def _enter(self, sample: Sample) -> None:
        """`sample` runs (a weight update preempts it); the engine is no longer idle."""
        loop_state = self._state()
        loop_state.running.add(sample)
        if loop_state.idle_since is not None:
            loop_state.idle_s += time.perf_counter() - loop_state.idle_since
            loop_state.idle_since = None

    def _leave(self, sample: Sample) -> None:
        loop_state = self._state()
        if sample in loop_state.running:
            loop_state.running.discard(sample)
            if not loop_state.running:
                loop_state.idle_since = time.perf_counter()

    def _state(self) -> _LoopState:
        """Per-event-loop primitives (asyncio objects belong to the loop that created them)."""
        loop = asyncio.get_running_loop()
        if self._loop_state is None or self._loop_state.loop is not loop:
            self._loop_state = _LoopState(loop, len(self.engines), self.cap)
        return self._loop_state

    def idle_seconds(self) -> float:
        """Time with no request running on any engine, since the scheduler's loop started."""
        s = self._loop_state
        if s is None:
            return 0.0
        return s.idle_s + (time.perf_counter() - s.idle_since if s.idle_since else 0.0)


class _LoopState:
    def __init__(self, loop: asyncio.AbstractEventLoop, engines: int, cap: int | None):
        self.loop = loop
        self.slots = [asyncio.Semaphore(cap) if cap else _NoLimit() for _ in range(engines)]
        self.groups = [0] * engines
        self.open = asyncio.Event()
        self.open.set()
        self.changed = asyncio.Event()
        self.in_engine = 0
        self.running: set[Sample] = set()
        self.preempted: set[Sample] = set()
        self.idle_s: float = 0.0
        self.idle_since: float | None = time.perf_counter()


class _NoLimit:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc) -> None:
        return None


def _stopped(sample: Sample) -> bool:
    """Ended on its own (EOS or a stop token) and scored."""
    return sample.state is State.REWARDED and sample.finish_reason == "stop"


def _first_kept(launched: list[Group], num_groups: int) -> list[Group] | None:
    """The first `num_groups` kept groups in launch order, once every group before the last of
    them has been decided; None while that is not known yet."""
    kept = []
    for group in launched:
        if group.kept is None:
            return None
        if group.kept:
            kept.append(group)
            if len(kept) == num_groups:
                return kept
    return None


def _retrieve_errors(done: set[asyncio.Task]) -> None:
    """Mark every finished task's error as seen: the first one is raised (`task.result()`), and
    the others (a lost engine fails every group at once) would each print 'Task exception was
    never retrieved' at exit."""
    for task in done:
        if not task.cancelled():
            task.exception()

"""Multi-domain RLVR: several domains (math, code, instruction following, reasoning-gym tasks...)
trained together, each with its prompts, its reward, its share of every step and its filter.

`DomainTask` is the task (`reroll.pipelines.task.Task`) the RL pipeline runs when the config has
`data.domains`. Each step, the mixer (`reroll.data.mixing`) splits `rollout.prompts_per_step`
between the domains by weight; each domain draws its groups from its own prompt stream with its
own reward and dynamic-sampling filter (a synchronous rollout source of its own), and the
groups are concatenated into the step's batch, every trajectory's `reward_info["domain"]`
naming its domain. Metrics come per domain (`train/<name>/...`, `eval/<name>/...`,
`time/<name>/rollout_s`) besides the overall ones the pipeline computes.

With `async_training`, one asynchronous source (`reroll.rollout.async_source`) runs every
domain's groups: its producer draws them from `DomainStream`, a block of `prompts_per_step`
groups at a time split by the same mixer, and each group is scored by its domain's reward
(`DomainWork`); the trainer's batch is then split by domain for the filters and metrics.

A domain whose reward keeps failing (its `max_failure_rate_*` bound reached) fails alone: its
groups leave that step (counted in `train/<name>/reward_failed_steps`) and the other domains
train on; the run stops only when every domain of a step failed. The streams' positions, the
reward counters and the mixer's credit are in the checkpoint (async: with the groups the
producer owed), so a resumed run is the uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from reroll.config.domains import DomainConfig
from reroll.config.errors import ConfigError, RunStopped
from reroll.config.schema import RLConfig
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow, PromptSampler, load_prompts
from reroll.data.images import limit_images
from reroll.data.mixing import DomainMixer
from reroll.data.reasoning_gym import generate_rows
from reroll.engines.base import Engine, SamplingParams
from reroll.models.files import model_context
from reroll.pipelines.judge import reward_factory
from reroll.pipelines.task import EvalSet, grouped, held_out, reward_failures, rollout_row
from reroll.pipelines.validation import (
    check_answers,
    check_image_support,
    check_lengths,
    check_rules,
    check_teacher_tags,
    prompt_lengths,
)
from reroll.rewards import FailureBounds, RewardRunner, build_runner
from reroll.rollout.async_source import AsyncSource, PromptWork
from reroll.rollout.groups import Group, State
from reroll.rollout.sampling import RolloutJob, rollout
from reroll.rollout.scheduler import SyncSource, signal_keep
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import MixedStream, PromptStream

log = logging.getLogger(__name__)

SEED_STRIDE = 7919
"""Domain k samples with seed `seed + k * SEED_STRIDE`: its own data order and request seeds."""
PASS_SCORE = 1.0 - 1e-6
"""A sample passes when its reward is (about) 1: a right answer, every rule kept."""


@dataclass
class Domain:
    """One domain's data, reward and rollout source, and its counters."""

    name: str
    where: str
    """`data.domains[k] (name)`: how errors name it."""
    settings: SourceSettings
    """What its source reads: the run's sections with this domain's seed and filter."""
    filter: Any
    rows: list[PromptRow]
    eval_rows: list[PromptRow]
    rewards: RewardRunner
    stream: PromptStream
    source: SyncSource | None = None
    failed_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def domain_reward(spec: DomainConfig, run_reward) -> RewardRunner:
    """The domain's reward behind its runner: its own `reward`, reasoning-gym's scorer (with
    the failure bounds of `run_reward`, the run's `reward:` section), or `run_reward`."""
    if spec.reward is None and spec.reasoning_gym is not None:
        from reroll.rewards.reasoning_gym import ReasoningGymReward

        g, section = spec.reasoning_gym, run_reward
        return RewardRunner(ReasoningGymReward(g.task, g.size, g.eval_size, g.seed, g.config,
                                               g.answer_format), timeout_s=10.0,
                            bounds=FailureBounds(section.max_failure_rate_step,
                                                 section.max_failure_rate_run))
    reward = spec.reward or run_reward
    return build_runner(reward, reward_factory(reward)())


def read_rows(spec: DomainConfig, where: str, system_prompt: str | None
              ) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, eval rows) of a domain: its files, or its generated reasoning-gym task."""
    if spec.reasoning_gym is not None:
        return (generate_rows(spec.reasoning_gym, "train", f"{where}.reasoning_gym",
                              system_prompt),
                generate_rows(spec.reasoning_gym, "eval", f"{where}.reasoning_gym",
                              system_prompt))
    files = [spec.train] if isinstance(spec.train, str) else spec.train
    rows = [row for path in files for row in load_prompts(path, system_prompt)]
    return rows, (load_prompts(spec.eval, system_prompt) if spec.eval else [])


def check_domain(config: RLConfig, tokenizer, spec: DomainConfig, where: str,
                 splits: dict[str, list[PromptRow]]) -> None:
    """The checks of `validation.check_prompts` with the domain's reward; errors name the
    domain (`data.domains[k] (name).train`) and the row's file and line."""
    reward = spec.reward or (config.reward if spec.reasoning_gym is None else None)
    context = model_context(config.model.path)
    for split, rows in splits.items():
        field_name = f"{where}.{split}"
        try:
            if reward is not None:
                check_answers(reward.type, field_name, rows)
                check_rules(reward, rows, f"{where}.reward")
            check_image_support(config, field_name, rows, train=split == "train")
            if split == "train":
                check_teacher_tags(config.algorithm.distill, field_name, rows)
            limit_images(field_name, rows, config.data.max_image_pixels,
                         config.data.oversize_images)
            check_lengths(field_name, rows, prompt_lengths(tokenizer, rows),
                          config.data.max_prompt_tokens, config.rollout.max_new_tokens, context)
        except ConfigError as e:
            message = str(e)
            raise ConfigError(message if message.startswith(where) else
                              f"{where}: {message}") from None


def build_domain(config: RLConfig, tokenizer, k: int, spec: DomainConfig) -> Domain:
    where = f"data.domains[{k}] ({spec.name})"
    try:
        rows, eval_rows = read_rows(spec, where, spec.system_prompt or config.data.system_prompt)
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(where) else
                          f"{where}: {message}") from None
    eval_rows = eval_rows[: config.eval.max_prompts]
    check_domain(config, tokenizer, spec, where, {"train": rows, "eval": eval_rows})
    settings = replace(SourceSettings.of(config, config.data.max_prompt_tokens),
                       seed=config.seed + k * SEED_STRIDE,
                       dynamic_sampling=spec.dynamic_sampling or config.algorithm.dynamic_sampling)
    return Domain(spec.name, where, settings, spec.dynamic_sampling, rows, eval_rows,
                  domain_reward(spec, config.reward),
                  PromptStream(PromptSampler(rows, settings.seed)))


class DomainTask:
    """The domains of `data.domains`, mixed into every step by weight."""

    label = ""

    def __init__(self, config: RLConfig, tokenizer, inputs=None):
        if inputs is not None and inputs.reward_fn() is not None:
            raise ConfigError("data.domains: rewards passed as Python objects are not available "
                              "with domains; give each domain a `reward:` section")
        self.config, self.tokenizer = config, tokenizer
        self.domains: list[Domain] = []
        try:
            for k, spec in enumerate(config.data.domains):
                self.domains.append(build_domain(config, tokenizer, k, spec))
        except BaseException:
            self.close()
            raise
        d = config.data
        self.mixer = DomainMixer([s.weight for s in d.domains], d.reweight, d.reweight_floor,
                                 d.reweight_momentum)
        self.engine: Engine | None = None
        self.source: AsyncSource | None = None
        """The one source of every domain (async runs; sync runs give each domain its own)."""
        self.eval_sets: list[EvalSet] = []
        self._metrics: dict[str, float] = {}
        self._evaluated = False
        self._start: dict[str, float] = {}
        """The evaluation before the first step, per domain, reported once (step 1's row)."""

    @property
    def evaluates(self) -> bool:
        return any(d.eval_rows for d in self.domains)

    @property
    def eval_what(self) -> str:
        return held_out(sum(len(d.eval_rows) for d in self.domains), "prompt",
                        self.config.eval.samples_per_prompt)

    def start(self, engine: Engine) -> Engine:
        if self.config.async_training.enabled:
            stream = DomainStream(self.domains, self.mixer, self.config.rollout.prompts_per_step)
            settings = SourceSettings.of(self.config, self.config.data.max_prompt_tokens)
            self.source = AsyncSource(settings, engine, None, self.tokenizer, stream,
                                      work=lambda source: DomainWork(source, self.domains))
            self.engine = self.source.engine
            return self.engine
        for d in self.domains:
            d.source = SyncSource(d.settings, engine, d.rewards, self.tokenizer, d.stream)
        self.engine = engine
        return engine

    # -- a step ----------------------------------------------------------------------------------

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        """Each domain's share of the step's groups, concatenated (group ids renumbered)."""
        if self.source is not None:
            parts, observe = self.async_parts(step, params), self.source.stream.observe
        else:
            counts = self.mixer.counts(self.config.rollout.prompts_per_step)
            parts = (self.domain_step(d, count, step, params)
                     for d, count in zip(self.domains, counts, strict=True))
            observe = self.mixer.observe
        batch, failures, metrics = [], [], {}
        for index, (trajectories, failed, domain_metrics) in enumerate(parts):
            metrics |= domain_metrics
            if failed is not None:
                failures.append(failed)
                continue
            if trajectories:  # for `reweight: mean_reward`
                observe(index, sum(t.reward for t in trajectories) / len(trajectories))
            batch += renumbered(trajectories, batch[-1].group_id + 1 if batch else 0)
        if failures and not batch:
            raise RunStopped("every domain's reward failed this step: "
                             + "; ".join(str(f) for f in failures))
        if not batch:
            raise RunStopped(f"step {step}: the domains' dynamic-sampling filters dropped every "
                             f"group of the step (scheduler.refill_filtered: true refills them)")
        self._metrics = metrics | self.overall(metrics)
        if self.source is not None:
            self._metrics |= self.source.metrics()
        return batch

    def async_parts(self, step: int, params: SamplingParams):
        """Per domain, as `domain_step` gives it: the async source's next batch (every domain's
        groups, drawn by the producer's mixer) split by domain for its filter, failure bound and
        metrics."""
        timer = time.perf_counter()
        sampled = self.source.next_batch(step, step - 1, params)
        seconds = time.perf_counter() - timer
        for d in self.domains:
            mine = [t for t in sampled if t.reward_info["domain"] == d.name]
            trajectories, filtered = self.own_filter(d, mine)
            failed = self.check_failures(d, step)
            metrics = self.domain_metrics(d, mine, len({t.group_id for t in mine}), filtered, {})
            metrics[f"time/{d.name}/rollout_s"] = seconds  # the domains' groups ran together
            yield ([] if failed else trajectories), failed, metrics

    def check_failures(self, d: Domain, step: int) -> RunStopped | None:
        """The domain's reward past its failure bound: the error (its groups leave the step)."""
        try:
            d.rewards.check_failure_rate(step)
        except RunStopped as e:
            d.failed_steps += 1
            failed = RunStopped(f"domain {d.name!r}: {e}")
            log.warning("%s; its groups leave this step, the other domains train on", failed)
            return failed
        return None

    def domain_step(self, d: Domain, count: int, step: int, params: SamplingParams
                    ) -> tuple[list[Trajectory], RunStopped | None, dict[str, float]]:
        """The domain's `count` groups, filtered by its own filter, with its metrics; a reward
        past its failure bound gives (no groups, the error)."""
        timer = time.perf_counter()
        sampled: list[Trajectory] = []
        filtered = 0
        if count:
            sampled = d.source.next_batch(step, step - 1, params, groups=count)
        trajectories, filtered = self.own_filter(d, sampled)
        failed = self.check_failures(d, step)
        for t in sampled:
            t.reward_info = {**t.reward_info, "domain": d.name}
        # what the domain sampled, its filters' drops included (the source's refills, and its
        # own filter here): a step whose groups were all dropped still says what they scored
        everything = [t for g in d.source.sampled for t in g.trajectories(0)] if count else []
        metrics = self.domain_metrics(d, everything, count, filtered,
                                      d.source.metrics() if count else {})
        metrics[f"time/{d.name}/rollout_s"] = time.perf_counter() - timer
        return ([] if failed else trajectories), failed, metrics

    def own_filter(self, d: Domain, trajectories: list[Trajectory]
                   ) -> tuple[list[Trajectory], int]:
        """Without refills, the domain's own dynamic-sampling filter drops its failing groups
        here (with `scheduler.refill_filtered` the source already replaced them)."""
        if d.filter is None or self.config.scheduler.refill_filtered:
            return trajectories, 0
        size = self.config.rollout.group_size
        keep = signal_keep(d.filter, size)
        kept, dropped = [], 0
        for start in range(0, len(trajectories), size):
            group = trajectories[start:start + size]
            if keep(_Rewards([t.reward for t in group])):
                kept += group
            else:
                dropped += 1
        return kept, dropped

    def domain_metrics(self, d: Domain, trajectories: list[Trajectory], count: int,
                       filtered: int, source: dict[str, float]) -> dict[str, float]:
        """`source`: the domain's own source's metrics (sync runs; the async source's are
        the run's, reported once)."""
        p = f"train/{d.name}/"
        c = d.rewards.counters
        metrics = {p + "prompts": float(count),
                   p + "groups_filtered": float(filtered + source.get("rollout/groups_filtered",
                                                                      0.0)),
                   p + "reward_errors": float(c.failed()),
                   p + "reward_failed_steps": float(d.failed_steps)}
        if trajectories:
            rewards = torch.tensor([t.reward for t in trajectories])
            lengths = torch.tensor([len(t.response_ids) for t in trajectories],
                                   dtype=torch.float32)
            metrics |= {p + "reward_mean": float(rewards.mean()),
                        p + "pass_rate": float((rewards >= PASS_SCORE).float().mean()),
                        p + "response_len_mean": float(lengths.mean()),
                        p + "truncated_frac": sum(t.finish_reason == "length"
                                                  for t in trajectories) / len(trajectories)}
        d.metrics = source
        return metrics

    def overall(self, metrics: dict[str, float]) -> dict[str, float]:
        """The sources' and rewards' counters summed over the domains (as one source's)."""
        total: dict[str, float] = {}
        for d in self.domains:
            for key, value in (d.rewards.metrics() | d.metrics).items():
                total[key] = max(total.get(key, value), value) if key.endswith("max") \
                    else total.get(key, 0.0) + value
        share = {f"train/{d.name}/share": metrics[f"train/{d.name}/prompts"]
                 / self.config.rollout.prompts_per_step for d in self.domains}
        return total | share

    # -- evaluation, records, state --------------------------------------------------------------

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Each domain's mean reward and pass rate on its held-out prompts, and the overall mean
        over every held-out sample (`eval/reward_mean`)."""
        c, metrics, everything = self.config, {}, []
        n = c.eval.samples_per_prompt
        self.eval_sets = []
        for d in self.domains:
            if not d.eval_rows:
                continue
            timer = time.perf_counter()
            job = RolloutJob(self.engine, d.rewards, self.tokenizer, params,
                             c.data.max_prompt_tokens)
            trajectories = rollout(job, d.eval_rows, n, d.settings.seed, step=-1)
            rewards = torch.tensor([t.reward for t in trajectories])
            everything.append(rewards)
            self.eval_sets.append(EvalSet(d.name, grouped(trajectories, n),
                                          reward_failures(d.rewards)))
            metrics |= {f"eval/{d.name}/reward_mean": float(rewards.mean()),
                        f"eval/{d.name}/pass_rate": float((rewards >= PASS_SCORE).float().mean()),
                        f"time/{d.name}/eval_s": time.perf_counter() - timer}
        metrics["eval/reward_mean"] = float(torch.cat(everything).mean())
        if not self._evaluated:  # the run's start: kept for step 1's row (the loop logs none)
            self._start = {"eval_start/" + k.removeprefix("eval/"): v
                           for k, v in metrics.items() if k.startswith("eval/")}
        self._evaluated = True
        return metrics

    def metrics(self) -> dict[str, float]:
        """The step's per-domain metrics; at the first step of a run, also the evaluation
        before it (`eval_start/<domain>/reward_mean`, ...)."""
        start, self._start = self._start, {}
        return self._metrics | start

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        """Up to `count` rows, taken from the domains in turn (every domain shows)."""
        by_domain: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            by_domain.setdefault(t.reward_info.get("domain", ""), []).append(t)
        rows, queues = [], [list(ts) for ts in by_domain.values()]
        while len(rows) < count and any(queues):
            for queue in queues:
                if queue and len(rows) < count:
                    t = queue.pop(0)
                    rows.append(rollout_row(t) | {"domain": t.reward_info.get("domain")})
        return rows

    def state_dict(self) -> dict[str, Any]:
        """Sync: the mixer and each domain's stream. Async: the source's state instead (the
        producer's mixer and streams, and the groups it owes a resumed run)."""
        domains = {d.name: {"reward_counters": d.rewards.counter_state(),
                            "failed_steps": d.failed_steps} for d in self.domains}
        if self.source is not None:
            return {"domains": domains, "async_source": self.source.state_dict()}
        for d in self.domains:
            domains[d.name]["sampler"] = d.stream.state_dict()
        return {"mixer": self.mixer.state_dict(), "domains": domains}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("domains")
        if saved is None or set(saved) != {d.name for d in self.domains}:
            raise ConfigError(f"resume: the checkpoint's domains ({sorted(saved or [])}) are not "
                              f"the config's data.domains ({[d.name for d in self.domains]})")
        if (self.source is not None) != ("async_source" in state):
            raise ConfigError("resume: the checkpoint was written with async_training "
                              f"{'off' if self.source is not None else 'on'}; a multi-domain "
                              f"run resumes in the mode it was written in")
        self._evaluated = True  # the run's start was evaluated before the checkpoint
        if self.source is not None:
            self.source.load_state_dict(state["async_source"])
        else:
            self.mixer.load_state_dict(state["mixer"])
        for d in self.domains:
            if self.source is None:
                d.stream.load_state_dict(saved[d.name]["sampler"])
            d.rewards.load_counters(saved[d.name]["reward_counters"])
            d.failed_steps = saved[d.name]["failed_steps"]

    def close(self) -> None:
        """The reward workers of every domain; the engine once (the sources share it)."""
        first = self.source or (self.domains[0].source if self.domains else None)
        if first is not None:
            first.close()
        for d in self.domains:
            d.rewards.close()


def renumbered(trajectories: list[Trajectory], offset: int) -> list[Trajectory]:
    """The trajectories with their groups numbered from `offset` on, in order."""
    ids: dict[int, int] = {}
    for t in trajectories:
        t.group_id = ids.setdefault(t.group_id, offset + len(ids))
    return trajectories


class DomainStream(MixedStream):
    """The domains' rows for the async producer (`MixedStream`), given as the `PromptRow`s
    themselves (the scheduler reads them); a row's domain is found by the row."""

    def __init__(self, domains: list[Domain], mixer: DomainMixer, per_step: int):
        super().__init__([d.stream for d in domains], mixer, per_step)
        self.domains = domains
        self._domain = {id(row): k for k, d in enumerate(domains) for row in d.stream.sampler.rows}

    def __next__(self) -> PromptRow:
        return super().__next__()[1]

    def domain(self, row: PromptRow) -> Domain:
        return self.domains[self._domain[id(row)]]

    def row_id(self, row: PromptRow) -> list[int]:
        return super().row_id((self._domain[id(row)], row))

    def row(self, row_id: list[int]) -> PromptRow:
        return super().row(row_id)[1]


class DomainWork(PromptWork):
    """The async producer's groups of a multi-domain run: a prompt's responses scored by its
    domain's reward and kept by its domain's filter (when filtered groups are refilled; else
    `DomainTask.own_filter` drops them from the trainer's batch); each trajectory names its
    domain (`reward_info["domain"]`)."""

    def __init__(self, source: AsyncSource, domains: list[Domain]):
        super().__init__(source)
        self.keeps = {d.name: signal_keep(d.settings.refill_filter, self.size) for d in domains}

    def new_group(self, index: int, row: PromptRow, version: int) -> Group:
        group = super().new_group(index, row, version)
        group.scorer = self.source.stream.domain(row).rewards
        return group

    async def run(self, group: Group, params: SamplingParams) -> bool:
        await self.source.scheduler.run_group(group, params)
        keep = self.keeps[self.source.stream.domain(group.row).name]
        return all(s.state is State.REWARDED for s in group.samples) and keep(group)

    def trajectories(self, group: Group, group_id: int) -> list[Trajectory]:
        name = self.source.stream.domain(group.row).name
        trajectories = group.trajectories(group_id)
        for t in trajectories:
            t.reward_info = {**t.reward_info, "domain": name}
        return trajectories


@dataclass
class _Rewards:
    """The one attribute of a scheduler group that `signal_keep` reads."""

    rewards: list[float]


"""The RL step: one step for every RL task (prompts with a verifiable reward, or environments),
with every algorithm of the catalogue (GRPO, Dr. GRPO, DAPO, Lite PPO, RLOO, REINFORCE++, PPO
with a critic, GSPO, CISPO, TOPR, AsyPPO, RLOO/ReBN/GiGPO on episodes, ...) chosen by the
`algorithm:` config. The loop that runs it (run directory, resume, tracker, checkpoints,
evaluation cadence, progress, restarts) is `reroll.pipelines.run`, the same for every pipeline.

One step = the task's rewarded trajectories (`RLStep.next_batch`: `Task.next_batch`) -> the
training step (`train_on`, below: collate -> filter -> logprobs and values -> advantages ->
update; each phase takes the batch and returns it with its metrics) -> the new weights to the
engine (verified). The task is passed in (`rlvr.PromptTask`, `agentic.EnvTask`), never
subclassed. Which function each phase calls for the `algorithm:` config is decided once at start
(`objective.build`: the `Objective` the step functions take); the tensor maths is in
`reroll.algorithms`.

The files one batch passes through, from prompt to optimizer step (DESIGN §1 order). Sync: these
9; async adds a 10th between 3 and 4, the producer and its buffer (`reroll/rollout/async_source.py`):
1. `reroll/pipelines/run.py`: the loop (`Run.run`), every pipeline's
2. `reroll/pipelines/rl.py`: this file: the RL step's phases (`RLStep`, `train_on`)
3. `reroll/pipelines/rlvr.py` (or `agentic.py`): the task: prompts (env seeds) and their reward
4. `reroll/rollout/scheduler.py`: the step's rollout rounds (`SyncSource`), each a batch of
   groups of requests streamed to the engine (`RolloutScheduler`)
5. `reroll/engines/hf.py` (or `vllm.py`, `remote.py`): token ids in, completions out
6. `reroll/rewards/runner.py`: each completion's reward as it finishes (isolated, timed out)
7. `reroll/data/batch.py`: Trajectory and `collate` into the typed, padded RLBatch
8. `reroll/pipelines/objective.py`: the Objective built at start: estimator (by name in
   `advantages.py`), loss terms, KL
9. `reroll/training/local.py` (or `fsdp2.py` behind `workers/policy.py`): the optimizer step
Records and leaves they use: the group records and request seeds (`reroll/rollout/groups.py`),
the prompt order and templating (`reroll/rollout/stream.py`), the engine's Request/Completion
(`reroll/engines/base.py`), tail batching's round planning when it is on
(`reroll/rollout/tail_batching.py`), the reward function (`reroll/rewards/`), the pure tensor
functions of `reroll/algorithms/`, the model forward of `reroll/models/logprobs.py`.

The step's batch is a `reroll.data.batch.RLBatch`: its required fields (the collated tokens,
rewards, turns, loss masks and advantages) exist from `collate_for_rl` on, checked there; the
optional ones (pi_old, reference and teacher logprobs, IS weights, the KL penalty, values and
returns) are set by the phases exactly when the `Objective` says they are read.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.schema import RLRunConfig
from reroll.data.batch import RLBatch, Trajectory, collate, infra_failed, turn_tensors
from reroll.distributed.colocation import take_turns
from reroll.engines.base import SamplingParams
from reroll.models.loading import load_tokenizer
from reroll.pipelines import objective
from reroll.pipelines.common import Stopwatch, UpdateGuard
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.objective import Objective
from reroll.pipelines.roles import build_roles, check_teachers, weight_sync_to
from reroll.pipelines.task import Task, rollout_row
from reroll.rollout.metrics import rollout_metrics
from reroll.rollout.recording import batch_path, save_batch, write_rows
from reroll.rollout.stream import save_processor
from reroll.training.protocols import Critic, Policy, Reference, Teacher

KLController = algorithms.FixedKLController | algorithms.AdaptiveKLController

TaskFactory = Callable[[Any, Any], Task]
"""make_task(config, tokenizer) -> Task: reads and checks the task's data and starts its reward
before the models load (a bad row is refused at start, never at step N)."""


class RLStep:
    """The RL run's step (`reroll.pipelines.run.Step`) on a task: the roles, the engine, the
    learner and the task, built after the run directory is made."""

    start_row = False
    phase = "generating rollouts"

    def __init__(self, config: RLRunConfig, make_task: TaskFactory, run_dir: Path):
        self.config = c = config
        self.run_dir = run_dir
        # The objective, once: a user's estimator or loss that does not import fails here.
        self.objective = objective.build(c.algorithm, group_size=c.rollout.group_size,
                                         temperature=c.rollout.temperature,
                                         max_new_tokens=c.rollout.max_new_tokens)
        self.tokenizer = load_tokenizer(c.model.path)
        self.stop_ids = (self.tokenizer.eos_token_id,)
        check_teachers(c, self.tokenizer)
        self.task = make_task(c, self.tokenizer)
        # Policy, reference (when a KL term needs it), critic (for gae) and engine: in this
        # process or as Ray actors placed by `distributed:`, behind the same interfaces.
        self.roles = build_roles(c, c.steps * c.algorithm.updates_per_batch * c.algorithm.epochs,
                                 self.tokenizer.pad_token_id)
        self.policy: Policy = self.roles.policy
        self.reference: Reference | None = self.roles.reference
        self.critic: Critic | None = self.roles.critic
        objective.announce_correction(c.algorithm, c.off_policy_reasons())
        self.learner = Learner(self.objective, self.policy, self.reference, self.critic,
                               self.objective.new_kl_controller(),
                               UpdateGuard(c.train.max_skipped_updates), self.roles.teacher)
        self.engine = self.task.start(self.roles.engine)
        self.weight_sync = weight_sync_to(self.roles, self.engine)
        # Rollout colocated with the policy: they take turns on the devices at phase boundaries.
        self.turns = take_turns(c, self.policy, self.engine)
        self.steps, self.eval_every = c.steps, c.eval.every_steps
        self.eval_what = self.task.eval_what if self.task.evaluates else ""
        method = self.objective.label
        self.label = f"{self.task.label} {method}" if self.task.label else method
        self.rollout_s = 0.0

    def next_batch(self, n: int) -> list[Trajectory]:
        """The task's rewarded trajectories of step `n` (sync: generated now; async: taken from
        the buffer within the staleness bound of the trainer's version, n - 1)."""
        c = self.config
        self.turns.rollout_turn()  # the swap is timed apart (`time/colocation_swap_s`)
        timer = Stopwatch()
        params = self.sampling_params(c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)
        trajectories = self.task.next_batch(n, params)
        self.rollout_s = timer.seconds()
        return trajectories

    def train(self, trajectories: list[Trajectory], n: int) -> dict[str, float]:
        """The update, then the new weights to the engine, checked (a mismatch raises
        WeightSyncError)."""
        metrics = self.update(trajectories, n)
        self.turns.rollout_turn()
        metrics |= self.weight_sync(n) | self.turns.metrics()
        return metrics | rollout_metrics(trajectories, self.config.rollout.group_size) \
            | self.task.metrics() | {"time/rollout_s": self.rollout_s}

    def update(self, trajectories: list[Trajectory], n: int) -> dict[str, float]:
        """The training step on the devices the policy has (its turn when colocated)."""
        self.turns.train_turn()
        return train_on(trajectories, self.learner, self.tokenizer.pad_token_id, n)

    def evaluate(self, n: int) -> dict[str, float]:
        """The task's held-out metrics after step `n` (the same sampling seeds at every
        evaluation); its samples go to `rollouts/eval_step_N.jsonl` for `reroll view`."""
        self.turns.rollout_turn()
        metrics = self.task.evaluate(self.sampling_params(self.config.eval.temperature))
        count = self.config.tracking.record_eval_rollouts
        if count:
            rows = [rollout_row(t) for s in self.task.eval_sets for t in s.trajectories()][:count]
            write_rows(self.run_dir / "rollouts" / f"eval_step_{n}.jsonl", rows)
        return metrics

    def sampling_params(self, temperature: float, top_p: float = 1.0, top_k: int = 0
                        ) -> SamplingParams:
        return SamplingParams(self.config.rollout.max_new_tokens, temperature, top_p, top_k,
                              self.stop_ids)

    def status(self, metrics: dict[str, float]) -> str:
        last = metrics.get("eval/reward_mean")
        return f"reward {metrics['train/reward_mean']:.3f}" + (
            f" | eval {last:.3f}" if last is not None else "")

    def record(self, n: int, trajectories: list[Trajectory]) -> None:
        """Sampled rows of the step for `reroll view` (`rollouts/step_N.jsonl`) and, every
        `record_batch_every` steps, the step's whole batch for `reroll replay`."""
        tracking = self.config.tracking
        if tracking.record_rollouts:
            rows = self.task.record(n, trajectories, tracking.record_rollouts)
            write_rows(self.run_dir / "rollouts" / f"step_{n}.jsonl", rows)
        every = tracking.record_batch_every
        if every and n % every == 0:
            save_batch(batch_path(self.run_dir, n), n, trajectories)

    def state_dict(self) -> dict[str, Any]:
        return {**self.task.state_dict(), "kl_coef": self.learner.kl.value,
                "teacher_tokens": self.learner.teacher_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.kl.value = state.get("kl_coef", self.learner.kl.value)
        self.learner.teacher_tokens = state.get("teacher_tokens", 0)
        self.task.load_state_dict(state)
        self.weight_sync(state["step"])

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        if self.critic is not None:
            self.critic.save(directory)
        self.policy.save(directory, state)
        self.tokenizer.save_pretrained(directory)
        save_processor(self.tokenizer.name_or_path, directory)  # a VLM's image processor

    def load(self, directory: Path) -> dict[str, Any]:
        if self.critic is not None:
            self.critic.load(directory)
        state = self.policy.load(directory)  # last: its RNG state is the one to continue from
        if "eval_start" not in state:  # checkpoints of earlier versions kept only the reward
            state["eval_start"] = {"eval/reward_mean": state.get("eval_reward_start")}
        return state

    def save_final(self, directory: Path) -> dict[str, Any]:
        """An RL run's model is its last checkpoint (`final_checkpoint`)."""
        return {}

    def summary_keys(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        return {"eval_reward_start": start.get("eval/reward_mean"),
                "eval_reward_end": end.get("eval/reward_mean")}

    def close(self) -> None:
        """Stop the task (rollout source, reward workers) and every role's worker processes."""
        self.task.close()
        self.roles.shutdown()


def rl_step(config: RLRunConfig, make_task: TaskFactory) -> Callable[..., RLStep]:
    """The step factory of RL kinds (`reroll.config.pipelines`): the task's inputs are those the
    run was given (`reroll.api`)."""
    def build(run_dir: Path, inputs: TaskInputs | None) -> RLStep:
        return RLStep(config, functools.partial(make_task, inputs=inputs), run_dir)

    return build


# The training step: one batch of trajectories in, one optimizer step out. The step functions
# below take the `Objective` (built once at start, `objective.build`), never the config.


@dataclass
class Learner:
    """What a step trains and reads: the objective, the roles, and the two controllers that
    carry over from one step to the next (the KL coefficient, the count of skipped updates)."""

    objective: Objective
    policy: Policy
    reference: Reference | None
    critic: Critic | None
    kl: KLController
    guard: UpdateGuard
    teacher: Teacher | None = None
    teacher_tokens: int = 0
    """Response tokens the teacher has scored so far (on-policy distillation's cost)."""


def train_on(trajectories: list[Trajectory], learner: Learner, pad_token_id: int,
             step: int) -> dict[str, float]:
    """The whole step: the batch of `trajectories`, then the update. Returns its metrics."""
    batch, metrics = make_batch(trajectories, learner, pad_token_id)
    return metrics | update(batch, learner, step)


def make_batch(trajectories: list[Trajectory], learner: Learner,
               pad_token_id: int) -> tuple[RLBatch, dict[str, float]]:
    """Collate and shape the rewards, drop groups without signal, the per-token logprobs and
    values (reference, pi_old, critic, corrections, teacher), then the advantages."""
    obj = learner.objective
    batch, metrics = collate_for_rl(trajectories, pad_token_id, obj)
    if obj.distill is not None and obj.distill.routed:  # each sample's teacher, by its row's tag
        batch["teacher_route"] = learner.teacher.routes([t.tag for t in trajectories])
    batch, dropped = drop_failed_groups(batch, obj)
    batch, filtered = filter_groups(batch, obj)
    filtered |= dropped
    if not batch.batch_size[0]:
        return batch, metrics | filtered
    kl_coef = learner.kl.value
    if obj.advantages_first:  # pi_old is then needed only on the samples the update runs on
        batch, estimated = estimate(batch, obj, kl_coef)
        rows = objective.samples_with_gradient(obj, batch, kl_coef,
                                               learner.policy.data_parallel_size)
        batch, logprobs = compute_logprobs_and_values(batch, learner, rows)
    else:
        batch, logprobs = compute_logprobs_and_values(batch, learner)
        batch, estimated = estimate(batch, obj, kl_coef)
    return batch, metrics | logprobs | estimated | filtered


# -- collate and filter -------------------------------------------------------------------------


def collate_for_rl(trajectories: list[Trajectory], pad_token_id: int,
                   obj: Objective) -> tuple[RLBatch, dict[str, float]]:
    """The step's typed batch (`RLBatch`, every required field checked): collate, the turn
    fields (a single-turn response is one turn), the shaped rewards and the loss tokens
    (overlong handling), and which samples are valid (not an infrastructure failure)."""
    tensors, _ = collate(trajectories, pad_token_id)
    tensors.update(turn_tensors(trajectories, tensors["input_ids"].shape[1]))
    tensors["valid"] = torch.tensor([not infra_failed(t) for t in trajectories])
    batch = RLBatch.derived(tensors, obj.group_size)
    metrics = shape_rewards(batch, obj)
    if obj.overlong_filter:
        truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
        batch["loss_mask"] = algorithms.overlong_filter_mask(batch["response_mask"], truncated)
        # The loss normalisers count these tokens: a truncated sample leaves the step (as a
        # filtered group does), while later masks (ratio masks, AsyPPO) only zero its weight.
        batch["normaliser_mask"] = batch["loss_mask"].clone()
        batch["entropy_mask"] = batch["loss_mask"].clone()
        metrics["filter/overlong_dropped"] = float(truncated.sum())
    return batch, metrics


def shape_rewards(batch: TensorDict, obj: Objective) -> dict[str, float]:
    """DAPO's soft overlong penalty, on every reward an estimator may read: each turn's length
    against `max_new_tokens` (a turn's limit; a single-turn response is one turn) gives that
    turn's penalty, added to `turn_rewards` and, summed, to `rewards`. (The reward clip is the
    estimator's first step, `objective.estimate_advantages`.)"""
    if obj.soft_penalty is None:
        return {}
    cache, size = obj.soft_penalty
    turn_ids, turn_rewards = batch["turn_ids"], batch["turn_rewards"]
    K = max(int(turn_ids.max().clamp_min(0)) + 1, turn_rewards.shape[1])
    lengths = algorithms.turn_sums(batch["response_mask"].float(), turn_ids, K)
    penalty = algorithms.dapo_overlong_penalty(lengths, obj.max_new_tokens, cache, penalty=size)
    penalty = torch.where(algorithms.turn_valid(turn_ids, K), penalty, torch.zeros_like(penalty))
    batch["turn_rewards"] = turn_rewards + penalty[:, : turn_rewards.shape[1]]
    batch["rewards"] = batch["rewards"] + penalty.sum(-1)
    return {"train/overlong_penalty_mean": float(penalty.sum(-1).mean())}


def drop_failed_groups(batch: RLBatch, obj: Objective) -> tuple[RLBatch, dict[str, float]]:
    """Infrastructure failures (`valid` False) are out of their group's statistics; a group left
    with fewer than two valid members (one, with `group_size` 1) has no baseline to learn
    from and leaves the step, counted as `train/infra_groups_dropped`."""
    valid = batch["valid"]
    if bool(valid.all()):
        return batch, {"train/infra_groups_dropped": 0.0}
    keep = valid.reshape(-1, obj.group_size).sum(-1) >= min(2, obj.group_size)
    metrics = {"train/infra_groups_dropped": float((~keep).sum())}
    return batch[keep.repeat_interleave(obj.group_size)], metrics


def filter_groups(batch: RLBatch, obj: Objective) -> tuple[RLBatch, dict[str, float]]:
    """Dynamic sampling: keep only the groups that pass the filters (judged on the task reward
    of their valid members).

    The dropped groups leave the step entirely, so batch-level statistics (Lite PPO's std,
    REINFORCE++'s whitening) and loss normalisers are over the kept groups, as in DAPO.
    """
    if obj.keep_groups is None:
        return batch, {}
    keep = obj.keep_groups(batch["task_rewards"], valid=batch["valid"])
    metrics = {"filter/groups_kept": float(keep.sum()),
               "filter/groups_dropped": float((~keep).sum())}
    return batch[keep.repeat_interleave(obj.group_size)], metrics


# -- logprobs and values ------------------------------------------------------------------------


def compute_logprobs_and_values(batch: RLBatch, learner: Learner, rows: torch.Tensor | None = None
                                ) -> tuple[RLBatch, dict[str, float]]:
    """Per-token inputs of the objective: reference and pi_old logprobs, the KL reward penalty,
    off-policy corrections, the teacher's inputs, critic values (and AsyPPO's masks). With
    `rows`, pi_old is computed on those samples only; the others (no gradient) keep the
    behaviour logprobs (ratio 1)."""
    obj = learner.objective
    policy, reference, critic = learner.policy, learner.reference, learner.critic
    metrics: dict[str, float] = {}
    if reference is not None:
        batch["ref_logprobs"] = reference.logprobs(batch, obj.temperature)
    if obj.distill is not None:
        batch.update(obj.distill.teacher_inputs(learner.teacher, batch, obj.temperature))
        learner.teacher_tokens += int(batch["response_mask"].sum())
        metrics["distill/teacher_tokens"] = float(learner.teacher_tokens)
        if obj.distill.routed:
            metrics |= {f"distill/samples/{name or 'default'}": float(n)
                        for name, n in learner.teacher.samples.items()}
    if obj.needs_old_logprobs:
        if rows is None:
            batch["old_logprobs"] = policy.forward_logprobs(batch, obj.temperature)
        else:
            batch["old_logprobs"] = batch["behaviour_logprobs"].clone()
            batch["old_logprobs"][rows] = policy.forward_logprobs(batch[rows], obj.temperature)
        if obj.old_policy_routing:  # routing_replay: old_policy, replayed in every update
            # the whole batch: samples without gradient may still fill a mini-batch
            batch["old_routed_experts"] = policy.routing(batch)
    if obj.kl.in_reward and reference is not None:
        batch["token_kl"] = objective.reward_kl(obj.kl, batch["old_logprobs"],
                                                batch["ref_logprobs"], batch["response_mask"])
        metrics["kl/reward_kl_mean"] = float(algorithms.masked_mean(batch["token_kl"],
                                                                    batch["response_mask"]))
    if obj.correct is not None:
        metrics |= obj.correct(batch, rows)
    if critic is not None:
        values = critic.values(batch)
        for m in range(critic.num_critics):
            batch[f"old_values_{m}"] = values[m]
        batch["values"] = algorithms.critic_ensemble_mean(values)
        if obj.asyppo is not None:
            batch["loss_mask"], batch["entropy_mask"], asy = obj.asyppo(
                values, batch["loss_mask"], batch["response_mask"])
            metrics |= asy
    return batch, metrics


# -- advantages ---------------------------------------------------------------------------------


def estimate(batch: RLBatch, obj: Objective, kl_coef: float) -> tuple[RLBatch, dict[str, float]]:
    """Advantages (and returns, for token-level estimators) of the batch, with on-policy
    distillation's advantage term (`pure`/`mixed`). With `mode: dense` and no task, nothing
    reads an advantage: they stay 0."""
    if obj.estimate is None:
        return batch, {}
    advantages, returns = objective.estimate_advantages(obj, batch, kl_coef=kl_coef)
    batch["advantages"] = advantages
    mask = batch["response_mask"]
    metrics = {"train/advantage_abs_mean": float(algorithms.masked_mean(advantages.abs(), mask))}
    if returns is not None:
        batch["returns"] = returns
    if obj.has_critic:
        residual = algorithms.masked_var(returns - batch["values"], mask)
        metrics["critic/explained_var"] = float(1 - residual / algorithms.masked_var(
            returns, mask).clamp_min(1e-8))
    if obj.distill is not None and obj.distill.advantage is not None:
        metrics |= obj.distill.advantage(batch, obj.needs_old_logprobs)
    return batch, metrics


# -- update -------------------------------------------------------------------------------------


def update(batch: RLBatch, learner: Learner, step: int) -> dict[str, float]:
    """The critic's update, then the policy's (one optimizer step per mini-batch), then the KL
    coefficient. The policy waits out the critic's warm-up steps; a step whose batch has no
    token left in the loss (every group filtered) updates nothing."""
    obj, t0 = learner.objective, time.perf_counter()
    metrics: dict[str, float] = {}
    if batch.batch_size[0] and learner.critic is not None:
        for _ in range(obj.epochs):  # the last pass's metrics
            critic_metrics = learner.critic.update(batch, obj.updates_per_batch)
        metrics |= critic_metrics
    if step > obj.critic_warmup_steps and batch.batch_size[0] \
            and float(batch["loss_mask"].sum()) > 0:
        metrics |= update_policy(batch, learner, step)
    else:
        metrics["train/policy_skipped"] = 1.0
    metrics |= update_kl_coef(metrics, batch, obj, learner.kl)
    return metrics | {"time/train_s": time.perf_counter() - t0}


def update_policy(batch: RLBatch, learner: Learner, step: int) -> dict[str, float]:
    """One optimizer step per mini-batch, `epochs` passes over them (metrics: the mean over all
    the steps); one skipped for a non-finite loss or gradient norm is counted, and too many in a
    row stop the run (`UpdateGuard`)."""
    obj, kl_coef = learner.objective, learner.kl.value
    minis = split_mini_batches(batch, obj.updates_per_batch) * obj.epochs
    metrics: dict[str, float] = {}
    for mini in minis:
        # Normalised over the whole mini-batch, run on the samples that carry a gradient.
        loss_fn = objective.make_rl_loss(obj, mini, kl_coef=kl_coef)
        trained = objective.samples_with_gradient(obj, mini, kl_coef,
                                                  learner.policy.data_parallel_size)
        skipped = {"train/zero_advantage_skipped": 1 - len(trained) / mini.batch_size[0]}
        result = learner.policy.train_step(mini[trained], loss_fn)
        learner.guard.check(step, result)
        for key, value in (result | skipped).items():
            metrics[key] = metrics.get(key, 0.0) + value / len(minis)
    return metrics | learner.guard.metrics()


def update_kl_coef(metrics: dict[str, float], batch: RLBatch, obj: Objective,
                   kl: KLController) -> dict[str, float]:
    """Feed the measured per-token KL to the controller (a no-op for a fixed coefficient):
    the sampled responses' KL penalty in reward mode, the loss term's KL in loss mode."""
    if not obj.kl.coef:
        return {}
    current = metrics.get("actor/kl_ref")
    if obj.kl.in_reward and batch.batch_size[0]:
        current = float(algorithms.masked_mean(batch["token_kl"], batch["response_mask"]))
    if current is not None:
        kl.update(current, batch.batch_size[0])
    return {"kl/coef": kl.value}


def split_mini_batches(batch: RLBatch, updates: int) -> list[RLBatch]:
    """`updates` consecutive mini-batches of (nearly) equal size; fewer if the batch is smaller."""
    size = -(-batch.batch_size[0] // updates)
    return [batch[start : start + size] for start in range(0, batch.batch_size[0], size)]

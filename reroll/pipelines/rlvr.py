"""RLVR: reinforcement learning with verifiable rewards on prompts, with every algorithm of the
catalogue (GRPO, Dr. GRPO, DAPO, Lite PPO, RLOO, REINFORCE++, PPO with a critic, GSPO, CISPO,
TOPR, AsyPPO, ...) chosen by the `algorithm:` config.

One step = sample a group of responses per prompt -> score them with the reward -> shape and
filter -> logprobs, values and advantages -> update the critic and the policy -> push the new
weights to the engine (verified). `RLVRPipeline.run` reads top to bottom; each phase is one
method below it; the config-to-function mapping lives in `objective.py`, reward shaping, filters
and corrections in `rl_batch.py`, the critic in `reroll/training/critic.py`.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.schema import RLConfig
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptSampler, load_prompts
from reroll.distributed.colocation import take_turns
from reroll.distributed.roles import build_roles
from reroll.distributed.supervisor import supervise
from reroll.distributed.weight_sync import make_weight_sync
from reroll.engines.base import SamplingParams
from reroll.models.loading import load_tokenizer
from reroll.pipelines import objective, rl_batch
from reroll.pipelines.common import (
    RunDir,
    Stopwatch,
    UpdateGuard,
    seed_everything,
    set_threads,
)
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.validation import check_prompts
from reroll.rewards import RewardRunner, build_runner
from reroll.rollout.metrics import rollout_metrics
from reroll.rollout.recording import batch_path, save_batch
from reroll.rollout.sampling import RolloutJob, rollout
from reroll.rollout.sources import build_source
from reroll.rollout.stream import PromptStream
from reroll.tracking import ProgressBar, Tracker
from reroll.tracking.jsonsafe import dumps


class RLVRPipeline:
    def __init__(self, config: RLConfig, inputs: TaskInputs | None = None):
        self.config = c = config
        self.inputs = inputs or TaskInputs()  # objects passed from Python (reroll.api)
        set_threads(c.train.num_threads)
        seed_everything(c.seed)
        self.run_dir = RunDir.for_run(c.run_dir(), c.resume, c.overwrite)
        self.inputs.write_files(self.run_dir.path)
        self.tokenizer = load_tokenizer(c.model.path)
        self.stop_ids = (self.tokenizer.eos_token_id,)
        self.load_task_data()
        self.rewards = self.start_rewards()
        # Policy, reference (when a KL term needs it), critic (for gae) and engine: in this
        # process or as Ray actors placed by `distributed:`, behind the same interfaces.
        self.roles = build_roles(c, c.steps * c.algorithm.updates_per_batch,
                                 self.tokenizer.pad_token_id)
        self.policy, self.reference = self.roles.policy, self.roles.reference
        self.critic, self.engine = self.roles.critic, self.roles.engine
        self.restarts = 0  # set by the supervisor when this pipeline resumes after a failure
        self.kl = objective.kl_controller(c.algorithm.kl)
        rl_batch.announce_correction(c.algorithm, c.off_policy_reasons())
        self.update_guard = UpdateGuard(c.train.max_skipped_updates)
        self.setup_task()
        self.weight_sync = make_weight_sync(self.policy, self.engine, c.distributed)
        # Rollout colocated with the policy: they take turns on the devices at phase boundaries.
        self.turns = take_turns(c, self.policy, self.engine)
        self.start_step, self.eval_reward_start = 0, None
        resume = self.run_dir.resolve_resume(c.resume)
        if resume:
            self.restore(*resume)
        self.run_dir.write_config(c)
        self.tracker = Tracker(self.run_dir.path, c.tracking,
                               resume_step=self.start_step if resume else None,
                               run_config=c.model_dump(mode="json"))

    def start_rewards(self) -> RewardRunner | None:
        """The reward, started before the models load: its workers import their verifier
        meanwhile (math-verify: ~0.5 s), not during the first step."""
        return build_runner(self.config.reward, self.inputs.reward_fn())

    def load_task_data(self) -> None:
        """Train and eval prompts, read and checked whole (templated lengths against
        `data.max_prompt_tokens` and the model's context, the reward's `answer` column) before
        any model is built: a bad row is refused at start, never at step N."""
        c = self.config
        self.train_rows = load_prompts(c.data.train, c.data.system_prompt)
        self.eval_rows = load_prompts(c.data.eval, c.data.system_prompt)[: c.eval.max_prompts] \
            if c.data.eval else []
        check_prompts(c, self.tokenizer, {"data.train": self.train_rows,
                                          "data.eval": self.eval_rows})

    def setup_task(self) -> None:
        """The task: the rollout source that turns the prompts into scored trajectories (sync,
        or async where `engine` becomes the producer's facade)."""
        c = self.config
        self.sampler = PromptStream(PromptSampler(self.train_rows, c.seed))
        self.source = build_source(c, self.engine, self.rewards, self.tokenizer, self.sampler)
        self.engine = self.source.engine

    def run(self) -> dict:
        c, clock = self.config, Stopwatch()
        if self.eval_reward_start is None:
            self.eval_reward_start = self.evaluate().get("eval/reward_mean")
        bar = ProgressBar(c.steps, self.method_name(), self.start_step, c.tracking.progress)
        last_eval = None
        for step in range(self.start_step + 1, c.steps + 1):
            timer = Stopwatch()
            trajectories = self.generate(step)
            batch, metrics = self.make_batch(trajectories)
            metrics |= self.update(batch, step)
            metrics |= self.sync_weights(step)
            metrics |= rollout_metrics(trajectories, c.rollout.group_size) | self.rewards.metrics()
            metrics |= self.source.metrics()
            if self.eval_due(step):
                metrics |= self.evaluate()
                last_eval = metrics["eval/reward_mean"]
            metrics["time/step_s"] = timer.seconds()
            self.tracker.log(step, metrics)
            self.record(step, trajectories)
            self.record_batch(step, trajectories)
            self.checkpoint(step)
            bar.update(step, f"reward {metrics['train/reward_mean']:.3f}"
                       + (f" | eval {last_eval:.3f}" if last_eval is not None else ""))
        bar.close()
        return self.finish(last_eval, clock.seconds())

    # -- phases ----------------------------------------------------------------------------------

    def generate(self, step: int) -> list[Trajectory]:
        """A group of scored responses for each of this step's prompts, from the rollout source
        (sync: generated now; async: taken from the buffer within the staleness bound of the
        trainer's version, step - 1)."""
        c = self.config
        self.turns.rollout_turn()
        t0 = time.perf_counter()
        params = SamplingParams(c.rollout.max_new_tokens, c.rollout.temperature, c.rollout.top_p,
                                c.rollout.top_k, self.stop_ids)
        trajectories = self.source.next_batch(step, step - 1, params)
        self._rollout_s = time.perf_counter() - t0
        self.rewards.check_failure_rate(step)  # a reward that keeps failing stops the run here
        return trajectories

    def make_batch(self, trajectories: list[Trajectory]) -> tuple[TensorDict, dict[str, float]]:
        """Collate and shape the rewards, drop groups without signal, score the tokens (reference,
        pi_old, critic, corrections), then the advantages."""
        c = self.config
        self.turns.train_turn()
        batch, metrics = rl_batch.collate_for_rl(trajectories, self.tokenizer.pad_token_id,
                                                 c.algorithm, c.rollout.group_size,
                                                 c.rollout.max_new_tokens)
        batch, filtered = rl_batch.filter_groups(batch, c.algorithm.dynamic_sampling,
                                                 c.rollout.group_size)
        if not batch.batch_size[0]:
            return batch, metrics | filtered
        if objective.advantages_before_scores(c.algorithm, self.reference is not None):
            # pi_old is then needed only on the samples the update will run on.
            metrics |= self.estimate(batch)
            metrics |= self.score(batch, objective.samples_with_gradient(
                c.algorithm, batch, self.kl.value, self.policy.data_parallel_size))
        else:
            metrics |= self.score(batch)
            metrics |= self.estimate(batch)
        return batch, metrics | filtered

    def score(self, batch: TensorDict, rows: torch.Tensor | None = None) -> dict[str, float]:
        """Per-token inputs of the objective: reference and pi_old logprobs, the KL reward penalty,
        off-policy corrections, critic values (and AsyPPO's masks). With `rows`, pi_old is computed
        on those samples only; the others (no gradient) keep the behaviour logprobs (ratio 1)."""
        c, a = self.config, self.config.algorithm
        metrics: dict[str, float] = {}
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.logprobs(batch, c.rollout.temperature)
        if objective.needs_old_logprobs(a):
            if rows is None:
                batch["old_logprobs"] = self.policy.forward_logprobs(batch, c.rollout.temperature)
            else:
                batch["old_logprobs"] = batch["behaviour_logprobs"].clone()
                batch["old_logprobs"][rows] = self.policy.forward_logprobs(
                    batch[rows], c.rollout.temperature)
        if a.kl.mode == "reward" and self.reference is not None:
            batch["token_kl"] = objective.reward_kl(a.kl, batch["old_logprobs"],
                                                    batch["ref_logprobs"], batch["response_mask"])
            metrics["kl/reward_kl_mean"] = float(algorithms.masked_mean(batch["token_kl"],
                                                                        batch["response_mask"]))
        if a.correction.tis is not None or a.correction.ratio_mask is not None:
            metrics |= rl_batch.apply_corrections(batch, a.correction, rows)
        if self.critic is not None:
            values = self.critic.values(batch)
            for m in range(self.critic.num_critics):
                batch[f"old_values_{m}"] = values[m]
            batch["values"] = algorithms.critic_ensemble_mean(values)
            if self.critic.num_critics > 1:
                batch["loss_mask"], batch["entropy_mask"], asy = objective.asyppo_masks(
                    a.critic.asyppo, values, batch["loss_mask"], batch["response_mask"])
                metrics |= asy
        return metrics

    def estimate(self, batch: TensorDict) -> dict[str, float]:
        """Advantages (and returns, for token-level estimators) of the batch."""
        c = self.config
        advantages, returns = objective.estimate_advantages(c.algorithm, batch,
                                                            c.rollout.group_size,
                                                            kl_coef=self.kl.value)
        batch["advantages"] = advantages
        mask = batch["response_mask"]
        metrics = {"train/advantage_abs_mean": float(algorithms.masked_mean(advantages.abs(), mask))}
        if returns is not None:
            batch["returns"] = returns
        if "values" in batch.keys():
            residual = algorithms.masked_var(returns - batch["values"], mask)
            metrics["critic/explained_var"] = float(1 - residual / algorithms.masked_var(
                returns, mask).clamp_min(1e-8))
        return metrics

    def update(self, batch: TensorDict, step: int) -> dict[str, float]:
        """The critic's update, then the policy's (one optimizer step per mini-batch), then the KL
        coefficient. The policy waits out the critic's warm-up steps; a step whose batch has no
        token left in the loss (every group filtered) updates nothing."""
        c, t0 = self.config, time.perf_counter()
        metrics: dict[str, float] = {}
        if batch.batch_size[0] and self.critic is not None:
            metrics |= self.critic.update(batch, c.algorithm.updates_per_batch)
        warmup = c.algorithm.critic.warmup_steps if c.algorithm.critic else 0
        if step > warmup and batch.batch_size[0] and float(batch["loss_mask"].sum()) > 0:
            metrics |= self.update_policy(batch, step)
        else:
            metrics["train/policy_skipped"] = 1.0
        metrics |= self.update_kl_coef(metrics, batch)
        return metrics | {"time/train_s": time.perf_counter() - t0, "time/rollout_s": self._rollout_s}

    def update_policy(self, batch: TensorDict, step: int) -> dict[str, float]:
        """One optimizer step per mini-batch; one skipped for a non-finite loss or gradient norm
        is counted, and too many in a row stop the run (`UpdateGuard`)."""
        c = self.config
        minis = rl_batch.split_mini_batches(batch, c.algorithm.updates_per_batch)
        metrics: dict[str, float] = {}
        for mini in minis:
            # Normalised over the whole mini-batch, run on the samples that carry a gradient.
            loss_fn = objective.make_rl_loss(c.algorithm, mini, c.rollout.temperature,
                                             c.rollout.max_new_tokens, kl_coef=self.kl.value)
            trained = objective.samples_with_gradient(c.algorithm, mini, self.kl.value,
                                                      self.policy.data_parallel_size)
            skipped = {"train/zero_advantage_skipped": 1 - len(trained) / mini.batch_size[0]}
            result = self.policy.train_step(mini[trained], loss_fn)
            self.update_guard.check(step, result)
            for key, value in (result | skipped).items():
                metrics[key] = metrics.get(key, 0.0) + value / len(minis)
        return metrics | self.update_guard.metrics()

    def update_kl_coef(self, metrics: dict[str, float], batch: TensorDict) -> dict[str, float]:
        """Feed the measured per-token KL to the controller (a no-op for a fixed coefficient):
        the sampled responses' KL penalty in reward mode, the loss term's KL in loss mode."""
        if not self.config.algorithm.kl.coef:
            return {}
        current = metrics.get("actor/kl_ref")
        if "token_kl" in batch.keys() and batch.batch_size[0]:
            current = float(algorithms.masked_mean(batch["token_kl"], batch["response_mask"]))
        if current is not None:
            self.kl.update(current, batch.batch_size[0])
        return {"kl/coef": self.kl.value}

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the policy's weights to the engine and check that they arrived intact (a
        mismatch raises WeightSyncError). After a restart, every step shows `fault/restarts`."""
        self.turns.rollout_turn()
        metrics = self.weight_sync(version) | self.turns.metrics()
        return metrics | ({"fault/restarts": self.restarts} if self.restarts else {})

    def evaluate(self) -> dict[str, float]:
        """Mean reward on the held-out prompts (the same sampling seeds at every evaluation)."""
        c = self.config
        if not self.eval_rows:
            return {}
        self.turns.rollout_turn()
        params = SamplingParams(c.rollout.max_new_tokens, c.eval.temperature, 1.0, 0, self.stop_ids)
        trajectories = rollout(self.rollout_job(params), self.eval_rows, c.eval.samples_per_prompt,
                               c.seed, step=-1)
        rewards = torch.tensor([t.reward for t in trajectories])
        return {"eval/reward_mean": float(rewards.mean())}

    # -- helpers ---------------------------------------------------------------------------------

    def method_name(self) -> str:
        a = self.config.algorithm
        return f"{a.advantage.name}/{a.policy_loss.name}"

    def rollout_job(self, params: SamplingParams) -> RolloutJob:
        return RolloutJob(self.engine, self.rewards, self.tokenizer, params,
                              self.config.data.max_prompt_tokens)

    def eval_due(self, step: int) -> bool:
        every = self.config.eval.every_steps
        return bool(self.eval_rows) and (step == self.config.steps or (every and step % every == 0))

    def record_batch(self, step: int, trajectories: list[Trajectory]) -> None:
        """Every `record_batch_every` steps, the step's whole batch, for `reroll replay`."""
        every = self.config.tracking.record_batch_every
        if every and step % every == 0:
            save_batch(batch_path(self.run_dir.path, step), step, trajectories)

    def record(self, step: int, trajectories: list[Trajectory]) -> None:
        """Sampled text rows of the step for `reroll view`."""
        count = self.config.tracking.record_rollouts
        if not count:
            return
        folder = self.run_dir.path / "rollouts"
        folder.mkdir(exist_ok=True)
        with (folder / f"step_{step}.jsonl").open("w") as f:
            for t in trajectories[:count]:
                f.write(dumps({"prompt": t.prompt_text, "response": t.response_text,
                                    "answer": t.answer, "reward": t.reward,
                                    "reward_info": t.reward_info, "finish_reason": t.finish_reason,
                                    "group_id": t.group_id}) + "\n")

    def checkpoint(self, step: int) -> None:
        c = self.config
        if step != c.steps and not (c.checkpoint.every_steps and step % c.checkpoint.every_steps == 0):
            return
        directory = self.run_dir.staging_dir(step)  # renamed to step_N/ once complete
        if self.critic is not None:
            self.critic.save(directory)
        self.policy.save(directory, {"step": step, "sampler": self.sampler.state_dict(),
                                     "eval_reward_start": self.eval_reward_start,
                                     "reward_counters": dict(vars(self.rewards.counters)),
                                     "kl_coef": self.kl.value})
        self.tokenizer.save_pretrained(directory)
        self.run_dir.commit(step)
        self.run_dir.prune_checkpoints(c.checkpoint.keep_last)

    def restore(self, step: int, directory: Path) -> None:
        if self.critic is not None:
            self.critic.load(directory)
        extra = self.policy.load(directory)  # last: its RNG state is the one to continue from
        self.kl.value = extra.get("kl_coef", self.kl.value)
        self.sampler.load_state_dict(extra["sampler"])
        self.rewards.load_counters(extra["reward_counters"])
        self.start_step, self.eval_reward_start = step, extra["eval_reward_start"]
        self.weight_sync(step)

    def finish(self, eval_reward_end: float | None, wall_time_s: float) -> dict:
        self.tracker.close()
        self.close()
        summary = {
            "run_dir": str(self.run_dir.path),
            "steps": self.config.steps,
            "resumed_from_step": self.start_step or None,
            "restarts": self.restarts,
            "eval_reward_start": self.eval_reward_start,
            "eval_reward_end": eval_reward_end,
            "wall_time_s": round(wall_time_s, 2),
            "final_checkpoint": str(self.run_dir.checkpoint_dir(self.config.steps)),
        }
        self.run_dir.write_summary(summary)
        return summary


    def close(self) -> None:
        """Stop the rollout source, the reward workers and every role's worker processes."""
        self.source.close()
        self.rewards.close()
        self.roles.shutdown()


def train(config: RLConfig, inputs: TaskInputs | None = None) -> dict:
    """Run the pipeline; when a worker process dies, restart the roles and resume from the last
    checkpoint, up to `distributed.max_restarts` times. Resuming a finished run changes nothing.
    `inputs`: a reward and datasets passed as Python objects (`reroll.api.train`)."""
    done = RunDir(config.run_dir()).finished_summary(config.resume, config.steps)
    return done if done is not None else supervise(
        functools.partial(RLVRPipeline, inputs=inputs), config)

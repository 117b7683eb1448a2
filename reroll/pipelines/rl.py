"""The RL pipeline: one driver loop for every RL task (prompts with a verifiable reward, or
environments), with every algorithm of the catalogue (GRPO, Dr. GRPO, DAPO, Lite PPO, RLOO,
REINFORCE++, PPO with a critic, GSPO, CISPO, TOPR, AsyPPO, RLOO/ReBN/GiGPO on episodes, ...)
chosen by the `algorithm:` config.

One step = the task's rewarded trajectories (`Task.next_batch`) -> the training step
(`step.train_on`: collate, filter, logprobs and values, advantages, update) -> the new weights to
the engine (verified) -> metrics, evaluation, records, checkpoint. `RLPipeline.run` reads top to
bottom; the task is passed in (`rlvr.PromptTask`, `agentic.EnvTask`), never subclassed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reroll.config.schema import RLRunConfig
from reroll.data.batch import Trajectory
from reroll.distributed.colocation import take_turns
from reroll.engines.base import SamplingParams
from reroll.models.loading import load_tokenizer
from reroll.pipelines import objective, step
from reroll.pipelines.checkpoints import checkpoint_due, prune_checkpoints
from reroll.pipelines.common import RunDir, Stopwatch, UpdateGuard, seed_everything, set_threads
from reroll.pipelines.roles import build_roles, weight_sync_to
from reroll.pipelines.supervisor import supervise
from reroll.pipelines.task import Task
from reroll.rollout.metrics import rollout_metrics
from reroll.rollout.recording import batch_path, save_batch
from reroll.tracking import ProgressBar, Tracker
from reroll.tracking.jsonsafe import dumps
from reroll.training.protocols import Critic, Policy, Reference

TaskFactory = Callable[[Any, Any], Task]
"""make_task(config, tokenizer) -> Task: reads and checks the task's data and starts its reward
before the models load (a bad row is refused at start, never at step N)."""


class RLPipeline:
    def __init__(self, config: RLRunConfig, make_task: TaskFactory):
        self.config = c = config
        set_threads(c.train.num_threads)
        seed_everything(c.seed)
        self.run_dir = RunDir.for_run(c.run_dir(), c.resume, c.overwrite)
        self.tokenizer = load_tokenizer(c.model.path)
        self.stop_ids = (self.tokenizer.eos_token_id,)
        self.task = make_task(c, self.tokenizer)
        # Policy, reference (when a KL term needs it), critic (for gae) and engine: in this
        # process or as Ray actors placed by `distributed:`, behind the same interfaces.
        self.roles = build_roles(c, c.steps * c.algorithm.updates_per_batch,
                                 self.tokenizer.pad_token_id)
        self.policy: Policy = self.roles.policy
        self.reference: Reference | None = self.roles.reference
        self.critic: Critic | None = self.roles.critic
        self.restarts = 0  # set by the supervisor when this pipeline resumes after a failure
        step.announce_correction(c.algorithm, c.off_policy_reasons())
        self.learner = step.Learner(self.policy, self.reference, self.critic,
                                    objective.kl_controller(c.algorithm.kl),
                                    UpdateGuard(c.train.max_skipped_updates))
        self.engine = self.task.start(self.roles.engine)
        self.weight_sync = weight_sync_to(self.roles, self.engine)
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

    def run(self) -> dict:
        c, clock = self.config, Stopwatch()
        if self.eval_reward_start is None:
            self.eval_reward_start = self.evaluate().get("eval/reward_mean")
        bar = ProgressBar(c.steps, self.method_name(), self.start_step, c.tracking.progress)
        last_eval = None
        for n in range(self.start_step + 1, c.steps + 1):
            timer = Stopwatch()
            trajectories, rollout_s = self.generate(n)
            metrics = self.train(trajectories, n)
            metrics |= self.sync_weights(n)
            metrics |= rollout_metrics(trajectories, c.rollout.group_size) | self.task.metrics()
            if self.eval_due(n):
                metrics |= self.evaluate()
                last_eval = metrics["eval/reward_mean"]
            metrics |= {"time/rollout_s": rollout_s, "time/step_s": timer.seconds()}
            self.tracker.log(n, metrics)
            self.record(n, trajectories)
            self.checkpoint(n)
            bar.update(n, f"reward {metrics['train/reward_mean']:.3f}"
                       + (f" | eval {last_eval:.3f}" if last_eval is not None else ""))
        bar.close()
        return self.finish(last_eval, clock.seconds())

    # -- phases ----------------------------------------------------------------------------------

    def generate(self, n: int) -> tuple[list[Trajectory], float]:
        """The task's rewarded trajectories of step `n` (sync: generated now; async: taken from
        the buffer within the staleness bound of the trainer's version, n - 1), and the seconds
        that took."""
        c = self.config
        self.turns.rollout_turn()  # the swap is timed apart (`time/colocation_swap_s`)
        timer = Stopwatch()
        params = self.sampling_params(c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)
        return self.task.next_batch(n, params), timer.seconds()

    def train(self, trajectories: list[Trajectory], n: int) -> dict[str, float]:
        """The training step on the devices the policy has (its turn when colocated)."""
        self.turns.train_turn()
        return step.train_on(trajectories, self.config, self.learner,
                             self.tokenizer.pad_token_id, n)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the policy's weights to the engine and check that they arrived intact (a
        mismatch raises WeightSyncError). After a restart, every step shows `fault/restarts`."""
        self.turns.rollout_turn()
        metrics = self.weight_sync(version) | self.turns.metrics()
        return metrics | ({"fault/restarts": self.restarts} if self.restarts else {})

    def evaluate(self) -> dict[str, float]:
        """The task's held-out metrics (the same sampling seeds at every evaluation)."""
        if not self.task.evaluates:
            return {}
        self.turns.rollout_turn()
        return self.task.evaluate(self.sampling_params(self.config.eval.temperature))

    # -- helpers ---------------------------------------------------------------------------------

    def sampling_params(self, temperature: float, top_p: float = 1.0, top_k: int = 0
                        ) -> SamplingParams:
        return SamplingParams(self.config.rollout.max_new_tokens, temperature, top_p, top_k,
                              self.stop_ids)

    def method_name(self) -> str:
        a = self.config.algorithm
        method = f"{a.advantage.name}/{a.policy_loss.name}"
        return f"{self.task.label} {method}" if self.task.label else method

    def eval_due(self, n: int) -> bool:
        every = self.config.eval.every_steps
        return self.task.evaluates and (n == self.config.steps or bool(every and n % every == 0))

    def record(self, n: int, trajectories: list[Trajectory]) -> None:
        """Sampled rows of the step for `reroll view` (`rollouts/step_N.jsonl`) and, every
        `record_batch_every` steps, the step's whole batch for `reroll replay`."""
        tracking = self.config.tracking
        if tracking.record_rollouts:
            folder = self.run_dir.path / "rollouts"
            folder.mkdir(exist_ok=True)
            rows = self.task.record(n, trajectories, tracking.record_rollouts)
            with (folder / f"step_{n}.jsonl").open("w") as f:
                f.writelines(dumps(row) + "\n" for row in rows)
        every = tracking.record_batch_every
        if every and n % every == 0:
            save_batch(batch_path(self.run_dir.path, n), n, trajectories)

    def checkpoint(self, n: int) -> None:
        c = self.config
        if not checkpoint_due(c.checkpoint, n, c.steps):
            return
        directory = self.run_dir.staging_dir(n)  # renamed to step_N/ once complete
        if self.critic is not None:
            self.critic.save(directory)
        self.policy.save(directory, {"step": n, **self.task.state_dict(),
                                     "eval_reward_start": self.eval_reward_start,
                                     "kl_coef": self.learner.kl.value})
        self.tokenizer.save_pretrained(directory)
        self.run_dir.commit(n)
        prune_checkpoints(self.run_dir, c.checkpoint)

    def restore(self, n: int, directory: Path) -> None:
        if self.critic is not None:
            self.critic.load(directory)
        extra = self.policy.load(directory)  # last: its RNG state is the one to continue from
        self.learner.kl.value = extra.get("kl_coef", self.learner.kl.value)
        self.task.load_state_dict(extra)
        self.start_step, self.eval_reward_start = n, extra["eval_reward_start"]
        self.weight_sync(n)

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
        """Stop the task (rollout source, reward workers) and every role's worker processes."""
        self.task.close()
        self.roles.shutdown()


def train(config: RLRunConfig, make_task: TaskFactory) -> dict:
    """Run the pipeline on the task; when a worker process dies, restart the roles and resume
    from the last checkpoint, up to `distributed.max_restarts` times. Resuming a finished run
    changes nothing."""
    done = RunDir(config.run_dir()).finished_summary(config.resume, config.steps)
    if done is not None:
        return done
    return supervise(functools.partial(RLPipeline, make_task=make_task), config)

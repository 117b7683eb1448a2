"""SFT: token cross-entropy on response tokens, the prompt masked out.

The same run with another loss per step (offline distillation's teacher: `pipelines/distill.py`)
passes a `step`: it makes each batch's loss, adds its metrics and keeps its state in checkpoints.

A row is `prompt` + a target response (the field named by `data.response_key`), or `messages`
ending with the assistant's message. The response is tokenised on its own after the templated
prompt and closed with EOS, exactly the token sequence the RL engine later generates. A
multi-turn `messages` row (several assistant turns, tool calls and results, a `tools` column)
trains every assistant turn, the rest masked (`reroll.data.multiturn`).
"""

from __future__ import annotations

import random
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.config.schema import SFTConfig
from reroll.data.batch import Trajectory, collate
from reroll.data.datasets import PromptRow, load_prompts
from reroll.data.multiturn import is_multi_turn, multi_turn_example
from reroll.models.devices import machine_devices, trainer_device
from reroll.models.loading import load_model, load_tokenizer
from reroll.models.logprobs import batched_logprobs
from reroll.pipelines import objective
from reroll.pipelines.checkpoints import checkpoint_due, prune_checkpoints
from reroll.pipelines.common import (
    RunDir,
    Stopwatch,
    UpdateGuard,
    seed_everything,
    set_threads,
)
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.validation import check_max_tokens
from reroll.rollout.stream import encode_prompt
from reroll.tracking import ProgressBar, Tracker
from reroll.training.local import LocalStrategy


def sft_example(tokenizer, row: PromptRow, response_key: str, max_tokens: int) -> Trajectory:
    tools = row.metadata.get("tools")
    if row.messages[-1]["role"] == "assistant" and is_multi_turn(row.messages, tools):
        return multi_turn_example(tokenizer, row.messages, tools, max_tokens, row.source)
    if row.messages[-1]["role"] == "assistant":
        prompt_row = PromptRow(row.messages[:-1], None, source=row.source)
        target = row.messages[-1]["content"]
    else:
        prompt_row, target = row, row.metadata.get(response_key, row.answer)
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{row.source}: needs a string `{response_key}` (the SFT target) or "
                              f"`messages` ending with an assistant message")
    prompt_ids = encode_prompt(tokenizer, prompt_row, max_tokens)
    response_ids = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
    if len(prompt_ids) + len(response_ids) > max_tokens:
        raise ConfigError(f"{row.source}: {len(prompt_ids) + len(response_ids)} tokens, over "
                          f"data.max_tokens={max_tokens}")
    return Trajectory(prompt_ids, response_ids, [0.0] * len(response_ids), "stop", group_id=0)


class SFTPipeline:
    """The SFT run: same run directory, `steps`, `resume` and checkpoint semantics as RL runs."""

    def __init__(self, config: SFTConfig, inputs: TaskInputs | None = None, step=None):
        """`step(config, tokenizer, model)`: the step that replaces plain cross-entropy (its
        `loss(batch)`, `metrics()`, `state_dict()`, `load_state_dict()`, `label`)."""
        self.config = c = config
        set_threads(c.train.num_threads)
        seed_everything(c.seed)
        # A device this machine lacks stops the run before its directory is made.
        place = trainer_device(c.device, c.train.bf16_autocast, *machine_devices())
        check_max_tokens(c)
        self.run_dir = RunDir.for_run(c.run_dir(), c.resume, c.overwrite)
        (inputs or TaskInputs()).write_files(self.run_dir.path)  # datasets passed as objects
        self.tokenizer = load_tokenizer(c.model.path)
        self.train_set = self.load(c.data.train)
        self.eval_set = self.load(c.data.eval) if c.data.eval else []
        self.steps = c.total_steps(len(self.train_set))
        model = load_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                           c.model.dropout)
        self.policy = LocalStrategy(model, c.optimizer, c.train, total_steps=self.steps,
                                    device=place.device, autocast_bf16=place.autocast_bf16,
                                    lora=c.model.lora)
        self.step = step(c, self.tokenizer, model) if step is not None else None
        self.order: list[int] = []  # the rest of the current pass over the data
        self.data_rng = random.Random(c.seed)
        self.start_step, self.eval_start = 0, None
        resume = self.run_dir.resolve_resume(c.resume)
        if resume:
            self.restore(*resume)
        self.run_dir.write_config(c)
        self.tracker = Tracker(self.run_dir.path, c.tracking,
                               resume_step=self.start_step if resume else None,
                               run_config=c.model_dump(mode="json"))

    def load(self, path: str) -> list[Trajectory]:
        d = self.config.data
        return load_prompts(path, d.system_prompt, lambda row: sft_example(
            self.tokenizer, row, d.response_key, d.max_tokens))

    def run(self) -> dict:
        c, clock = self.config, Stopwatch()
        if self.start_step == self.steps:  # resumed at its last step: nothing to do
            self.tracker.close()
            return self.run_dir.finished_summary(c.resume, self.steps)
        if self.start_step == 0:
            self.eval_start = self.eval_nll()
        label = self.step.label if self.step is not None else "SFT"
        bar = ProgressBar(self.steps, label, self.start_step, enabled=c.tracking.progress)
        guard = UpdateGuard(c.train.max_skipped_updates)
        for step in range(self.start_step + 1, self.steps + 1):
            timer = Stopwatch()
            batch, _ = collate(self.next_examples(), self.tokenizer.pad_token_id)
            loss = objective.sft_loss(batch) if self.step is None else self.step.loss(batch)
            metrics = self.policy.train_step(batch, loss)
            guard.check(step, metrics)
            metrics |= guard.metrics() | (self.step.metrics() if self.step is not None else {})
            metrics["time/step_s"] = timer.seconds()
            self.tracker.log(step, metrics)
            self.checkpoint(step)
            bar.update(step, f"nll {metrics['sft/nll']:.3f}" if "sft/nll" in metrics
                       else f"divergence {metrics['distill/divergence']:.3f}")
        bar.close()
        eval_end = self.eval_nll()
        if eval_end is not None:
            self.tracker.log(self.steps, {"eval/nll": eval_end})
        return self.finish(self.eval_start, eval_end, clock.seconds())

    def next_examples(self) -> list[Trajectory]:
        """The next `batch_size` rows of the shuffled data, reshuffled at each pass."""
        size = self.config.batch_size
        while len(self.order) < size:
            epoch = list(range(len(self.train_set)))
            self.data_rng.shuffle(epoch)
            self.order += epoch
        taken, self.order = self.order[:size], self.order[size:]
        return [self.train_set[i] for i in taken]

    def checkpoint(self, step: int) -> None:
        c = self.config
        if not checkpoint_due(c.checkpoint, step, self.steps):
            return
        with self.run_dir.writing_checkpoint(step) as directory:  # step_N/ once complete
            self.policy.save(directory, {
                "step": step, "order": list(self.order), "data_rng": self.data_rng.getstate(),
                "eval_nll_start": self.eval_start,
                "step_state": self.step.state_dict() if self.step else None})
            self.tokenizer.save_pretrained(directory)
        prune_checkpoints(self.run_dir, c.checkpoint)

    def restore(self, step: int, directory: Path) -> None:
        if step > self.steps:
            raise ConfigError(f"steps={self.steps}: the run already has {step} steps "
                              f"({directory}); resume with steps >= {step}")
        extra = self.policy.load(directory)
        self.order = list(extra["order"])
        self.data_rng.setstate(extra["data_rng"])
        self.start_step, self.eval_start = step, extra["eval_nll_start"]
        if self.step is not None:
            self.step.load_state_dict(extra["step_state"])

    def eval_nll(self) -> float | None:
        """Mean response-token negative log-likelihood on the eval set."""
        if not self.eval_set:
            return None
        batch, _ = collate(self.eval_set, self.tokenizer.pad_token_id)
        logprobs = batched_logprobs(self.policy.model, batch["input_ids"], batch["attention_mask"],
                                    self.config.train.micro_batch_size,
                                    response_mask=batch["response_mask"])
        mask = batch["response_mask"]
        return float(-(logprobs * mask).sum() / mask.sum())

    def finish(self, eval_start: float | None, eval_end: float | None, wall_time_s: float) -> dict:
        final = self.run_dir.path / "final"
        self.policy.save_model(final)  # with model.lora: the merged model
        self.tokenizer.save_pretrained(final)
        self.tracker.close()
        summary = {"run_dir": str(self.run_dir.path), "steps": self.steps,
                   "resumed_from_step": self.start_step or None,
                   "eval_nll_start": eval_start, "eval_nll_end": eval_end,
                   "wall_time_s": round(wall_time_s, 2), "final_model": str(Path(final)),
                   "final_checkpoint": str(self.run_dir.checkpoint_dir(self.steps))}
        self.run_dir.write_summary(summary)
        return summary


def train_sft(config: SFTConfig, inputs: TaskInputs | None = None, step=None) -> dict:
    """Run SFT; resuming a run whose checkpoint is at its last step changes nothing. `inputs`:
    datasets passed as Python objects (`reroll.api.sft`); `step`: see `SFTPipeline`."""
    if config.steps is not None:  # else the step count needs the data: known once it is loaded
        done = RunDir(config.run_dir()).finished_summary(config.resume, config.steps)
        if done is not None:
            return done
    return SFTPipeline(config, inputs, step).run()

"""The driver loop of the pipelines that train on preference pairs (`reroll dpo`, `reroll rm`).

The loop (run directory, data order, steps, evaluation, checkpoints, exact resume) is here; what
is trained and how is an `Objective` passed in: `dpo.DPOObjective` (the policy, a DPO-family
loss) or `rm.RewardModelObjective` (a scalar head, Bradley–Terry).

A batch of n pairs is 2n sequences interleaved `[chosen_0, rejected_0, chosen_1, ...]`, so that
any even micro-batch holds whole pairs and a pair's two responses share one forward of their
prompt (`forward_logprobs` packs rows with a common prefix).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from reroll.config.errors import ConfigError
from reroll.config.preference import PreferenceRunConfig
from reroll.data.batch import Trajectory, collate
from reroll.data.preferences import PreferenceRow, load_preferences
from reroll.models.devices import machine_devices, trainer_device
from reroll.models.loading import load_tokenizer
from reroll.pipelines.checkpoints import checkpoint_due, prune_checkpoints
from reroll.pipelines.common import RunDir, Stopwatch, UpdateGuard, seed_everything, set_threads
from reroll.pipelines.validation import check_max_tokens
from reroll.rollout.stream import encode_prompt
from reroll.tracking import ProgressBar, Tracker
from reroll.training.local import LocalStrategy

SCORE_MICRO_FACTOR = 4
"""Scoring without gradients keeps no activations for a backward: its micro-batches are this
many times `train.micro_batch_size` (3x faster scoring of the reference on the tiny model)."""
SCORE_CHUNK = 256
"""Pairs per batch when scoring a whole dataset without gradients."""


@dataclass
class Pair:
    """A tokenised preference pair: the prompt once, each response closed with EOS."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str


def tokenize_pair(tokenizer, row: PreferenceRow, max_tokens: int) -> Pair:
    """The token ids of a pair, exactly as the engine would produce them for the prompt."""
    prompt_ids = encode_prompt(tokenizer, row.prompt, max_tokens)
    eos = [tokenizer.eos_token_id]
    chosen = tokenizer.encode(row.chosen, add_special_tokens=False) + eos
    rejected = tokenizer.encode(row.rejected, add_special_tokens=False) + eos
    longest = len(prompt_ids) + max(len(chosen), len(rejected))
    if longest > max_tokens:
        raise ConfigError(f"{row.prompt.source}: {longest} tokens, over data.max_tokens="
                          f"{max_tokens}")
    return Pair(prompt_ids, chosen, rejected, row.prompt.source)


def pair_batch(pairs: list[Pair], pad_token_id: int) -> TensorDict:
    """Right-padded batch of the 2n sequences `[chosen_0, rejected_0, ...]` (`reroll.data.batch`
    keys, `response_mask` on the response tokens)."""
    rows = [Trajectory(p.prompt_ids, ids, [0.0] * len(ids), "stop", group_id=i)
            for i, p in enumerate(pairs) for ids in (p.chosen_ids, p.rejected_ids)]
    batch, _ = collate(rows, pad_token_id)
    return batch


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class Objective(Protocol):
    """What a preference pipeline trains: the model, its loss, its held-out metrics."""

    strategy: LocalStrategy
    """Holds the trained model, its optimizer and schedule (saved and restored by checkpoints)."""
    label: str
    """Shown by the progress bar."""

    def prepare(self, name: str, pairs: list[Pair]) -> None:
        """Per-pair data needed before training (the reference's log-probabilities)."""

    def add_inputs(self, batch: TensorDict, name: str, indices: list[int]) -> None:
        """Add what `loss_fn` reads besides the tokens (reference sums) to a batch of pairs."""

    def loss_fn(self, batch: TensorDict) -> Any:
        """The `Strategy.train_step` closure over micro-batches of `batch` (loss = batch mean)."""

    def evaluate(self, name: str, pairs: list[Pair]) -> dict[str, float]:
        """Held-out metrics `eval/...` (loss, accuracy, reward margin)."""

    def save_final(self, directory: Path) -> None:
        """The trained model in Hugging Face format."""


class PreferencePipeline:
    """Train `objective` on the pairs of `config.data`: steps, checkpoints and `resume` as SFT."""

    def __init__(self, config: PreferenceRunConfig, tokenizer, make_objective):
        """`make_objective(config, tokenizer, run_dir, total_steps, place)`: the Objective (its
        model loaded on `place`, the trainer's device and precision)."""
        self.config = c = config
        set_threads(c.train.num_threads)
        seed_everything(c.seed)
        # A device this machine lacks stops the run before its directory is made.
        place = trainer_device(c.device, c.train.bf16_autocast, *machine_devices())
        check_max_tokens(c)
        self.run_dir = RunDir.for_run(c.run_dir(), c.resume, c.overwrite)
        self.tokenizer = tokenizer
        self.train_set = self.load(c.data.train)
        self.eval_set = self.load(c.data.eval) if c.data.eval else []
        self.steps = c.total_steps(len(self.train_set))
        self.objective = make_objective(c, tokenizer, self.run_dir.path, self.steps, place)
        self.objective.prepare("train", self.train_set)
        if self.eval_set:
            self.objective.prepare("eval", self.eval_set)
        self.order: list[int] = []
        self.data_rng = random.Random(c.seed)
        self.start_step, self.eval_start = 0, None
        resume = self.run_dir.resolve_resume(c.resume)
        if resume:
            self.restore(*resume)
        self.run_dir.write_config(c)
        self.tracker = Tracker(self.run_dir.path, c.tracking,
                               resume_step=self.start_step if resume else None,
                               run_config=c.model_dump(mode="json"))

    def load(self, path: str) -> list[Pair]:
        d = self.config.data
        return load_preferences(path, d.system_prompt,
                                lambda row: tokenize_pair(self.tokenizer, row, d.max_tokens))

    def run(self) -> dict:
        c, clock = self.config, Stopwatch()
        if self.start_step == self.steps:
            self.tracker.close()
            return self.run_dir.finished_summary(c.resume, self.steps)
        if self.start_step == 0:
            self.eval_start = self.evaluate()
            if self.eval_start:
                self.tracker.log(0, self.eval_start)
        bar = ProgressBar(self.steps, self.objective.label, self.start_step,
                          enabled=c.tracking.progress)
        guard, eval_end = UpdateGuard(c.train.max_skipped_updates), self.eval_start
        for step in range(self.start_step + 1, self.steps + 1):
            timer = Stopwatch()
            batch = self.next_batch()
            metrics = self.objective.strategy.train_step(batch, self.objective.loss_fn(batch))
            guard.check(step, metrics)
            metrics |= guard.metrics()
            if self.eval_due(step):
                eval_end = self.evaluate()
                metrics |= eval_end
            metrics["time/step_s"] = timer.seconds()
            self.tracker.log(step, metrics)
            self.checkpoint(step)
            bar.update(step, f"loss {metrics['train/loss']:.3f} | acc "
                             f"{metrics['pref/accuracy']:.2f}")
        bar.close()
        return self.finish(eval_end, clock.seconds())

    def next_batch(self) -> TensorDict:
        """The next `batch_size` pairs of the shuffled data, reshuffled at each pass, in order
        of length (`by_length`)."""
        size = self.config.batch_size
        while len(self.order) < size:
            epoch = list(range(len(self.train_set)))
            self.data_rng.shuffle(epoch)
            self.order += epoch
        taken, self.order = self.order[:size], self.order[size:]
        pairs = [self.train_set[i] for i in taken]
        # Shortest first: micro-batches of similar lengths pad less (the mean loss is the same).
        shortest_first = by_length(pairs)
        taken = [taken[i] for i in shortest_first]
        batch = pair_batch([pairs[i] for i in shortest_first], self.tokenizer.pad_token_id)
        self.objective.add_inputs(batch, "train", taken)
        return batch

    def eval_due(self, step: int) -> bool:
        every = self.config.eval_every_steps
        return bool(self.eval_set) and (step == self.steps or bool(every and step % every == 0))

    def evaluate(self) -> dict[str, float]:
        return self.objective.evaluate("eval", self.eval_set) if self.eval_set else {}

    def checkpoint(self, step: int) -> None:
        c = self.config
        if not checkpoint_due(c.checkpoint, step, self.steps):
            return
        with self.run_dir.writing_checkpoint(step) as directory:  # step_N/ once complete
            self.objective.strategy.save(directory, {
                "step": step, "order": list(self.order), "data_rng": self.data_rng.getstate(),
                "eval_start": self.eval_start})
            self.tokenizer.save_pretrained(directory)
        prune_checkpoints(self.run_dir, c.checkpoint)

    def restore(self, step: int, directory: Path) -> None:
        if step > self.steps:
            raise ConfigError(f"steps={self.steps}: the run already has {step} steps "
                              f"({directory}); resume with steps >= {step}")
        extra = self.objective.strategy.load(directory)
        self.order = list(extra["order"])
        self.data_rng.setstate(extra["data_rng"])
        self.start_step, self.eval_start = step, extra["eval_start"]

    def finish(self, eval_end: dict[str, float] | None, wall_time_s: float) -> dict:
        final = self.run_dir.path / "final"
        self.objective.save_final(final)
        self.tokenizer.save_pretrained(final)
        self.tracker.close()
        start = self.eval_start or {}
        summary = {"run_dir": str(self.run_dir.path), "steps": self.steps,
                   "resumed_from_step": self.start_step or None,
                   "eval_accuracy_start": start.get("eval/accuracy"),
                   "eval_accuracy_end": (eval_end or {}).get("eval/accuracy"),
                   "eval_reward_margin_end": (eval_end or {}).get("eval/reward_margin"),
                   "wall_time_s": round(wall_time_s, 2), "final_model": str(final),
                   "final_checkpoint": str(self.run_dir.checkpoint_dir(self.steps))}
        self.run_dir.write_summary(summary)
        return summary


def finished(config: PreferenceRunConfig) -> dict | None:
    """The summary of a resumed run already at its last step (None: there is work to do)."""
    if config.steps is None:
        return None
    return RunDir(config.run_dir()).finished_summary(config.resume, config.steps)


def score_all_pairs(pairs: list[Pair], pad_token_id: int,
                    score_batch: Callable[[TensorDict], torch.Tensor]) -> torch.Tensor:
    """[N, 2] (chosen, rejected) scores of every pair, without gradients: `score_batch` maps a
    `pair_batch` of up to SCORE_CHUNK pairs to its [2n] sequence scores.

    The pairs are scored in order of length (`by_length`), so that a micro-batch's packed rows
    are about as long as each other and little of its forward is padding (a quarter of the
    tokens of the arithmetic pairs in data order); the scores come back in the pairs' order."""
    order = by_length(pairs)
    with torch.inference_mode():
        scores = torch.cat([score_batch(pair_batch([pairs[i] for i in part], pad_token_id))
                            .reshape(-1, 2) for part in chunks(order, SCORE_CHUNK)])
    out = torch.empty_like(scores)
    out[torch.tensor(order, dtype=torch.long)] = scores
    return out


def packed_length(pair: Pair) -> int:
    """Tokens of the pair's packed row: the prompt once, then both responses."""
    return len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)


def by_length(pairs: list[Pair]) -> list[int]:
    """Indices of `pairs`, shortest packed row first (ties in data order)."""
    return sorted(range(len(pairs)), key=lambda i: packed_length(pairs[i]))


def train_preferences(config: PreferenceRunConfig, make_objective) -> dict:
    """Run the preference pipeline with its objective (`dpo.DPOObjective`,
    `rm.RewardModelObjective`); resuming a run already at its last step changes nothing."""
    done = finished(config)
    if done is not None:
        return done
    return PreferencePipeline(config, load_tokenizer(config.model.path), make_objective).run()

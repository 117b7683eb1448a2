"""The step of the pipelines that train on preference pairs (`reroll dpo`, `reroll rm`).

The step (data order, evaluation, greedy samples of held-out prompts) is here, the loop in
`reroll.pipelines.run`; what is trained and how is a `PreferenceObjective` passed in:
`dpo.DPOObjective` (the policy, a DPO-family loss) or `rm.RewardModelObjective` (a scalar head,
Bradley–Terry). (Not the RL step's `reroll.pipelines.objective.Objective`, the algorithm's
resolved callables.)

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
from reroll.pipelines.common import UpdateGuard
from reroll.pipelines.task import held_out
from reroll.pipelines.validation import check_max_tokens
from reroll.rollout.recording import write_rows
from reroll.rollout.stream import encode_prompt
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


class PreferenceObjective(Protocol):
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

    answers: bool
    """Whether the trained model answers prompts (a policy; a reward model only scores)."""

    def answer(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The model's greedy answer (token ids) to each prompt."""


class PreferenceStep:
    """The preference run's step (`reroll.pipelines.run.Step`): `objective` trained on the next
    pairs of the shuffled data; held-out pairs scored, and a few held-out prompts answered
    greedily before the first and after the last step (`sample_prompts`)."""

    start_row = True
    phase = "training"

    def __init__(self, config: PreferenceRunConfig, place, run_dir: Path, make_objective):
        """`make_objective(config, tokenizer, run_dir, total_steps, place)`: the
        `PreferenceObjective` (its model loaded on `place`, the trainer's device and precision)."""
        self.config = c = config
        self.run_dir = run_dir
        self.tokenizer = load_tokenizer(c.model.path)
        self.train_set = self.read(c.data.train)
        self.eval_set = self.read(c.data.eval) if c.data.eval else []
        self.eval_what = held_out(len(self.eval_set), "pair") if self.eval_set else ""
        self.steps, self.eval_every = c.total_steps(len(self.train_set)), c.eval_every_steps
        self.objective = make_objective(c, self.tokenizer, run_dir, self.steps, place)
        self.label = self.objective.label
        self.objective.prepare("train", self.train_set)
        if self.eval_set:
            self.objective.prepare("eval", self.eval_set)
        self.order: list[int] = []
        self.data_rng = random.Random(c.seed)
        self.guard = UpdateGuard(c.train.max_skipped_updates)

    def read(self, path: str) -> list[Pair]:
        d = self.config.data
        return load_preferences(path, d.system_prompt,
                                lambda row: tokenize_pair(self.tokenizer, row, d.max_tokens))

    def next_batch(self, step: int) -> TensorDict:
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

    def train(self, batch: TensorDict, step: int) -> dict[str, float]:
        metrics = self.objective.strategy.train_step(batch, self.objective.loss_fn(batch))
        self.guard.check(step, metrics)
        return metrics | self.guard.metrics()

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out pairs' metrics; before the first and after the last step, also the
        policy's greedy answers to the first `sample_prompts` held-out prompts."""
        metrics = self.objective.evaluate("eval", self.eval_set)
        count = self.config.sample_prompts if step in (0, self.steps) else 0
        if count and self.objective.answers:
            rows = self.sample(self.eval_set[:count])
            write_rows(self.run_dir / "rollouts" / f"eval_step_{step}.jsonl", rows)
        return metrics

    def sample(self, pairs: list[Pair]) -> list[dict[str, Any]]:
        """The policy's greedy answer to each pair's prompt, as rows of `reroll view`."""
        decode = self.tokenizer.decode
        answers = self.objective.answer([p.prompt_ids for p in pairs],
                                        self.config.sample_max_new_tokens)
        return [{"prompt": decode(p.prompt_ids), "response": decode(ids, skip_special_tokens=True),
                 "chosen": decode(p.chosen_ids, skip_special_tokens=True), "reward": None,
                 "finish_reason": "stop" if ids and ids[-1] == self.tokenizer.eos_token_id
                 else "length", "group_id": i, "source": p.source}
                for i, (p, ids) in enumerate(zip(pairs, answers, strict=True))]

    def record(self, step: int, batch: TensorDict) -> None:
        """Nothing is sampled while training: the pairs are the record."""

    def status(self, metrics: dict[str, float]) -> str:
        return f"loss {metrics['train/loss']:.3f} | acc {metrics['pref/accuracy']:.2f}"

    def state_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "data_rng": self.data_rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order = list(state["order"])
        self.data_rng.setstate(state["data_rng"])

    def save(self, directory: Path, state: dict[str, Any]) -> None:
        self.objective.strategy.save(directory, state)
        self.tokenizer.save_pretrained(directory)

    def load(self, directory: Path) -> dict[str, Any]:
        return self.objective.strategy.load(directory)

    def save_final(self, directory: Path) -> dict[str, Any]:
        self.objective.save_final(directory)
        self.tokenizer.save_pretrained(directory)
        return {"final_model": str(directory)}

    def summary_keys(self, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
        return {"eval_accuracy_start": start.get("eval/accuracy"),
                "eval_accuracy_end": end.get("eval/accuracy"),
                "eval_reward_margin_end": end.get("eval/reward_margin")}

    def close(self) -> None:
        """Nothing runs besides this process."""


def preference_step(config: PreferenceRunConfig, make_objective):
    """A preference pipeline's step factory; a device this machine lacks stops the run here,
    before its directory is made."""
    place = trainer_device(config.device, config.train.bf16_autocast, *machine_devices())
    check_max_tokens(config)
    return lambda run_dir, inputs: PreferenceStep(config, place, run_dir, make_objective)


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

"""`reroll rm`: a Bradley–Terry reward model trained on preference pairs.

The model is the causal LM's backbone with a scalar head (`AutoModelForSequenceClassification`,
one label); a response's score is the head at its last token (the closing EOS). `final/` holds it
in Hugging Face format, which `reward: {type: model, path: ...}` and transformers load directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor

from reroll.algorithms.preference import bradley_terry_loss
from reroll.config.preference import RMConfig
from reroll.models.devices import RoleDevice
from reroll.models.loading import load_scalar_model
from reroll.pipelines import run
from reroll.pipelines.preference import (
    SCORE_MICRO_FACTOR,
    Pair,
    preference_step,
    score_all_pairs,
)
from reroll.rewards.model import sequence_scores
from reroll.training.local import LocalStrategy


def score_pairs(model: torch.nn.Module, pairs: list[Pair], pad_token_id: int,
                micro_batch_size: int) -> Tensor:
    """[N, 2] scores of (chosen, rejected) of every pair, without gradients."""
    def scores(batch: TensorDict) -> Tensor:
        out, device = [], next(model.parameters()).device  # inputs to the model, scores back
        for start in range(0, batch.batch_size[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            mask = batch["attention_mask"][rows]
            width = int(mask.sum(-1).max())
            out.append(sequence_scores(model, batch["input_ids"][rows, :width].to(device),
                                       mask[:, :width].to(device)).cpu())
        return torch.cat(out)

    return score_all_pairs(pairs, pad_token_id, scores)


class RewardModelObjective:
    """The scalar-head model trained with the Bradley–Terry loss."""

    def __init__(self, config: RMConfig, tokenizer, run_dir: Path, total_steps: int,
                 place: RoleDevice):
        self.config = c = config
        self.pad_id = tokenizer.pad_token_id
        self.label = "reward model"
        model = load_scalar_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                                  pad_token_id=self.pad_id)
        self.strategy = LocalStrategy(model, c.optimizer, c.train, total_steps=total_steps,
                                      device=place.device, autocast_bf16=place.autocast_bf16)

    def prepare(self, name: str, pairs: list[Pair]) -> None:
        """Nothing to compute ahead: a reward model has no reference."""

    def add_inputs(self, batch: TensorDict, name: str, indices: list[int]) -> None:
        """The tokens are all the loss reads."""

    def loss_fn(self, batch: TensorDict) -> Callable:
        num_pairs, center = batch.batch_size[0] // 2, self.config.center_coef

        def fn(model: torch.nn.Module, micro: TensorDict) -> tuple[Tensor, dict]:
            scores = sequence_scores(model, micro["input_ids"], micro["attention_mask"])
            loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2], center_coef=center,
                                               num_pairs=num_pairs)
            return loss, {f"pref/{k}": v for k, v in metrics.items()}

        return fn

    def evaluate(self, name: str, pairs: list[Pair]) -> dict[str, float]:
        """Bradley–Terry loss, pairwise accuracy and score margin on held-out pairs."""
        self.strategy.model.eval()
        scores = score_pairs(self.strategy.model, pairs, self.pad_id,
                             SCORE_MICRO_FACTOR * self.config.train.micro_batch_size)
        loss, metrics = bradley_terry_loss(scores[:, 0], scores[:, 1],
                                           center_coef=self.config.center_coef)
        return {"eval/loss": float(loss)} | {f"eval/{k}": float(v) for k, v in metrics.items()}

    def save_final(self, directory: Path) -> None:
        self.strategy.model.save_pretrained(directory)

    answers = False  # a scorer: its held-out figures are the pairs' scores (no `answer`)


def rm_step(config: RMConfig):
    """The step factory of `pipeline: rm` (`reroll.config.pipelines`)."""
    return preference_step(config, RewardModelObjective)


def train_rm(config: RMConfig) -> dict:
    """Train a reward model; resuming a run already at its last step changes nothing."""
    return run.train(config)

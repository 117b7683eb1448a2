"""`reroll dpo`: the DPO family on preference pairs (sigmoid DPO, cDPO, IPO, SimPO, ORPO).

The reference policy's log-probabilities of every pair are computed once, before the first
step, and kept in the run directory (`reference_logprobs.pt`), so training holds one model. The
step is `reroll.pipelines.preference`, the loop `reroll.pipelines.run`; this module is the
objective: which losses, on what.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor

from reroll.algorithms.preference import dpo_loss, ipo_loss, orpo_loss, simpo_loss
from reroll.config.preference import REFERENCE_FREE, DPOConfig
from reroll.models.devices import RoleDevice
from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs, forward_logprobs
from reroll.pipelines import run
from reroll.pipelines.preference import (
    SCORE_MICRO_FACTOR,
    Pair,
    preference_step,
    score_all_pairs,
)
from reroll.training.local import LocalStrategy

REFERENCE_FILE = "reference_logprobs.pt"

log = logging.getLogger(__name__)


def load_reference_cache(path: Path) -> dict[str, Tensor]:
    """The cached reference sums of a run (split -> [N, 2]); empty when there are none, or when
    the file cannot be read (a run killed while writing it): they are then computed again,
    from the same initial policy or `reference` model, so nothing is lost but the time."""
    if not path.is_file():
        return {}
    try:
        cache = torch.load(path)
        if isinstance(cache, dict) and all(isinstance(v, Tensor) for v in cache.values()):
            return cache
        problem = "not a dict of tensors"
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: recomputed
        problem = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    log.warning("%s cannot be read (%s): the reference log-probabilities are computed again",
                path, problem)
    return {}


def save_reference_cache(cache: dict[str, Tensor], path: Path) -> None:
    """Written beside, then renamed: a kill during the write leaves the old file or none."""
    partial = path.with_name(path.name + ".partial")
    torch.save(cache, partial)
    os.replace(partial, path)


def _sigmoid(cfg, sums, counts, ref, num_pairs):
    return dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta=cfg.beta,
                    label_smoothing=cfg.label_smoothing, num_pairs=num_pairs)


def _ipo(cfg, sums, counts, ref, num_pairs):
    avg, ref_avg = sums / counts, ref / counts
    return ipo_loss(avg[0::2], avg[1::2], ref_avg[0::2], ref_avg[1::2], beta=cfg.beta,
                    num_pairs=num_pairs)


def _simpo(cfg, sums, counts, ref, num_pairs):
    avg = sums / counts
    return simpo_loss(avg[0::2], avg[1::2], beta=cfg.beta, gamma=cfg.gamma, num_pairs=num_pairs)


def _orpo(cfg, sums, counts, ref, num_pairs):
    avg = sums / counts
    return orpo_loss(avg[0::2], avg[1::2], -avg[0::2], lam=cfg.lam, num_pairs=num_pairs)


PREFERENCE_LOSSES: dict[str, Callable[..., tuple[Tensor, dict]]] = {
    "sigmoid": _sigmoid, "ipo": _ipo, "simpo": _simpo, "orpo": _orpo}
"""`loss.name` -> (cfg, sums [2n], token counts [2n], reference sums [2n], num_pairs) ->
(loss, metrics), the sequences interleaved chosen, rejected. Sums or token means as each loss
is defined (`reroll.algorithms.preference`)."""


def sequence_sums(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(summed log-probability [B], response token count [B]) of each row's response."""
    return (logprobs * mask).sum(-1), mask.sum(-1)


def pair_logprobs(model: torch.nn.Module, pairs: list[Pair], pad_token_id: int,
                micro_batch_size: int) -> Tensor:
    """Summed response log-probabilities of every pair under `model`, without gradients:
    [N, 2] (chosen, rejected)."""
    def sums(batch: TensorDict) -> Tensor:
        mask = batch["response_mask"]
        logprobs = batched_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                    micro_batch_size, response_mask=mask)
        return sequence_sums(logprobs, mask)[0]

    return score_all_pairs(pairs, pad_token_id, sums)


def token_counts(pairs: list[Pair]) -> Tensor:
    """[N, 2] response lengths (EOS included) of chosen and rejected."""
    return torch.tensor([[len(p.chosen_ids), len(p.rejected_ids)] for p in pairs],
                        dtype=torch.float32)


class DPOObjective:
    """The policy trained with a DPO-family loss against cached reference log-probabilities."""

    def __init__(self, config: DPOConfig, tokenizer, run_dir: Path, total_steps: int,
                 place: RoleDevice):
        self.config = c = config
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.label = f"DPO {c.loss.name}"
        model = load_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                           c.model.dropout)
        # With model.lora the adapter starts as a no-op, so the reference scored before the
        # first step (below) is the base model, as without it.
        self.strategy = LocalStrategy(model, c.optimizer, c.train, total_steps=total_steps,
                                      device=place.device, autocast_bf16=place.autocast_bf16,
                                      lora=c.model.lora)
        self.cache_path = run_dir / REFERENCE_FILE
        self.cache = load_reference_cache(self.cache_path)
        self.reference: dict[str, Tensor] = {}

    def prepare(self, name: str, pairs: list[Pair]) -> None:
        """The reference's [N, 2] sums for `pairs`: from the run's cache when it matches, else
        computed now (the initial policy, or `reference`'s model) and cached."""
        if self.config.loss.name in REFERENCE_FREE:
            self.reference[name] = torch.zeros(len(pairs), 2)
            return
        cached = self.cache.get(name)
        if cached is not None and cached.shape == (len(pairs), 2):
            self.reference[name] = cached
            return
        c = self.config
        model = self.strategy.model if c.reference is None else load_model(
            c.reference, c.model.dtype, c.model.attn_implementation, field="reference").to(
            self.strategy.device)
        self.reference[name] = pair_logprobs(model, pairs, self.pad_id,
                                           SCORE_MICRO_FACTOR * c.train.micro_batch_size)
        self.cache[name] = self.reference[name]
        save_reference_cache(self.cache, self.cache_path)

    def add_inputs(self, batch: TensorDict, name: str, indices: list[int]) -> None:
        batch["ref_sums"] = self.reference[name][indices].reshape(-1)

    def loss_fn(self, batch: TensorDict) -> Callable:
        cfg, num_pairs = self.config.loss, batch.batch_size[0] // 2
        loss = PREFERENCE_LOSSES[cfg.name]

        def fn(model: torch.nn.Module, micro: TensorDict) -> tuple[Tensor, dict]:
            mask = micro["response_mask"]
            logprobs, _ = forward_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                           response_mask=mask)
            sums, counts = sequence_sums(logprobs, mask)
            value, metrics = loss(cfg, sums, counts, micro["ref_sums"], num_pairs)
            return value, {f"pref/{k}": v for k, v in metrics.items()}

        return fn

    def evaluate(self, name: str, pairs: list[Pair]) -> dict[str, float]:
        """Loss, implicit-reward accuracy and margin on held-out pairs; `logprob_accuracy`: the
        share of pairs whose chosen response the policy itself finds likelier."""
        model = self.strategy.model
        sums = pair_logprobs(model, pairs, self.pad_id,
                           SCORE_MICRO_FACTOR * self.config.train.micro_batch_size)
        counts, ref = token_counts(pairs).reshape(-1), self.reference[name].reshape(-1)
        loss, metrics = PREFERENCE_LOSSES[self.config.loss.name](
            self.config.loss, sums.reshape(-1), counts, ref, None)
        out = {f"eval/{k}": float(v) for k, v in metrics.items()}
        out["eval/loss"] = float(loss)
        out["eval/logprob_accuracy"] = float((sums[:, 0] > sums[:, 1]).float().mean())
        return out

    def save_final(self, directory: Path) -> None:
        self.strategy.save_model(directory)  # with model.lora: the merged model

    answers = True

    @torch.no_grad()
    def answer(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The policy's greedy answers, one prompt at a time (no padding to get wrong)."""
        model, device = self.strategy.model, self.strategy.device
        was_training = model.training
        model.eval()
        out = []
        for ids in prompts:
            tokens = torch.tensor([ids], device=device)
            generated = model.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=self.eos_id, pad_token_id=self.pad_id)
            out.append(generated[0, len(ids):].tolist())
        model.train(was_training)
        return out


def dpo_step(config: DPOConfig):
    """The step factory of `pipeline: dpo` (`reroll.config.pipelines`)."""
    return preference_step(config, DPOObjective)


def train_dpo(config: DPOConfig) -> dict:
    """Run a DPO-family training; resuming a run already at its last step changes nothing."""
    return run.train(config)

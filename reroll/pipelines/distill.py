"""Offline distillation (`reroll distill`): the SFT run (data, steps, checkpoints, exact resume,
run directory) with its loss taken against a teacher's next-token distribution.

Per step: the teacher reads the batch (prompt + target response) once, without gradients, and
keeps its `top_k` most likely next tokens and their log-probabilities at every response position
([B, T, k]: a 150k vocabulary costs k numbers per token, not 150k); the student's loss is the
chosen divergence on those k tokens plus a tail bucket (reroll/algorithms/distillation.py), times
temperature squared, plus `sft_coef` x the targets' cross-entropy. `distill/teacher_tokens`
counts the positions the teacher has scored, the unit on-policy distillation is compared in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from reroll import algorithms
from reroll.algorithms import distillation
from reroll.config.distill import DistillConfig, TeacherConfig
from reroll.config.errors import ConfigError
from reroll.models.loading import load_model, load_tokenizer
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.sft import sft_step, train_sft


def check_same_tokenizer(teacher_path: str, student_tokenizer, teacher_width: int,
                         student_width: int, where: str = "teacher.path") -> None:
    """Teacher and student must give every token the same id, and their logits the same width:
    the divergence compares their probabilities token id by token id."""
    teacher_tokenizer = load_tokenizer(teacher_path, field=where)
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        ours, theirs = len(student_tokenizer), len(teacher_tokenizer)
        raise ConfigError(f"{where}: the teacher's tokenizer ({teacher_path}, {theirs} tokens) is "
                          f"not the student's ({ours} tokens): distillation compares the two "
                          "models token id by token id, so they must share one tokenizer")
    if teacher_width != student_width:
        raise ConfigError(f"{where}: the teacher's output layer has {teacher_width} logits and "
                          f"the student's {student_width}; they must match")


def next_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T-1, V] log-probabilities of the token at each position 1..T-1 (from the logits one
    position before it), at `temperature`."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return torch.log_softmax(logits.float() / temperature, -1)


class OfflineTeacher:
    """The teacher model, forward passes only; counts the response positions it scores."""

    def __init__(self, config: TeacherConfig, student_tokenizer, student_width: int,
                 micro_batch_size: int, device: torch.device | str = "cpu"):
        """`device`: the student's (the teacher scores where the student trains)."""
        self.device = torch.device(device)
        self.model = load_model(config.path, config.dtype, field="teacher.path").eval().to(
            self.device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        check_same_tokenizer(config.path, student_tokenizer,
                             self.model.get_output_embeddings().weight.shape[0], student_width)
        self.micro_batch_size = micro_batch_size
        self.tokens = 0

    @torch.no_grad()
    def top_k(self, batch: TensorDict, k: int, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, logprobs) [B, T, k] of the teacher's k likeliest tokens at every position
        (position t: the distribution of token t; position 0 is never a response token)."""
        ids, logprobs = [], []
        for start in range(0, batch.batch_size[0], self.micro_batch_size):
            micro = batch[start:start + self.micro_batch_size]
            full = next_token_logprobs(self.model, micro["input_ids"].to(self.device),
                                       micro["attention_mask"].to(self.device), temperature)
            top = full.topk(k, dim=-1)  # back to the CPU with the batch
            ids.append(F.pad(top.indices, (0, 0, 1, 0)).cpu())
            logprobs.append(F.pad(top.values, (0, 0, 1, 0)).cpu())
        self.tokens += int(batch["response_mask"].sum())
        return torch.cat(ids), torch.cat(logprobs)


def distill_loss(batch: TensorDict, cfg) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """The student's loss on `batch` (which carries `teacher_ids`, `teacher_logprobs`), averaged
    over all response tokens of the batch (the micro-batches' sum is the batch's mean)."""
    num_tokens, _ = algorithms.loss_normalisers(batch["response_mask"])
    divergence = distillation.DIVERGENCES[cfg.divergence]
    extra = {"beta": cfg.beta} if cfg.divergence == "jsd" else {}
    t = cfg.temperature

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"]
        student = next_token_logprobs(model, micro["input_ids"], micro["attention_mask"], t)
        at_teacher = F.pad(student.gather(-1, micro["teacher_ids"][:, 1:]), (0, 0, 1, 0))
        per_token = divergence(at_teacher, micro["teacher_logprobs"], **extra) * t * t
        loss = algorithms.aggregate_loss(per_token, mask, "token_mean", num_tokens=num_tokens)
        stats = {"distill/divergence": algorithms.masked_mean(per_token.detach(), mask)}
        if cfg.sft_coef or t == 1.0:  # the targets' nll, at temperature 1
            plain = student if t == 1.0 else next_token_logprobs(
                model, micro["input_ids"], micro["attention_mask"], 1.0)
            nll = -F.pad(plain.gather(-1, micro["input_ids"][:, 1:, None])[..., 0], (1, 0))
            if cfg.sft_coef:
                loss = loss + cfg.sft_coef * algorithms.aggregate_loss(
                    nll, mask, "token_mean", num_tokens=num_tokens)
            stats["sft/nll"] = algorithms.masked_mean(nll.detach(), mask)
        return loss, stats

    return loss_fn


class TeacherLoss:
    """The loss of a distill run's SFT step (`sft.SFTStep`): the teacher's top-k, then the
    divergence."""

    label = "distillation"

    def __init__(self, config: DistillConfig, student_tokenizer, student: torch.nn.Module):
        width = student.get_output_embeddings().weight.shape[0]
        self.config = config
        self.teacher = OfflineTeacher(config.teacher, student_tokenizer, width,
                               config.train.micro_batch_size, next(student.parameters()).device)

    def loss(self, batch: TensorDict) -> Callable:
        d = self.config.distill
        batch["teacher_ids"], batch["teacher_logprobs"] = self.teacher.top_k(
            batch, d.top_k, d.temperature)
        return distill_loss(batch, d)

    def metrics(self) -> dict[str, float]:
        return {"distill/teacher_tokens": float(self.teacher.tokens)}

    def state_dict(self) -> dict:
        return {"teacher_tokens": self.teacher.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.tokens = int(state["teacher_tokens"])


def distill_step(config: DistillConfig):
    """The step factory of `pipeline: distill` (`reroll.config.pipelines`): SFT's step with the
    teacher's loss."""
    return sft_step(config, make_loss=TeacherLoss)


def train_distill(config: DistillConfig, inputs: TaskInputs | None = None) -> dict:
    """Run offline distillation (an SFT run whose loss is `TeacherLoss`)."""
    return train_sft(config, inputs)

"""`reroll distill CONFIG.yaml`: offline knowledge distillation from a teacher's top-k next-token
distribution on the SFT data (docs/distillation.md); and the teacher of on-policy distillation in
RL runs (`algorithm.distill`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reroll.config.base import Section
from reroll.config.schema import SFTConfig
from reroll.config.teacher import TeacherConfig


class DistillLoss(Section):
    """What the student is trained on."""

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """`forward_kl`: KL(teacher || student), mass-covering (Hinton KD); `reverse_kl`:
    KL(student || teacher), mode-seeking (MiniLLM); `jsd`: GKD's generalized Jensen-Shannon
    divergence with `beta`. All on the teacher's top-k tokens plus one tail bucket
    (reroll/algorithms/distillation.py)."""
    beta: float = Field(0.5, gt=0, lt=1)
    """`jsd` only: the mixture M = beta teacher + (1 - beta) student."""
    top_k: int = Field(32, ge=1, le=4096)
    """Teacher tokens kept per position; the rest of its probability is one tail bucket."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Both models' logits are divided by this before the softmax (the loss is then multiplied by
    its square, so gradients keep their scale, as in Hinton et al.)."""
    sft_coef: float = Field(0.0, ge=0)
    """Adds this times the response tokens' cross-entropy (the data's own targets) to the loss."""


class DistillConfig(SFTConfig):
    """`reroll distill CONFIG.yaml`: the SFT run's data, steps, checkpoints and resume, with the
    loss taken against a teacher's next-token distribution on every response token."""

    pipeline: Literal["distill"] = "distill"  # type: ignore[assignment]
    """Which pipeline this config is for."""
    name: str = Field("distill", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    teacher: TeacherConfig
    distill: DistillLoss = Field(default_factory=DistillLoss)

    @model_validator(mode="after")
    def _not_itself(self) -> DistillConfig:
        if self.teacher.path.rstrip("/") == self.model.path.rstrip("/") and \
                self.model.lora is None:
            raise ValueError("teacher.path is the student's model.path: the divergence starts at "
                             "0 and stays there; give a different (stronger) teacher")
        return self

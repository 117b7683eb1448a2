"""`algorithm.distill`: on-policy distillation from a teacher model, on the student's own
samples (docs/distillation.md). Offline distillation (`reroll distill`) is `reroll.config.distill`;
the two share the teacher section and the divergence names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reroll.config.base import Section
from reroll.config.teacher import TeacherConfig


class OnPolicyDistillConfig(Section):
    """On-policy distillation: a teacher scores the student's own samples token by token
    (docs/distillation.md). `pure`/`mixed`: A_t = log pi_teacher(y_t) - log pi_student(y_t) (the
    per-token reverse KL of the sampled token, negated) is the advantage; `dense`: GKD's loss,
    the divergence between the two models' next-token distributions at every position. Each
    teacher is placed like the reference: in this process, or (`executor: ray`) in Ray actors
    placed as `distributed.reference` says."""

    teacher: TeacherConfig | None = None
    """The teacher of every sample (with `teachers`: of the rows without a `tag` column).
    None: `teachers` must route every training row."""
    teachers: dict[str, TeacherConfig] = Field(default_factory=dict)
    """Several teachers routed by a data tag: the value of a training row's `tag` column ->
    the teacher of its samples (e.g. `{math: {path: ...}, code: {path: ...}}`). Every training
    row is checked at start: a tag that names no teacher, or a row without a tag when no
    `teacher` takes those, is an error naming its file and line (exit 2). RLVR runs only
    (agentic episodes have no rows)."""
    mode: Literal["pure", "mixed", "dense"] = "pure"
    """`pure`: the teacher's per-token advantage replaces the task's (no reward needed to
    learn); `mixed`: it is added to the task's advantage times `coef`; `dense` (GKD with
    lambda = 1): the loss is `divergence` between the teacher's top-`top_k` distribution and
    the student's at every response position of the student's samples, and replaces the policy
    loss (the task's reward is logged, no advantage is estimated, `policy_loss` is unused, and
    `rollout.group_size` may be 1; with `task_coef` > 0 the task's policy loss is added). The
    teacher scores the same tokens in every mode
    (`distill/teacher_tokens`)."""
    coef: float = Field(1.0, gt=0)
    """`mixed` only: the weight of the teacher's per-token advantage."""
    baseline: Literal["none", "mean"] = "none"
    """`pure`/`mixed`: subtracted from the per-token advantage: `none`, or `mean` (its mean over
    the step's response tokens; a constant baseline, so the expected gradient is unchanged while
    the mostly negative one-sample advantages are centred)."""
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """`dense` only, as `reroll distill`'s `distill.divergence`: `forward_kl` KL(teacher ||
    student), `reverse_kl` KL(student || teacher), `jsd` the generalized Jensen-Shannon
    divergence with `beta`; on the teacher's top-k tokens plus one tail bucket. Logged per step
    as `distill/<divergence>`."""
    beta: float = Field(0.5, gt=0, lt=1)
    """`dense` with `divergence: jsd` only: the mixture M = beta teacher + (1 - beta) student."""
    task_coef: float = Field(0.0, ge=0)
    """`dense` only: 0: the divergence alone is the loss; > 0: loss = divergence + task_coef x
    the policy loss (`policy_loss`) on the task reward's advantage, as when distillation is
    off, so the advantage is estimated and its `rollout.group_size` rule applies. Both parts
    are logged (`distill/divergence_loss`, `distill/task_loss`)."""
    top_k: int = Field(32, ge=1, le=4096)
    """`dense` only: teacher tokens kept per position (at most the vocabulary); the rest of its
    probability is one tail bucket."""

    @model_validator(mode="after")
    def _some_teacher(self) -> OnPolicyDistillConfig:
        if self.teacher is None and not self.teachers:
            raise ValueError("algorithm.distill: give a `teacher` (every sample) or `teachers` "
                             "(routed by the rows' `tag`), or both")
        given = self.model_fields_set
        if self.mode != "dense":
            wrong = sorted(given & {"divergence", "beta", "top_k", "task_coef"})
            if wrong:
                raise ValueError(f"algorithm.distill.{wrong[0]} is used by mode: dense only "
                                 f"(mode is {self.mode})")
        else:
            wrong = sorted(given & {"baseline", "coef"})
            if wrong:
                raise ValueError(f"algorithm.distill.{wrong[0]} is used by mode: pure/mixed "
                                 f"only; mode: dense trains on the divergence itself")
        if "beta" in given and self.divergence != "jsd":
            raise ValueError(f"algorithm.distill.beta is used by divergence: jsd only "
                             f"(divergence is {self.divergence})")
        return self

    @property
    def dense(self) -> bool:
        """The loss is the divergence at every position (`mode: dense`), not an advantage."""
        return self.mode == "dense"

    @property
    def with_task(self) -> bool:
        """The task's policy loss joins the dense divergence (`task_coef` > 0): an advantage is
        estimated."""
        return self.dense and self.task_coef > 0

    def names(self) -> list[str | None]:
        """The teachers in routing order: None (the default `teacher`, when set) first, then
        the keys of `teachers`."""
        return ([None] if self.teacher is not None else []) + list(self.teachers)

    def route(self, tag: str | None) -> str | None:
        """The name of the teacher of a row with this `tag`: a key of `teachers`, or None for
        the default `teacher` (rows are checked at start, so every tag is routed)."""
        return tag if tag is not None and tag in self.teachers else None

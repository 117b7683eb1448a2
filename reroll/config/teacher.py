"""The teacher model of distillation, offline (`reroll distill`) and on-policy
(`algorithm.distill` in RL runs)."""

from __future__ import annotations

from typing import Literal

from reroll.config.base import Section


class TeacherConfig(Section):
    """The teacher model: it must share the student's tokenizer (checked at start)."""

    path: str
    """A local model folder in Hugging Face format (a checkpoint or `final/` of another run)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the teacher's weights are held in (it only runs forward passes)."""

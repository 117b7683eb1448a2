"""The table of pipelines: a pipeline's name -> its config schema, its step and its title.

The one place a pipeline's name is written as a string (tests/test_layers.py checks it): every
other module asks this table what a kind of run does (`kind_of(config.pipeline).rollouts`), never
compares the name. It lives in `config/`, the lowest layer, so that the viewer and the model
hints may read it too; the step factories live in `pipelines/` (above), so the table names them
by import path (`module:function`), imported when a run starts (`reroll.pipelines.run`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from reroll.config.agentic import AgenticConfig
from reroll.config.distill import DistillConfig
from reroll.config.errors import ConfigError
from reroll.config.preference import DPOConfig, RMConfig
from reroll.config.schema import RLConfig, SFTConfig


@dataclass(frozen=True)
class Kind:
    """What one pipeline is."""

    name: str
    """`pipeline:` in its configs."""
    config: type[BaseModel]
    """Its config schema."""
    step: str
    """`module:function` building its `reroll.pipelines.run.Step` from (config, tokenizer,
    run directory, inputs)."""
    title: str
    """What its runs are called ("SFT run finished"); RL runs are called by their algorithm."""
    command: str
    """The `reroll` command that runs its configs."""
    help: str
    """That command's help line."""
    rollouts: bool = False
    """It trains on sampled rollouts (RL): `rollout:` settings, replay, evaluation by reward."""
    env: bool = False
    """Its task is an environment (`env:`), not a dataset of prompts."""
    objects: tuple[str, ...] = ()
    """The Python objects `reroll.api` accepts for it (the others are an error)."""
    objects_note: str = ""
    """Why the others are not used (the error says it)."""
    headline: tuple[str, str, str, str] = ("train reward", "train/reward_mean", "eval reward",
                                           "eval/reward_mean")
    """The report's headline: (label, metric) of training, first -> last step, and of the
    held-out evaluation, before the first -> after the last step."""
    summary: tuple[str, str] = ("eval_reward_start", "eval_reward_end")
    """summary.json's keys of that held-out figure (the step's `summary_keys`)."""


RL_HELP = "run an RL pipeline (GRPO and the algorithm catalogue on verifiable rewards or envs)"

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("rlvr", RLConfig, "reroll.pipelines.rlvr:rlvr_step", "RL", "train", RL_HELP,
         rollouts=True, objects=("reward_funcs", "reward_weights", "train_dataset",
                                 "eval_dataset"),
         objects_note="environments run with pipeline: agentic"),
    Kind("agentic", AgenticConfig, "reroll.pipelines.agentic:agentic_step", "agentic RL", "train",
         RL_HELP, rollouts=True, env=True, objects=("env",),
         objects_note="an agentic run's prompts and rewards come from its environment"),
    Kind("sft", SFTConfig, "reroll.pipelines.sft:sft_step", "SFT", "sft",
         "supervised fine-tuning on prompt/response data",
         objects=("train_dataset", "eval_dataset"),
         objects_note="SFT trains on its dataset's responses",
         headline=("train NLL", "sft/nll", "eval NLL", "eval/nll"),
         summary=("eval_nll_start", "eval_nll_end")),
    Kind("dpo", DPOConfig, "reroll.pipelines.dpo:dpo_step", "DPO", "dpo",
         "preference optimisation on chosen/rejected pairs (DPO, cDPO, IPO, SimPO, ORPO)",
         headline=("train preference accuracy", "pref/accuracy", "eval preference accuracy",
                   "eval/accuracy"), summary=("eval_accuracy_start", "eval_accuracy_end")),
    Kind("rm", RMConfig, "reroll.pipelines.rm:rm_step", "reward model", "rm",
         "train a Bradley-Terry reward model on chosen/rejected pairs",
         headline=("train preference accuracy", "pref/accuracy", "eval preference accuracy",
                   "eval/accuracy"), summary=("eval_accuracy_start", "eval_accuracy_end")),
    Kind("distill", DistillConfig, "reroll.pipelines.distill:distill_step", "distillation",
         "distill",
         "distil a teacher model's next-token distribution into the model, on SFT data",
         headline=("train divergence", "distill/divergence", "eval NLL", "eval/nll"),
         summary=("eval_nll_start", "eval_nll_end")),
)}
"""Every pipeline, by name."""

DEFAULT = KINDS["rlvr"]
"""The pipeline of a config that names none."""


def kind_of(name: str) -> Kind:
    """The pipeline named `name`; an unknown name is a ConfigError listing the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise ConfigError(f"pipeline: unknown pipeline {name!r} (choose from "
                          f"{sorted(KINDS)})") from None


def commands() -> dict[str, list[Kind]]:
    """`reroll` command -> the pipelines it runs (`train`: rlvr and agentic)."""
    out: dict[str, list[Kind]] = {}
    for kind in KINDS.values():
        out.setdefault(kind.command, []).append(kind)
    return out

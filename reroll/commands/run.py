"""The config-driven commands (`train`, `sft`, `dpo`, `rm`, `distill`): a YAML config and its
`key=value` overrides, run by the pipeline it names."""

from __future__ import annotations

import argparse

from reroll.api import train
from reroll.commands.common import show_summary
from reroll.config import load_config
from reroll.config.pipelines import commands as pipeline_commands
from reroll.config.pipelines import kind_of
from reroll.models.files import check_model_path


def configure_run(p: argparse.ArgumentParser) -> None:
    """A config-driven command's arguments: a config and overrides."""
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-4 resume=true")
    kinds = pipeline_commands()[p.prog.split()[-1]]
    p.set_defaults(fn=cmd_train if kinds[0].rollouts else cmd_config)


def cmd_train(args: argparse.Namespace) -> None:
    """`reroll.api.train` on the YAML file and its `key=value` overrides."""
    result = train(args.config, overrides=args.overrides)
    show_summary(finished_title(result.pipeline, result.summary), result.summary)


def finished_title(pipeline: str, summary: dict) -> str:
    """`grpo/ppo_clip run finished`, `DPO sigmoid run finished`: the run's algorithm."""
    return f"{summary.get('algorithm') or kind_of(pipeline).title} run finished"


def cmd_config(args: argparse.Namespace) -> None:
    """`reroll sft|dpo|rm|distill CONFIG.yaml [overrides]`: the pipeline the command runs."""
    config = load_config(args.config, args.overrides, expect=args.command)
    check_model_path(config.model.path)  # before the pipeline imports torch (many seconds)
    from reroll.pipelines.run import train as run_pipeline

    summary = run_pipeline(config)
    show_summary(finished_title(config.pipeline, summary), summary)

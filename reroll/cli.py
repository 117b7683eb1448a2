"""`reroll`: the command line. Every subcommand is listed by `reroll --help`.

One table, `COMMANDS`, says what each command is and where its arguments and handler live
(`module:configure`). Only the module of the command that runs is imported, so `reroll --help`
and a refused config answer in a moment, without torch.

User mistakes (a bad config field, a malformed dataset row, a missing model) print one message
and exit 2; a run that detects a broken invariant or cannot learn (weights out of sync, updates that keep
coming out non-finite, a reward that keeps failing: `RunStopped`) exits 1 with its reason.
Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection
from dataclasses import dataclass

from rich.markup import escape

from reroll import settings
from reroll.commands.common import console
from reroll.config.errors import ConfigError, RunStopped
from reroll.config.pipelines import commands as pipeline_commands


@dataclass(frozen=True)
class Command:
    """One `reroll` subcommand."""

    name: str
    help: str
    """Its line in `reroll --help` (and its `--help` description)."""
    configure: str
    """`module:function(parser)` adding its arguments and setting `fn`, its handler."""


COMMANDS: tuple[Command, ...] = (
    # the config-driven commands (train, sft, dpo, rm, distill): the table of pipelines says which
    *(Command(name, kinds[0].help, "reroll.commands.run:configure_run")
      for name, kinds in pipeline_commands().items()),
    Command("make-model", "write a small random-init model and a locally trained tokenizer, or "
            "import a pretrained model from a GGUF file", "reroll.commands.models:configure_make_model"),
    Command("check-model", "will this model work? tokenizer, chat template, attention features, "
            "engine vs generate and vs trainer logprobs, weight sync",
            "reroll.commands.models:configure_check_model"),
    Command("make-data", "write the built-in arithmetic task's train/eval splits",
            "reroll.commands.data:configure_make_data"),
    Command("envs", "list the environments `env.id` can name, with their kwargs",
            "reroll.commands.envs:configure_envs"),
    Command("make-episodes", "write SFT rows (one per turn) from an environment's scripted expert",
            "reroll.commands.envs:configure_make_episodes"),
    Command("make-sft", "write SFT rows from a run's recorded rollouts or eval samples whose "
            "reward is at least --min-reward (rejection sampling)",
            "reroll.commands.data:configure_make_sft"),
    Command("make-terminal-tasks", "write a generated suite of terminal task folders (Harbor "
            "layout: instruction.md, task.toml, environment/setup.sh, tests/test.sh, "
            "solution/solve.sh), train and held-out from disjoint generator seeds",
            "reroll.commands.envs:configure_make_terminal_tasks"),
    Command("view", "write a self-contained HTML report of a run directory (curves, rollouts, "
            "config); given several, one report with their curves overlaid",
            "reroll.viewer.command:configure_view"),
    Command("replay", "recompute one step's losses from its recorded batch and the checkpoint "
            "before it", "reroll.pipelines.replay:configure_replay"),
    Command("eval", "evaluate a model: pass@1, pass@k and mean@k over a dataset or environments",
            "reroll.evaluation_command:configure_eval"),
    Command("export", "write a run's (or checkpoint's) model to a folder: --merge folds a LoRA "
            "adapter in", "reroll.export:configure_export"),
    Command("sandbox", "the sandbox service (stateful sessions over HTTP)",
            "reroll.sandbox.service:configure_sandbox"),
)
"""Every subcommand, in `reroll --help`'s order."""


def build_parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Every command listed; the arguments of those in `only` (None: all of them), each added by
    its own module, imported here."""
    parser = argparse.ArgumentParser(prog="reroll", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name in only:
            module, function = command.configure.split(":")
            getattr(importlib.import_module(module), function)(p)
    return parser


def quiet_libraries() -> None:
    """Our own progress bars say what is happening; transformers' per-load bars are noise. Set
    through the variables transformers reads when it loads, not by importing it here (seconds
    before a wrong path or config could be refused)."""
    settings.defaults({"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    if "transformers" in sys.modules:  # loaded already (`main` called in a process using it)
        transformers = sys.modules["transformers"]
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    named = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    parser = build_parser(only=named[:1])
    args, extra = parser.parse_known_args(argv)
    if extra:  # dotted overrides after options (`replay RUN --step N key=value`)
        if not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    quiet_libraries()
    try:
        args.fn(args)
    except ConfigError as e:
        # escape: a message's `[...]` (`'.[ray]'`, `messages[0]`) is text, not rich markup
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except RunStopped as e:  # WeightSyncError, non-finite updates, a failing reward
        console.print(f"[bold red]run stopped:[/] {escape(str(e))}", highlight=False,
                      soft_wrap=True)  # one line, as a log reader greps it
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; checkpoints written so far are kept")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

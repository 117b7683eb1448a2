"""`make-data` and `make-sft`: the built-in tasks' data, and SFT rows kept by reward."""

from __future__ import annotations

import argparse

from reroll.commands.common import console, refuse_to_overwrite
from reroll.config.errors import ConfigError
from reroll.config.rewards import JUDGE_TEMPLATE
from reroll.data.images import write_count_task
from reroll.data.preferences import (
    write_arithmetic_judge,
    write_arithmetic_preferences,
    write_judge_labels,
    write_sample_preferences,
)
from reroll.data.rejection import rejection_rows
from reroll.data.tasks import write_arithmetic
from reroll.envs.episodes import write_expert_rows


def cmd_make_data(args: argparse.Namespace) -> None:
    refuse_to_overwrite(args.out, ["train.jsonl", "eval.jsonl"], args.overwrite)
    if args.blank_images and not args.images:
        raise ConfigError("--blank-images goes with --images")
    if args.images:
        paths = write_count_task(args.out, args.train_size, args.eval_size, args.seed,
                                 args.blank_images)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())} (images in "
                      f"{paths['train'].parent / 'images'})")
        return
    levels = tuple(int(x) for x in args.levels.split(","))
    if not set(levels) <= {1, 2, 3, 4}:
        raise ConfigError(f"--levels {args.levels}: levels are 1, 2, 3 and 4")
    for flag in ("direct_frac", "direct_accuracy"):
        if not 0 <= getattr(args, flag) <= 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be between 0 and 1")
    if sum(map(bool, (args.preferences, args.judge, args.preferences_from,
                      args.judge_labels_from))) > 1:
        raise ConfigError("--preferences, --preferences-from, --judge and --judge-labels-from: "
                          "pick one")
    if args.pairs_per_prompt < 1:
        raise ConfigError(f"--pairs-per-prompt {args.pairs_per_prompt}: must be at least 1")
    if args.judge_labels_from:
        paths = write_judge_labels(args.judge_labels_from, args.out, JUDGE_TEMPLATE,
                                   args.eval_size, args.threshold, args.seed)
    elif args.preferences_from:
        paths = write_sample_preferences(args.preferences_from, args.out, args.eval_size,
                                         args.threshold, args.pairs_per_prompt, args.seed)
    elif args.judge:
        paths = write_arithmetic_judge(args.out, args.train_size, args.eval_size, args.seed, levels)
    elif args.preferences:
        paths = write_arithmetic_preferences(args.out, args.train_size, args.eval_size,
                                             args.seed, levels)
    else:
        paths = write_arithmetic(args.out, args.train_size, args.eval_size, args.seed, levels,
                                 args.direct_frac, args.direct_accuracy)
    console.print(f"wrote {paths['train']} and {paths['eval']}")


def cmd_make_sft(args: argparse.Namespace) -> None:
    rows, total = rejection_rows(args.source, args.min_reward)
    if not rows:
        raise ConfigError(f"--from {args.source}: none of its {total} samples has reward >= "
                          f"{args.min_reward} and a finished response; lower --min-reward")
    path = write_expert_rows(args.out, rows)
    console.print(f"wrote {len(rows)} SFT rows (reward >= {args.min_reward}, of {total} "
                  f"samples) to {path}")


def configure_make_data(p: argparse.ArgumentParser) -> None:
    """`reroll make-data`'s arguments."""
    p.add_argument("--out", required=True, help="output folder for train.jsonl and eval.jsonl")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--levels", default="1,2,3,4", help="difficulty levels to include, e.g. 1,2")
    p.add_argument("--images", action="store_true",
                   help="write the image task instead: how many red squares? (docs/vlm.md)")
    p.add_argument("--blank-images", action="store_true",
                   help="--images: the same rows and answers with plain white images (an "
                        "ablation: the answer is no longer in the image)")
    p.add_argument("--direct-frac", type=float, default=0.0,
                   help="share of SFT targets that give an answer without the working")
    p.add_argument("--direct-accuracy", type=float, default=1.0,
                   help="share of those direct answers that are right (the rest copy a number "
                        "from the question)")
    p.add_argument("--preferences", action="store_true",
                   help="write preference pairs instead (prompt, chosen: the worked answer, "
                        "rejected: a wrong one) for `reroll dpo` and `reroll rm`")
    p.add_argument("--preferences-from", metavar="SAMPLES",
                   help="write preference pairs from a model's verified samples instead (a "
                        "`reroll eval` .samples.jsonl: chosen a right response, rejected a wrong "
                        "one of the same prompt, or of the same env seed for `--env` episodes); "
                        "--eval-size counts held-out pairs")
    p.add_argument("--judge-labels-from", metavar="SAMPLES",
                   help="write SFT rows that teach a judge the task instead: the judge prompt of "
                        "`reward: {type: judge}` (its default template) on each verified sample "
                        "of a `reroll eval` .samples.jsonl, response yes (right) or no (wrong), "
                        "as many of each")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="--preferences-from, --judge-labels-from: a sample is right when its "
                        "reward is at least this")
    p.add_argument("--pairs-per-prompt", type=int, default=2,
                   help="--preferences-from: most pairs per prompt")
    p.add_argument("--judge", action="store_true",
                   help="write Think-J judge rows instead (prompt: a question and two answers in "
                        "seeded random order, answer: the letter A or B of the right one) for "
                        "an RLVR run with `reward: {type: math}`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true",
                   help="replace train.jsonl and eval.jsonl if --out holds them (by default "
                        "refused)")
    p.set_defaults(fn=cmd_make_data)


def configure_make_sft(p: argparse.ArgumentParser) -> None:
    """`reroll make-sft`'s arguments."""
    p.add_argument("--from", dest="source", required=True, metavar="RUN_OR_SAMPLES",
                   help="a run directory (its rollouts/step_N.jsonl), a `reroll eval` "
                        ".samples.jsonl, or one rollouts file")
    p.add_argument("--min-reward", type=float, default=1.0,
                   help="keep samples (episodes) whose reward (return) is at least this")
    p.add_argument("--out", required=True, help="output .jsonl file (`reroll sft` data)")
    p.set_defaults(fn=cmd_make_sft)

"""`reroll`: the command line. Every subcommand is listed by `reroll --help`.

User mistakes (a bad config field, a malformed dataset row, a missing model) print one message
and exit 2; a run that detects a broken invariant or cannot learn (weights out of sync, updates that keep
coming out non-finite, a reward that keeps failing: `RunStopped`) exits 1 with its reason.
Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reroll.config.errors import ConfigError

console = Console(stderr=True)


def cmd_train(args: argparse.Namespace) -> None:
    """`reroll.api.train` on the YAML file and its `key=value` overrides."""
    from reroll.api import train

    result = train(args.config, overrides=args.overrides)
    show_summary(finished_title(result.pipeline, result.summary), result.summary)


def finished_title(pipeline: str, summary: dict) -> str:
    """`grpo/ppo_clip run finished`, `DPO sigmoid run finished`: the run's algorithm."""
    from reroll.config.pipelines import kind_of

    return f"{summary.get('algorithm') or kind_of(pipeline).title} run finished"


def cmd_envs(args: argparse.Namespace) -> None:
    from reroll.envs.describe import kwarg_docs
    from reroll.envs.gem_adapter import gem_env_ids
    from reroll.envs.registry import env_specs

    if args.describe:
        show_env(args.describe, json_arg("--kwargs", args.kwargs))
        return
    table = Table(title="environments (env.id)")
    for column in ("id", "description", "env.kwargs (default: doc)"):
        table.add_column(column)
    for spec in env_specs().values():
        table.add_row(spec.id, spec.description, "\n".join(
            f"{k.name}={k.default}: {k.doc}" for k in kwarg_docs(spec.factory)))
    gem_ids = gem_env_ids()
    table.add_row("gem:<id>", f"any gem-llm environment ({len(gem_ids)} installed"
                  + (f", e.g. gem:{gem_ids[0]})" if gem_ids else "; pip install gem-llm)"), "")
    table.add_row("module:Class", "your own: a class or factory importable from the working "
                  "directory or an installed package, or path/to/file.py:Class "
                  "(docs/agentic.md, `Write your own environment`)",
                  "its own; `reroll envs --describe module:Class` lists them")
    Console(emoji=False).print(table)
    if args.gem:
        for env_id in gem_ids:
            print(f"gem:{env_id}")


def show_env(env_id: str, kwargs: dict) -> None:
    """`reroll envs --describe ID`: where it lives, what it takes, and a real build and reset."""
    from reroll.envs.describe import env_report

    report = env_report(env_id, kwargs)
    out = Console(emoji=False)  # `my_envs:RepeatCode[/]:` would read as an emoji code
    out.print(f"[bold]{env_id}[/]: {report['description']}", highlight=False, soft_wrap=True)
    out.print(f"factory: {report['factory']}", highlight=False, soft_wrap=True)
    table = Table(title="env.kwargs")
    for column in ("name", "type", "default", "doc"):
        table.add_column(column)
    for k in report["kwargs"]:
        table.add_row(k.name, k.type, k.default, k.doc)
    out.print(table)
    extras = [f"async {', '.join(report['async'])}" if report["async"] else "sync (runs in a "
              "thread)", "scripted expert (make-episodes)" if report["expert"] else "no expert"]
    out.print(f"check: built {report['class']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
              f", reset({report['seed']}) ok; {'; '.join(extras)}", highlight=False, soft_wrap=True)
    out.print(f"first observation:\n{report['observation']}", highlight=False, markup=False,
              soft_wrap=True)


def json_arg(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {text!r}: not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: a JSON object of keyword arguments, e.g. "
                          '\'{"high": 8}\'')
    return value


def cmd_make_episodes(args: argparse.Namespace) -> None:
    from reroll.envs.episodes import expert_rows, write_expert_rows

    kwargs = json_arg("--kwargs", args.kwargs)
    rows = expert_rows(args.env, args.episodes, args.seed, kwargs, args.system_prompt)
    path = write_expert_rows(args.out, rows)
    console.print(f"wrote {len(rows)} expert rows of {args.episodes} episodes to {path}")


def cmd_make_terminal_tasks(args: argparse.Namespace) -> None:
    import asyncio
    from pathlib import Path

    from reroll.envs.task_folder import load_suite
    from reroll.envs.terminal_gen import write_suite
    from reroll.envs.terminal_tasks import check
    from reroll.sandbox import Sandbox

    splits = [Path(args.out) / split for split in ("train", "heldout")]
    if any(p.exists() and any(p.iterdir()) for p in splits) and not args.overwrite:
        raise ConfigError(f"--out {args.out}: holds a suite already; pass --overwrite to replace "
                          "it")
    for path in splits:
        if path.exists():
            import shutil

            shutil.rmtree(path)
    counts = write_suite(args.out, args.train, args.heldout, args.seed)
    console.print(f"wrote {args.train} train and {args.heldout} held-out tasks to {args.out} "
                  f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    if args.check:
        tasks = load_suite(Path(args.out) / "train") + load_suite(Path(args.out) / "heldout")

        async def check_all():
            sandbox = Sandbox()
            return await asyncio.gather(*(check(task, sandbox) for task in tasks))

        broken = [why for why in asyncio.run(check_all()) if why]
        if broken:
            raise ConfigError(f"{len(broken)} of {len(tasks)} tasks are broken: " + "; ".join(
                broken[:3]))
        console.print(f"checked {len(tasks)} tasks in the sandbox: each fails before its "
                      "solution and passes after it")


def cmd_make_sft(args: argparse.Namespace) -> None:
    from reroll.data.rejection import rejection_rows
    from reroll.envs.episodes import write_expert_rows

    rows, total = rejection_rows(args.source, args.min_reward)
    if not rows:
        raise ConfigError(f"--from {args.source}: none of its {total} samples has reward >= "
                          f"{args.min_reward} and a finished response; lower --min-reward")
    path = write_expert_rows(args.out, rows)
    console.print(f"wrote {len(rows)} SFT rows (reward >= {args.min_reward}, of {total} "
                  f"samples) to {path}")


def cmd_config(args: argparse.Namespace) -> None:
    """`reroll sft|dpo|rm|distill CONFIG.yaml [overrides]`: the pipeline the command runs."""
    from reroll.config import load_config
    from reroll.models.files import check_model_path

    config = load_config(args.config, args.overrides, expect=args.command)
    check_model_path(config.model.path)  # before the pipeline imports torch (many seconds)
    from reroll.pipelines.run import train

    summary = train(config)
    show_summary(finished_title(config.pipeline, summary), summary)


def refuse_to_overwrite(out: str, files: list[str] | None, overwrite: bool) -> None:
    """`--out` of make-model (`files` None: the whole folder) and make-data (the files it
    writes): what is there already is kept unless `--overwrite`, as `export` and runs do."""
    from pathlib import Path

    target = Path(out).expanduser()
    if overwrite or not target.exists():
        return
    if not target.is_dir():
        raise ConfigError(f"--out {out}: a file is there, not a folder")
    taken = [target / f for f in files if (target / f).exists()] if files is not None else \
        ([target] if any(target.iterdir()) else [])
    if taken:
        what = "the folder is not empty" if files is None else \
            f"{', '.join(p.name for p in taken)} exist{'s' if len(taken) == 1 else ''} there"
        raise ConfigError(f"--out {out}: {what}; pass --overwrite to replace it, or choose "
                          f"another folder")


def cmd_make_model(args: argparse.Namespace) -> None:
    refuse_to_overwrite(args.out, None, args.overwrite)
    if args.from_gguf:
        from reroll.models.gguf import import_gguf

        out = import_gguf(args.from_gguf, args.out)
        console.print(f"wrote the model of {args.from_gguf} (dequantised, float32) to [bold]{out}[/]")
        return
    if args.vlm:
        from reroll.models.vlm import make_vlm

        out = make_vlm(args.out, seed=args.seed)
        console.print(f"wrote a tiny Idefics3 vision-language model and its processor to "
                      f"[bold]{out}[/]")
        return
    from reroll.models.factory import PRESETS, make_model

    sizes = {k: v for k, v in {"hidden_size": args.hidden_size, "num_layers": args.num_layers,
                               "vocab_size": args.vocab_size}.items() if v is not None}
    corpus = None
    if args.corpus:
        with open(args.corpus) as f:
            corpus = [line for line in f]
    out = make_model(args.out, args.preset, corpus=corpus, seed=args.seed, **sizes)
    console.print(f"wrote a {args.preset} model and tokenizer to [bold]{out}[/]")
    asked = sizes.get("vocab_size", PRESETS[args.preset].vocab_size)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    if vocab < asked:  # BPE stops merging when the corpus has no pair left to merge
        console.print(f"[bold yellow]note:[/] the vocabulary has {vocab} tokens, not {asked}: "
                      f"the tokenizer's corpus has no more merges to learn (a larger --corpus, "
                      f"or --vocab-size {vocab} to say so)", highlight=False)


def cmd_check_model(args: argparse.Namespace) -> None:
    if args.diagnose:
        return cmd_diagnose(args)
    from reroll.check_model import run_checks

    with console.status("loading the model") as status:
        summary = run_checks(args.model, args.attn_implementation, args.vllm,
                             progress=lambda name: status.update(f"checking {name}"))
    table = Table(title=f"reroll check-model {args.model} ({summary['architecture']}, "
                        f"{summary['attn_implementation']} attention)")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    colours = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for check in summary["checks"]:
        table.add_row(check["name"], f"[{colours[check['status']]}]{check['status']}[/]",
                      check["detail"])
    Console().print(table)
    print(json.dumps(summary))
    if summary["failed"]:
        console.print(f"[bold red]failed:[/] {', '.join(summary['failed'])}", highlight=False)
        raise SystemExit(1)


def cmd_diagnose(args: argparse.Namespace) -> None:
    """`check-model --diagnose`: the engine-vs-trainer mismatch table (reroll/mismatch.py)."""
    from reroll.mismatch import as_dicts, diagnose

    with console.status("running the engine's and the trainer's forwards"):
        table_rows = diagnose(args.model, attn_implementation=args.attn_implementation)
    table = Table(title=f"reroll check-model --diagnose {args.model}: the engine (dtype, batch "
                        f"size) against the trainer (float32, padded or packed); the first "
                        f"module whose outputs differ by > 1e-3 of their scale, and the one "
                        f"whose difference is the largest multiple (x) of any before it; ratio out: tokens whose "
                        f"ratio leaves [0.9, 1.1]")
    columns = ("engine", "batch", "trainer", "first parting module", "rel. diff",
               "jumps most at", "x", "max |dlogp|", "mean |dlogp|", "ratio out")
    for column in columns:
        table.add_column(column)
    for r in table_rows:
        table.add_row(r.engine_dtype, str(r.batch_size), r.layout, r.first_parting,
                      f"{r.parting_rel_diff:.2e}", r.largest_growth, f"{r.growth_factor:.1f}",
                      f"{r.logprob_max_abs_diff:.2e}",
                      f"{r.logprob_mean_abs_diff:.2e}", f"{r.ratio_outside:.1%}")
    Console(width=max(Console().width, 150)).print(table)
    print(json.dumps({"model": args.model, "diagnosis": as_dicts(table_rows)}))


def cmd_make_data(args: argparse.Namespace) -> None:
    from reroll.data.tasks import write_arithmetic

    refuse_to_overwrite(args.out, ["train.jsonl", "eval.jsonl"], args.overwrite)
    if args.images:
        from reroll.data.images import write_count_task

        paths = write_count_task(args.out, args.train_size, args.eval_size, args.seed)
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
        from reroll.config.rewards import JUDGE_TEMPLATE
        from reroll.data.preferences import write_judge_labels

        paths = write_judge_labels(args.judge_labels_from, args.out, JUDGE_TEMPLATE,
                                   args.eval_size, args.threshold, args.seed)
    elif args.preferences_from:
        from reroll.data.preferences import write_sample_preferences

        paths = write_sample_preferences(args.preferences_from, args.out, args.eval_size,
                                         args.threshold, args.pairs_per_prompt, args.seed)
    elif args.judge:
        from reroll.data.preferences import write_arithmetic_judge

        paths = write_arithmetic_judge(args.out, args.train_size, args.eval_size, args.seed, levels)
    elif args.preferences:
        from reroll.data.preferences import write_arithmetic_preferences

        paths = write_arithmetic_preferences(args.out, args.train_size, args.eval_size,
                                             args.seed, levels)
    else:
        paths = write_arithmetic(args.out, args.train_size, args.eval_size, args.seed, levels,
                                 args.direct_frac, args.direct_accuracy)
    console.print(f"wrote {paths['train']} and {paths['eval']}")


def show_summary(title: str, summary: dict) -> None:
    from reroll.tracking.jsonsafe import dumps

    table = Table(title=title, show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(dumps(summary))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reroll", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_commands(sub)
    _add_model_commands(sub)
    _add_data_commands(sub)
    _add_task_commands(sub)

    from reroll.evaluation_command import add_eval_parser
    from reroll.export import add_export_parser
    from reroll.pipelines.replay import add_replay_parser
    from reroll.sandbox.service import add_sandbox_parser
    from reroll.viewer import add_view_parser

    add_view_parser(sub)
    add_replay_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    add_sandbox_parser(sub)
    return parser


def _add_run_commands(sub) -> None:
    """`train` and the config-driven commands (sft, dpo, rm, distill): a config and overrides."""
    from reroll.config.pipelines import commands as pipeline_commands

    for name, kinds in pipeline_commands().items():
        fn, text = (cmd_train if kinds[0].rollouts else cmd_config), kinds[0].help
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-4 resume=true")
        p.set_defaults(fn=fn)


def _add_model_commands(sub) -> None:
    """`make-model` and `check-model`."""
    p = sub.add_parser("make-model", help="write a small random-init model and a locally trained "
                       "tokenizer, or import a pretrained model from a GGUF file")
    p.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    p.add_argument("--from-gguf", metavar="FILE",
                   help="import this GGUF file (or a packaged model: smollm2-135m-instruct) with its "
                        "tokenizer and chat template instead of building a random-init model")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="tiny ~1M, small ~30M parameters")
    p.add_argument("--vlm", action="store_true",
                   help="a tiny vision-language model (Idefics3) and its processor instead "
                        "(docs/vlm.md)")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--corpus", help="text file to train the tokenizer on (default: built-in task text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true",
                   help="replace what --out holds (by default a non-empty folder is refused)")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("check-model", help="will this model work? tokenizer, chat template, "
                       "attention features, engine vs generate and vs trainer logprobs, weight sync")
    p.add_argument("model", help="model folder (Hugging Face format)")
    p.add_argument("--attn-implementation", default="auto",
                   help="as model.attn_implementation in configs (default auto)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                   help="check the vLLM engine too (default: when installed)")
    p.add_argument("--diagnose", action="store_true",
                   help="instead of the checks: run the same rows through the engine's and the "
                        "trainer's forward module by module, name the first module where they "
                        "part, swept over engine dtype, batch size and padded/packed")
    p.set_defaults(fn=cmd_check_model)


def _add_data_commands(sub) -> None:
    """`make-data`, `envs` and `make-episodes`: the built-in task's data and the environments."""
    p = sub.add_parser("make-data", help="write the built-in arithmetic task's train/eval splits")
    p.add_argument("--out", required=True, help="output folder for train.jsonl and eval.jsonl")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--levels", default="1,2,3,4", help="difficulty levels to include, e.g. 1,2")
    p.add_argument("--images", action="store_true",
                   help="write the image task instead: how many red squares? (docs/vlm.md)")
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

    p = sub.add_parser("envs", help="list the environments `env.id` can name, with their kwargs")
    p.add_argument("--gem", action="store_true", help="also print every installed gem-llm id")
    p.add_argument("--describe", metavar="ID", help="one environment (built-in, or your own "
                   "module:Class): its kwargs and docs, built and reset for a check")
    p.add_argument("--kwargs", default="{}", help="with --describe: env kwargs as JSON")
    p.set_defaults(fn=cmd_envs)

    p = sub.add_parser("make-episodes",
                       help="write SFT rows (one per turn) from an environment's scripted expert")
    p.add_argument("--env", required=True,
                   help="environment id (see `reroll envs`), or your own module:Class")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--episodes", type=int, default=500)
    p.add_argument("--seed", type=int, default=0, help="env seeds are seed, seed+1, ...")
    p.add_argument("--kwargs", default="{}", help='env arguments as JSON, e.g. \'{"noise": 0.5}\'')
    p.add_argument("--system-prompt", default=None)
    p.set_defaults(fn=cmd_make_episodes)

    p = sub.add_parser("make-sft", help="write SFT rows from a run's recorded rollouts or eval "
                       "samples whose reward is at least --min-reward (rejection sampling)")
    p.add_argument("--from", dest="source", required=True, metavar="RUN_OR_SAMPLES",
                   help="a run directory (its rollouts/step_N.jsonl), a `reroll eval` "
                        ".samples.jsonl, or one rollouts file")
    p.add_argument("--min-reward", type=float, default=1.0,
                   help="keep samples (episodes) whose reward (return) is at least this")
    p.add_argument("--out", required=True, help="output .jsonl file (`reroll sft` data)")
    p.set_defaults(fn=cmd_make_sft)


def _add_task_commands(sub) -> None:
    """`make-terminal-tasks`: a generated suite of terminal task folders."""
    p = sub.add_parser("make-terminal-tasks",
                       help="write a generated suite of terminal task folders (Harbor layout: "
                       "instruction.md, task.toml, environment/setup.sh, tests/test.sh, "
                       "solution/solve.sh), train and held-out from disjoint generator seeds")
    p.add_argument("--out", required=True, help="suite folder (gets train/ and heldout/)")
    p.add_argument("--train", type=int, default=64, help="train tasks")
    p.add_argument("--heldout", type=int, default=24, help="held-out tasks")
    p.add_argument("--seed", type=int, default=0, help="first generator seed of the train tasks")
    p.add_argument("--check", action="store_true",
                   help="run every task in the sandbox: its tests must fail after its set-up "
                        "and pass after its solution")
    p.add_argument("--overwrite", action="store_true", help="replace a suite --out holds")
    p.set_defaults(fn=cmd_make_terminal_tasks)


def quiet_libraries() -> None:
    """Our own progress bars say what is happening; transformers' per-load bars are noise. Set
    through the variables transformers reads when it loads, not by importing it here (seconds
    before a wrong path or config could be refused)."""
    from reroll import settings

    settings.defaults({"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    if "transformers" in sys.modules:  # loaded already (`main` called in a process using it)
        transformers = sys.modules["transformers"]
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    from reroll.config.errors import RunStopped

    parser = build_parser()
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

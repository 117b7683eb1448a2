"""`make-model` and `check-model`: a model to train, and whether one will work."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from reroll.check_model import run_checks
from reroll.commands.common import console, refuse_to_overwrite
from reroll.mismatch import ROUTING_SKIPPED, as_dicts, diagnose
from reroll.models.factory import PRESETS, make_model
from reroll.models.gguf import import_gguf
from reroll.models.vlm import make_vlm


def cmd_make_model(args: argparse.Namespace) -> None:
    refuse_to_overwrite(args.out, None, args.overwrite)
    if args.from_gguf:
        out = import_gguf(args.from_gguf, args.out)
        console.print(f"wrote the model of {args.from_gguf} (dequantised, float32) to [bold]{out}[/]")
        return
    if args.vlm:
        out = make_vlm(args.out, seed=args.seed)
        console.print(f"wrote a tiny Idefics3 vision-language model and its processor to "
                      f"[bold]{out}[/]")
        return
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
    with console.status("running the engine's and the trainer's forwards"):
        table_rows = diagnose(args.model, attn_implementation=args.attn_implementation)
    moe = any(r.routing_mismatch is not None for r in table_rows)
    table = Table(title=f"reroll check-model --diagnose {args.model}: the engine (dtype, batch "
                        f"size) against the trainer (float32, padded or packed"
                        f"{', routing replay off or on' if moe else ''}); the first "
                        f"module whose outputs differ by > 1e-3 of their scale, and the one "
                        f"whose difference is the largest multiple (x) of any before it; ratio "
                        f"out: tokens whose ratio leaves [0.9, 1.1]"
                        f"{'; routed apart: tokens whose experts differ from the engine' if moe else ''}")
    columns = ("engine", "batch", "trainer", *(("replay",) if moe else ()),
               "first parting module", "rel. diff", "jumps most at", "x", "max |dlogp|",
               "mean |dlogp|", "ratio out", *(("routed apart",) if moe else ()))
    for column in columns:
        table.add_column(column)
    for r in table_rows:
        replay = (r.routing_replay,) if moe else ()
        apart = (f"{r.routing_mismatch:.1%}",) if moe else ()
        table.add_row(r.engine_dtype, str(r.batch_size), r.layout, *replay, r.first_parting,
                      f"{r.parting_rel_diff:.2e}", r.largest_growth, f"{r.growth_factor:.1f}",
                      f"{r.logprob_max_abs_diff:.2e}",
                      f"{r.logprob_mean_abs_diff:.2e}", f"{r.ratio_outside:.1%}", *apart)
    Console(width=max(Console().width, 150)).print(table)
    if not moe:
        console.print(f"routing replay on/off: skipped ({ROUTING_SKIPPED})", highlight=False)
    print(json.dumps({"model": args.model, "diagnosis": as_dicts(table_rows),
                      "routing_replay": "swept" if moe else f"skipped: {ROUTING_SKIPPED}"}))


def configure_make_model(p: argparse.ArgumentParser) -> None:
    """`reroll make-model`'s arguments."""
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


def configure_check_model(p: argparse.ArgumentParser) -> None:
    """`reroll check-model`'s arguments."""
    p.add_argument("model", help="model folder (Hugging Face format)")
    p.add_argument("--attn-implementation", default="auto",
                   help="as model.attn_implementation in configs (default auto)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                   help="check the vLLM engine too (default: when installed)")
    p.add_argument("--diagnose", action="store_true",
                   help="instead of the checks: run the same rows through the engine's and the "
                        "trainer's forward module by module, name the first module where they "
                        "part, swept over engine dtype, batch size and padded/packed (and routing "
                        "replay off/on on a mixture-of-experts model)")
    p.set_defaults(fn=cmd_check_model)

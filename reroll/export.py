"""`reroll export RUN_OR_CHECKPOINT --out DIR [--merge]`: a run's model as a folder other tools load.

A LoRA run's checkpoints hold the adapter only (PEFT's files, naming the base model). `--merge`
writes a plain transformers model with the adapter merged into the base weights (what
`AutoModelForCausalLM.from_pretrained` and vLLM load); without it the adapter folder is written
as it is (for PEFT, or vLLM's LoRA loader), with the tokenizer. A full fine-tuning checkpoint
exports as its model files (optimizer and trainer state left behind).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.models.files import is_adapter_dir, share_like_siblings

MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")
"""What a model or adapter folder is made of (the trainer's state `*.pt` stays behind)."""


def resolve_source(source: str) -> Path:
    """A checkpoint or model folder as given, or for a run directory its newest complete
    checkpoint."""
    from reroll.pipelines.common import RunDir, checkpoint_problem  # torch: not for `--help`

    path = Path(source).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{source}: no such run, checkpoint or model folder")
    if (path / "checkpoints").is_dir():
        complete = [p for _, p in RunDir(path).checkpoints() if checkpoint_problem(p) is None]
        if not complete:
            raise ConfigError(f"{source}: the run has no complete checkpoint to export")
        return complete[-1]
    if not (path / "config.json").is_file() and not is_adapter_dir(path):
        raise ConfigError(f"{source}: neither a run directory nor a model or LoRA adapter folder "
                          f"(no config.json or adapter_config.json)")
    return path


def export(source: str, out: str, merge: bool, dtype: str = "float32") -> Path:
    """Write the model of `source` to `out` (see the module's docstring); returns the folder
    exported from."""
    from reroll.models.loading import load_model, load_tokenizer

    checkpoint = resolve_source(source)
    target = Path(out).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {out}: a file is there, not a folder")
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"--out {out}: the folder is not empty")
    try:  # a read-only place, or a path under a regular file: said before the model loads
        target.mkdir(parents=True, exist_ok=True)
        (target / ".reroll-write-check").touch()
        (target / ".reroll-write-check").unlink()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    if merge:
        model = load_model(str(checkpoint), dtype)  # an adapter folder loads merged
        model.config.use_cache = True  # as a released model has it (training turns it off)
        model.save_pretrained(str(target))
        load_tokenizer(str(checkpoint)).save_pretrained(str(target))
        share_like_siblings(target)
    else:
        for pattern in MODEL_FILES:
            for file in checkpoint.glob(pattern):
                shutil.copy2(file, target / file.name)
    return checkpoint


def cmd_export(args: argparse.Namespace) -> None:
    checkpoint = export(args.source, args.out, args.merge, args.dtype)
    kind = "merged model" if args.merge else ("LoRA adapter" if is_adapter_dir(checkpoint)
                                              else "model")
    print(json.dumps({"exported": str(checkpoint), "out": str(Path(args.out)), "kind": kind}))


def configure_export(p: argparse.ArgumentParser) -> None:
    """`reroll export`'s arguments."""
    p.description = f"{p.description}. A run directory exports its newest complete checkpoint."
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="run directory, checkpoints/step_N folder, or model/adapter folder")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--merge", action="store_true",
                   help="write a plain transformers model with the LoRA adapter merged into the "
                        "base weights (without it a LoRA checkpoint exports as its adapter)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights dtype of a --merge export (default float32)")
    p.set_defaults(fn=cmd_export)

"""What the commands share: the console, the summary table, JSON flags and `--out` folders."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from reroll.config.errors import ConfigError
from reroll.tracking.jsonsafe import dumps

console = Console(stderr=True)


def show_summary(title: str, summary: dict) -> None:
    table = Table(title=title, show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(dumps(summary))


def json_arg(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {text!r}: not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: a JSON object of keyword arguments, e.g. "
                          '\'{"high": 8}\'')
    return value


def refuse_to_overwrite(out: str, files: list[str] | None, overwrite: bool) -> None:
    """`--out` of make-model (`files` None: the whole folder) and make-data (the files it
    writes): what is there already is kept unless `--overwrite`, as `export` and runs do."""
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

"""What to run when a model folder is missing: the right command depends on who writes it.

`runs/<name>/final` is written by an SFT run and `runs/<name>/checkpoints/step_N` by a training
run, not by `reroll make-model`; the config that writes it is looked up among the YAML files
under `examples/` of the working directory, and the Makefile target that runs that config (if
any) is named too.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from reroll.config.pipelines import DEFAULT, KINDS


def missing_model_hint(path: str, cwd: Path | None = None) -> str:
    """The command that creates the model folder `path` (a sentence fragment)."""
    cwd = cwd or Path.cwd()
    local = Path(path)
    run = local.parent if local.name == "final" else (
        local.parent.parent if local.parent.name == "checkpoints"
        and re.fullmatch(r"step_\d+", local.name) else None)
    if run is None:
        built = _make_target_named(f"{path.rstrip('/')}/config.json", cwd)
        if built:
            return f"build it with `make {built}` (the Makefile's recipe for it)"
        return f"build one with `reroll make-model --out {path}` (or import one with --from-gguf)"
    found = _config_writing(run, cwd)
    if found is None:
        writer = "reroll sft" if local.name == "final" else "reroll train"
        return (f"it is the output of a run in {run} (`{writer} CONFIG.yaml` with that run "
                f"directory): run it first")
    config, command = found
    if local.name == "final" and command == "train":  # RL runs save checkpoints only
        return (f"`reroll train {config}` writes no final/ folder: its models are "
                f"{run}/checkpoints/step_N (run it first if there are none)")
    target = _make_target(config, cwd)
    return (f"it is written by `reroll {command} {config}`: run that first"
            + (f" (or `make {target}`, which builds everything it needs)" if target else ""))


def _config_writing(run: Path, cwd: Path) -> tuple[str, str] | None:
    """The example config whose run directory is `run`, and the reroll command that runs it
    (`sft`, `dpo`, `rm`, `distill`, or `train` for RL and agentic runs)."""
    for candidate in sorted((cwd / "examples").rglob("*.yaml")):
        try:
            data = yaml.safe_load(candidate.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(data, dict):
            continue
        kind = KINDS.get(str(data.get("pipeline", DEFAULT.name)), DEFAULT)
        default = kind.config.model_fields["name"].default
        out = data.get("output_dir") or f"runs/{data.get('name', default)}"
        if Path(out) == run or (cwd / out).resolve() == (cwd / run).resolve():
            return str(candidate.relative_to(cwd)), kind.command
    return None


def _make_target(config: str, cwd: Path) -> str | None:
    """The Makefile target whose recipe runs `config`."""
    makefile = cwd / "Makefile"
    target = None
    for line in makefile.read_text().splitlines() if makefile.is_file() else []:
        match = re.match(r"^([\w.-]+):", line)
        if match:
            target = match.group(1)
        elif line.startswith("\t") and config in line:
            return target
    return None


def _make_target_named(name: str, cwd: Path) -> str | None:
    makefile = cwd / "Makefile"
    lines = makefile.read_text().splitlines() if makefile.is_file() else []
    return name if any(line.startswith(f"{name}:") for line in lines) else None


def is_run_output(path: str) -> bool:
    """Whether `path` names a run's model (`.../final`, `.../checkpoints/step_N`)."""
    local = Path(path)
    return local.name == "final" or (local.parent.name == "checkpoints"
                                     and re.fullmatch(r"step_\d+", local.name) is not None)

"""Reading a run directory (section 3 of DESIGN.md) into plain data for the report.

`load_run` is the only entry point. It is strict about what a report cannot do without (the folder
and a readable `metrics.jsonl`) and lenient about the rest: a missing `summary.json` means the run
has not finished, a half-written last line means it was stopped mid-write, and a bad rollout line is
skipped. Each leniency leaves a line in `RunData.warnings`, which the report shows.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.config.pipelines import DEFAULT, KINDS

ROLLOUT_FILE = re.compile(r"^step_(\d+)\.jsonl$")
EVAL_ROLLOUT_FILE = re.compile(r"^eval_step_(\d+)\.jsonl$")
NON_FINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf}
MAX_TEXT_CHARS = 20_000


@dataclass
class RunData:
    """Everything the report shows, read from one run directory.

    `metrics` has one dict per step, sorted by step, with rows that share a step merged (an SFT
    run logs its final `eval/nll` on a line of its own). Values are floats, `None` for a
    non-finite value (its step is listed in `non_finite[key]`), or whatever else the line held.
    `rollouts` maps a step to its recorded trajectories, normalised by `_rollout`;
    `eval_rollouts` the same for the held-out samples of the evaluation after that step (step 0:
    before training).
    """

    path: Path
    metrics: list[dict[str, Any]]
    non_finite: dict[str, list[int]] = field(default_factory=dict)
    rollouts: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    eval_rollouts: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    config_text: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def pipeline(self) -> str:
        """The run's `pipeline` from the resolved config; guessed from the metrics if it is missing
(the first pipeline of the table whose training metric they have)."""
        if isinstance(self.config.get("pipeline"), str):
            return self.config["pipeline"]
        return next((kind.name for kind in KINDS.values()
                     if any(kind.headline[1] in row for row in self.metrics)), DEFAULT.name)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.name)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) for each step where `key` has a finite number."""
        return [(row["step"], row[key]) for row in self.metrics if _is_number(row.get(key))]

    def numeric_keys(self) -> list[str]:
        """Metric names with at least one number or non-finite value, in first-seen order."""
        keys: dict[str, None] = {}
        for row in self.metrics:
            for key, value in row.items():
                if key != "step" and (_is_number(value) or key in self.non_finite):
                    keys.setdefault(key)
        return list(keys)


def load_run(run_dir: str | Path, max_rollouts_per_step: int = 500) -> RunData:
    """Read `run_dir`; raise ConfigError naming the path when it is not a readable run directory."""
    path = Path(run_dir).expanduser()
    if not path.exists():
        raise ConfigError(f"{path}: no such run directory")
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (expected a run directory holding metrics.jsonl)")
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(f"{metrics_path}: not found; is {path} a run directory written by "
                          "`reroll train` or `reroll sft`?")
    run = RunData(path=path, metrics=[])
    run.metrics, run.non_finite = _read_metrics(metrics_path, run.warnings)
    run.summary = _read_summary(path / "summary.json", run.warnings)
    run.config_text, run.config = _read_config(path / "config.yaml", run.warnings)
    run.rollouts = _read_rollouts(path / "rollouts", ROLLOUT_FILE, max_rollouts_per_step,
                                  run.warnings)
    run.eval_rollouts = _read_rollouts(path / "rollouts", EVAL_ROLLOUT_FILE,
                                       max_rollouts_per_step, run.warnings)
    return run


def _read_metrics(path: Path, warnings: list[str]) -> tuple[list[dict], dict[str, list[int]]]:
    lines = _read_text(path).splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    by_step: dict[int, dict[str, Any]] = {}
    non_finite: dict[str, set[int]] = {}
    for index, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if index == len(numbered) - 1:  # a run stopped while writing its last line
                warnings.append(f"{path}:{n}: last line is incomplete and was skipped")
                continue
            raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ConfigError(f"{path}:{n}: expected a JSON object with an integer 'step'")
        merged = by_step.setdefault(step, {"step": step})
        for key, value in row.items():
            if key == "step":
                continue
            value = _as_float(value)
            if isinstance(value, float) and not math.isfinite(value):
                non_finite.setdefault(key, set()).add(step)
                value = None
            merged[key] = value
    if not by_step:
        raise ConfigError(f"{path}: holds no steps yet (is the run still starting?)")
    return ([by_step[s] for s in sorted(by_step)],
            {key: sorted(steps) for key, steps in non_finite.items()})


def _read_summary(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        warnings.append("summary.json is missing: the run is still going, or it stopped early")
        return None
    try:
        summary = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        warnings.append(f"{path}: not valid JSON ({e.msg}); summary not shown")
        return None
    if not isinstance(summary, dict):
        warnings.append(f"{path}: expected a JSON object; summary not shown")
        return None
    return summary


def _read_config(path: Path, warnings: list[str]) -> tuple[str | None, dict[str, Any]]:
    import yaml

    if not path.is_file():
        warnings.append("config.yaml is missing")
        return None, {}
    text = _read_text(path)
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        warnings.append(f"{path}: not valid YAML; shown as text")
        return text, {}
    return text, parsed if isinstance(parsed, dict) else {}


def _read_rollouts(folder: Path, names: re.Pattern, limit: int,
                   warnings: list[str]) -> dict[int, list[dict]]:
    if not folder.is_dir():
        return {}
    files = sorted((int(m.group(1)), p) for p in folder.iterdir()
                   if p.is_file() and (m := names.match(p.name)))
    rollouts: dict[int, list[dict]] = {}
    for step, file in files:
        rows = []
        for n, line in enumerate(_read_text(file).splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                warnings.append(f"{file}:{n}: not valid JSON ({e.msg}); skipped")
                continue
            if not isinstance(raw, dict):
                warnings.append(f"{file}:{n}: not a JSON object; skipped")
                continue
            rows.append(_rollout(raw, warnings, f"{file}:{n}"))
        if len(rows) > limit:
            warnings.append(f"{file}: showing the first {limit} of {len(rows)} trajectories")
            rows = rows[:limit]
        rollouts[step] = rows
    return rollouts


def _rollout(raw: dict[str, Any], warnings: list[str], where: str) -> dict[str, Any]:
    """The fields the table shows, with safe types; extra keys are kept under `extra`."""
    known = {"prompt", "response", "answer", "reward", "reward_info", "finish_reason",
             "group_id", "turns", "segments", "turn_rewards", "images"}
    reward = _as_float(raw.get("reward"))
    row = {
        "prompt": _text(raw.get("prompt"), warnings, where),
        "response": _text(raw.get("response"), warnings, where),
        "answer": _text(raw.get("answer"), warnings, where),
        "reward": reward if _is_number(reward) else None,
        "reward_raw": None if _is_number(reward) or raw.get("reward") is None else str(raw["reward"]),
        "reward_info": _jsonable(raw.get("reward_info")),
        "finish_reason": str(raw.get("finish_reason") or ""),
        "group_id": raw.get("group_id") if isinstance(raw.get("group_id"), int | str) else None,
        "extra": _jsonable({k: v for k, v in raw.items() if k not in known}),
    }
    images = raw.get("images")
    if isinstance(images, list) and images:
        row["images"] = [thumbnail(path, warnings, where) for path in images]
    turns = raw.get("turns")
    if not isinstance(turns, list) and isinstance(raw.get("segments"), list):
        turns = segments_to_turns(raw["segments"])
    if isinstance(turns, list):
        row["turns"] = [{"role": str(t.get("role", "")),
                         "text": _text(t.get("text", t.get("content")), warnings, where),
                         "turn": t.get("turn") if isinstance(t.get("turn"), int) else None}
                        if isinstance(t, dict) else {"role": "", "text": _text(t, warnings, where)}
                        for t in turns]
        row["num_turns"] = policy_turns(row["turns"])
        rewards = raw.get("turn_rewards")
        if isinstance(rewards, list):  # one per policy turn, by turn number
            row["turn_rewards"] = [r if _is_number(r := _as_float(v)) else None for v in rewards]
    return row


def thumbnail(path: Any, warnings: list[str], where: str, size: int = 128) -> str | None:
    """The image at `path` as a small PNG data URI, embedded so the report stands alone (None,
    with a warning, if it cannot be read: the run's images may have moved since)."""
    import base64
    import io

    from PIL import Image

    try:
        with Image.open(str(path)) as image:
            image = image.convert("RGB")
            image.thumbnail((size, size))
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
    except (OSError, ValueError) as e:
        warnings.append(f"{where}: image {path} cannot be shown ({type(e).__name__})")
        return None
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def policy_turns(turns: list[dict[str, Any]]) -> int:
    """How many turns the policy took: its distinct turn numbers (a turn's text can come in
    several pieces), or its pieces when the rows carry no numbers. Environment text is not a
    turn of its own."""
    policy = [t for t in turns if t.get("role") in ("policy", "assistant")]
    numbers = {t["turn"] for t in policy if t.get("turn") is not None}
    return len(numbers) if numbers else len(policy)


def segments_to_turns(segments: list[Any]) -> list[dict[str, Any]]:
    """An agentic episode's `segments` ({text, policy, turn}: its tokens decoded per stretch of
    policy or environment tokens) as the table's turns: consecutive segments of the same side and
    turn are joined; policy text has role "policy", environment text role "env"."""
    turns: list[dict[str, Any]] = []
    for segment in segments:
        if not isinstance(segment, dict):
            continue
        role = "policy" if segment.get("policy") else "env"
        text = segment.get("text")
        text = text if isinstance(text, str) else "" if text is None else json.dumps(text)
        turn = segment.get("turn")
        if turns and turns[-1]["role"] == role and turns[-1].get("turn") == turn:
            turns[-1]["text"] += text
        else:
            turns.append({"role": role, "text": text, "turn": turn})
    return turns


def _text(value: Any, warnings: list[str], where: str) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_TEXT_CHARS:
        warnings.append(f"{where}: a text of {len(text)} characters is cut to {MAX_TEXT_CHARS}")
        text = text[:MAX_TEXT_CHARS] + f" … [{len(text) - MAX_TEXT_CHARS} more characters]"
    return text


def _as_float(value: Any) -> Any:
    """'nan' / 'inf' strings (how the tracker writes non-finite floats) become floats."""
    if isinstance(value, str) and value.strip().lower() in NON_FINITE:
        return NON_FINITE[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _jsonable(value: Any) -> Any:
    """`value` with non-finite floats replaced by their names, so it embeds as strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None

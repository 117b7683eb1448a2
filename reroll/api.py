"""The Python API: build a config in Python (or load a YAML and override it), pass reward
functions, an environment and datasets as objects, run, and get the run's summary back.

    import reroll

    summary = reroll.train("grpo.yaml", overrides={"steps": 3},
                           reward_funcs=[my_reward], train_dataset=rows)
    summary.run_dir, summary.metrics["train/reward_mean"], summary.checkpoints

`reroll train CONFIG.yaml key=value ...` is this module's `train` with a path and overrides.
Objects that a config cannot name are recorded in the run directory: the reward as `reward.type:
python` with each function's `module:qualname`, datasets saved to `inputs/*.jsonl` (which
`data.train`/`data.eval` then point at), and `inputs/python_objects.json` with a note. A resume
passes the same objects again (docs/python-api.md).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from reroll.config.agentic import AgenticConfig
from reroll.config.errors import ConfigError
from reroll.config.loading import Replace, parse_overrides, pipeline_of, read_yaml, validate
from reroll.config.loading import load_config as load_yaml_config
from reroll.config.pipelines import DEFAULT, KINDS, kind_of
from reroll.config.schema import RLConfig, SFTConfig
from reroll.models.files import check_model_path
from reroll.pipelines.inputs import INPUTS, InputFile, TaskInputs

Config = RLConfig | AgenticConfig | SFTConfig
ConfigLike = Config | dict | str | Path
"""A config object, a dict of sections (as the YAML would hold), or the path of a YAML file."""
Overrides = dict[str, Any] | list[str] | None
"""`{"train.steps": 3, "optimizer": {"lr": 1e-4}}` (dotted keys or nested dicts, Python values)
or the CLI's `["steps=3", "optimizer.lr=1e-4"]` (values parsed as YAML)."""
NOTE = ("These objects were passed to reroll.train from Python. config.yaml names them (reward."
        "functions, env.id); a name with <lambda>, <locals>, __main__ or () cannot be imported "
        "back, so resume such a run from Python with the same objects: reroll.train(config, "
        "reward_funcs=[...], overrides={'resume': True}). Datasets passed as objects are the "
        "jsonl files beside this one.")


@dataclass(frozen=True)
class RunSummary:
    """What a finished run returns: where its files are and how it ended."""

    pipeline: str
    """rlvr, agentic or sft."""
    run_dir: Path
    steps: int
    final_checkpoint: Path | None
    """The last checkpoint (RL: `checkpoints/step_N/`) or SFT's `final/` model."""
    checkpoints: list[Path]
    """Every checkpoint kept in the run directory, oldest first."""
    metrics: dict[str, Any]
    """The last step's metrics from metrics.jsonl (`train/reward_mean`, `eval/reward_mean`, ...)."""
    summary: dict[str, Any] = field(repr=False)
    """summary.json as written (first and last eval reward, wall time, ...): what the CLI prints."""

    def __getitem__(self, key: str) -> Any:
        """`summary["eval_reward_end"]`: summary.json's keys, as the dict the CLI prints."""
        return self.summary[key]

    def history(self) -> list[dict[str, Any]]:
        """Every step's metrics, in order (metrics.jsonl)."""
        from reroll.tracking import read_metrics

        return read_metrics(self.run_dir)

    @classmethod
    def of(cls, pipeline: str, summary: dict[str, Any]) -> RunSummary:
        run_dir = Path(summary["run_dir"])
        final = summary.get("final_checkpoint") or summary.get("final_model")
        return cls(pipeline, run_dir, int(summary["steps"]), Path(final) if final else None,
                   _checkpoints(run_dir), _last_step(_metric_rows(run_dir)), dict(summary))


def _metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_step(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last step's metrics, merged over its rows (SFT logs its final eval as a row of its
    own)."""
    last = rows[-1].get("step") if rows else None
    merged: dict[str, Any] = {}
    for row in rows:
        if row.get("step") == last:
            merged |= row
    return merged


def _checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


# -- configs ---------------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: Overrides = None,
                pipeline: str | None = None) -> Config:
    """A YAML config with overrides, validated against its `pipeline`'s schema (or `pipeline`'s,
    when given): the typed config object, to inspect or change before `train`."""
    return make_config(Path(path), overrides, pipeline)


def make_config(config: ConfigLike, overrides: Overrides = None,
                pipeline: str | None = None) -> Config:
    """A validated config from a dict of sections, a config object or a YAML path, with
    overrides. Errors are `ConfigError`s naming the field, as the CLI's."""
    data, source = _raw(config, overrides)
    return _validated(data, source, pipeline)


def _raw(config: ConfigLike, overrides: Overrides) -> tuple[dict[str, Any], str]:
    """The config as a plain dict of sections, overrides applied, and what to call it in errors."""
    if isinstance(config, (str, Path)):
        data, source = read_yaml(config), str(config)
    elif isinstance(config, BaseModel):
        data, source = config.model_dump(mode="json"), f"{type(config).__name__} object"
    elif isinstance(config, dict):
        data, source = copy.deepcopy(config), "config dict"
    else:
        raise ConfigError(f"config: expected a config object, a dict or a YAML path, got "
                          f"{type(config).__name__}")
    return _merge(data, _override_tree(overrides)), source


def _override_tree(overrides: Overrides) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, list):
        return parse_overrides(overrides)
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides: expected a dict or a list of key=value strings, got "
                          f"{type(overrides).__name__}")
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        if not all(parts):
            raise ConfigError(f"overrides: {key!r} is not a dotted key path")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"overrides: {key!r}: {part!r} was already set to a value")
        node[parts[-1]] = _merge(node[parts[-1]], value) \
            if isinstance(node.get(parts[-1]), dict) and isinstance(value, dict) else value
    return tree


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict) \
            and not isinstance(value, Replace)  # `env.kwargs={}` replaces, as on the CLI
        out[key] = _merge(out[key], value) if both else value
    return out


def _validated(data: dict[str, Any], source: str, expect: str | None) -> Config:
    """Validate against the schema of the config's `pipeline` (`expect` when it names none);
    the messages are `reroll.config.load_config`'s."""
    pipeline = data.get("pipeline", expect or DEFAULT.name)
    if expect is not None and pipeline != expect:
        raise ConfigError(f"{source}: pipeline is {pipeline!r}, but this call runs {expect!r} "
                          f"configs")
    try:
        kind = kind_of(pipeline)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return validate(kind.config, data, source)


# -- objects ---------------------------------------------------------------------------------------


def _dataset_records(dataset: Any, name: str) -> list[Any]:
    """A dataset passed as an object, as a list of row dicts: a list (or any iterable) of dicts,
    a `datasets.Dataset` or a pandas DataFrame."""
    if isinstance(dataset, dict):
        raise ConfigError(f"{name}: a dict; pass a list of rows (dicts), a datasets.Dataset or a "
                          f"file path")
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        return list(dataset.to_list())
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # pandas.DataFrame
        return list(dataset.to_dict("records"))
    if isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes)):
        return list(dataset)
    raise ConfigError(f"{name}: {type(dataset).__name__} is not a dataset; pass a list of rows "
                      f"(dicts), a datasets.Dataset or a file path")


def _jsonl(records: list[Any], name: str) -> str:
    lines = []
    for i, row in enumerate(records):
        try:
            lines.append(json.dumps(row, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{name}[{i}]: cannot be saved as JSON ({e})") from None
    return "".join(line + "\n" for line in lines)


def _attach_datasets(data: dict[str, Any], datasets: dict[str, Any]) -> dict[str, list]:
    """Point `data.train`/`data.eval` at the datasets: a path as given; an object is checked
    row by row now and saved under the run directory later. Returns the objects' records."""
    from reroll.data.datasets import parse_records

    if all(dataset is None for dataset in datasets.values()):
        return {}
    section = data.setdefault("data", {})
    if not isinstance(section, dict):
        raise ConfigError("data: must be a section (a mapping)")
    records = {}
    for key, dataset in datasets.items():
        name = f"{key}_dataset"
        if dataset is None:
            continue
        if isinstance(dataset, (str, Path)):
            section[key] = str(dataset)
            continue
        rows = _dataset_records(dataset, name)
        parse_records(rows, name, section.get("system_prompt"))  # a bad row fails here
        records[key] = rows
        section[key] = str(Path(INPUTS) / f"{key}.jsonl")  # placed under the run dir below
    return records


def _reward_section(current: Any, names: list[str], weights: list[float] | None) -> dict:
    """`reward.type: python` naming the functions; limits kept from a custom/python section."""
    section: dict[str, Any] = {"type": "python", "functions": names, "weights": weights}
    if isinstance(current, dict):
        keep = ("max_failure_rate_step", "max_failure_rate_run")
        if current.get("type") in ("custom", "python"):
            keep += ("timeout_s", "num_workers", "memory_mb")
        section |= {k: current[k] for k in keep if k in current}
    return section


def _reward_funcs(funcs: Any, weights: Any) -> tuple[list[Callable], list[float] | None]:
    from reroll.rewards.custom import ByValue
    from reroll.rewards.python import check_signature, object_name

    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    if not funcs:
        raise ConfigError("reward_funcs: empty; pass at least one function fn(sample) -> float")
    for i, fn in enumerate(funcs):
        check_signature(fn, f"reward_funcs[{i}]")
        if not inspect.iscoroutinefunction(fn):
            ByValue(fn, f"reward_funcs[{i}] ({object_name(fn)})")  # sent to worker processes
    if weights is not None:
        weights = list(weights) if isinstance(weights, (list, tuple)) else [weights]
        for i, w in enumerate(weights):  # refused now, not as a NaN reward at step 1
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
                raise ConfigError(f"reward_weights[{i}]: {w!r} is not a finite number")
        weights = [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ConfigError(f"reward_weights: {len(weights)} weights for {len(funcs)} "
                              f"reward_funcs")
    return funcs, weights


def _env_factory(env: Any, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A fresh environment per episode from a class, a factory or an instance (copied), each
    wrapped for the episode statistics; one is built now, so a bad one fails at start."""
    from reroll.rewards.python import object_name

    name = object_name(env)
    instance = not inspect.isclass(env) and hasattr(env, "reset") and hasattr(env, "step")
    if instance and kwargs:
        raise ConfigError(f"env: {name} is an instance; env.kwargs {sorted(kwargs)} apply to a "
                          f"class or factory")
    if not instance and not callable(env):
        raise ConfigError(f"env: {env!r} is neither an environment nor a class or factory")

    # A partial of a module-level function, not a closure: `env.isolation: process` sends it
    # to an env process (which imports `env` by its module, so it must be importable there).
    make = functools.partial(_fresh_env, env, kwargs, instance)
    try:
        sample = env if instance else env(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env: {name}(**env.kwargs) failed ({type(e).__name__}: {e})") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(sample, m, None))]
    if missing:
        raise ConfigError(f"env: {name} gives a {type(sample).__name__}, which lacks "
                          f"{' and '.join(missing)}; an environment has reset(seed) -> (obs, "
                          f"info) and step(action) -> (obs, reward, terminated, truncated, info)")
    return make


def _fresh_env(env: Any, kwargs: dict[str, Any], instance: bool) -> Any:
    from reroll.envs.wrappers import EpisodeStats

    return EpisodeStats(copy.deepcopy(env) if instance else env(**kwargs))


@dataclass
class _Objects:
    reward_funcs: Any = None
    reward_weights: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    env: Any = None

    def given(self) -> bool:
        return any(v is not None for v in vars(self).values())


def _prepare(config: ConfigLike, overrides: Overrides, objects: _Objects,
             kinds: tuple[str, ...]) -> tuple[Config, TaskInputs]:
    """The validated config with the objects recorded in it, and the objects for the pipeline."""
    if not objects.given() and isinstance(config, (str, Path)) and not isinstance(overrides, dict):
        # exactly the CLI's loading (`reroll train CONFIG key=value ...`)
        expect = pipeline_of(config, overrides) if len(kinds) > 1 else kinds[0]
        return load_yaml_config(config, overrides, expect=expect if expect in kinds
                                else kinds[0]), TaskInputs()
    data, source = _raw(config, overrides)
    with_env = [k for k in kinds if kind_of(k).env]
    pipeline = data.get("pipeline") or (with_env[0] if objects.env is not None and with_env
                                        else kinds[0])
    if pipeline not in kinds:
        raise ConfigError(f"{source}: pipeline is {pipeline!r}, but this call runs "
                          f"{' or '.join(map(repr, kinds))} configs")
    data["pipeline"] = pipeline
    _check_objects_fit(pipeline, objects)
    records = _attach_datasets(data, {"train": objects.train_dataset,
                                      "eval": objects.eval_dataset})
    note: dict[str, Any] = {}
    reward_factory = env_factory = None
    if objects.reward_funcs is not None:
        funcs, weights = _reward_funcs(objects.reward_funcs, objects.reward_weights)
        from reroll.rewards.python import importable, object_name

        names = [object_name(fn) for fn in funcs]
        data["reward"] = _reward_section(data.get("reward"), names, weights)
        note["reward_funcs"] = [{"name": n, "weight": w, "importable": importable(n)}
                                for n, w in zip(names, weights or [1.0] * len(names),
                                                strict=True)]
    elif objects.reward_weights is not None:
        raise ConfigError("reward_weights: given without reward_funcs")
    if objects.env is not None:
        section = data.setdefault("env", {})
        env_factory = _env_factory(objects.env, dict(section.get("kwargs") or {}))
        from reroll.rewards.python import object_name

        section["id"] = object_name(objects.env)
        note["env"] = section["id"]
    config_obj = _validated(data, source, pipeline)
    run_dir = config_obj.run_dir()
    files = []
    for key, rows in records.items():
        data["data"][key] = str(run_dir / INPUTS / f"{key}.jsonl")
        files.append(InputFile(f"{INPUTS}/{key}.jsonl", _jsonl(rows, f"{key}_dataset"),
                               f"{key}_dataset"))
    if note:
        files.append(InputFile(f"{INPUTS}/python_objects.json",
                               json.dumps({"note": NOTE} | note, indent=2) + "\n",
                               "reward_funcs, reward_weights and env"))
    config_obj = _validated(data, source, pipeline)
    if objects.reward_funcs is not None:
        reward_factory = _reward_factory(config_obj.reward, funcs)
    return config_obj, TaskInputs(reward_factory, env_factory, tuple(files))


def _reward_factory(section: Any, funcs: list[Callable]) -> Callable[[], Any]:
    from reroll.rewards.python import python_reward

    return lambda: python_reward(section, funcs)


def _check_objects_fit(pipeline: str, objects: _Objects) -> None:
    """Objects that the pipeline has no use for are an error, not silently ignored."""
    kind = kind_of(pipeline)
    for name, value in vars(objects).items():
        if value is not None and name not in kind.objects:
            raise ConfigError(f"{name}: not used by a {pipeline} run ({kind.objects_note})")


def _kinds(*schemas: type[BaseModel]) -> tuple[str, ...]:
    """The pipelines whose config schemas are `schemas`, the table's order."""
    return tuple(name for name, kind in KINDS.items() if kind.config in schemas)


# -- running ---------------------------------------------------------------------------------------


def train(config: ConfigLike, *, reward_funcs: Any = None,
          reward_weights: list[float] | None = None, train_dataset: Any = None,
          eval_dataset: Any = None, env: Any = None, overrides: Overrides = None) -> RunSummary:
    """Run an RL pipeline (rlvr, or agentic when the config says so or `env` is given) and
    return its summary.

    - `reward_funcs`: a function or a list of them, `fn(sample) -> float | RewardResult` (sync
      or `async def`), summed with `reward_weights` (default 1.0 each); replaces `reward:`.
    - `train_dataset`, `eval_dataset`: a list of dicts (`prompt` or `messages`, usually
      `answer`; other keys reach the reward as `sample.metadata`), a `datasets.Dataset`, a
      pandas DataFrame or a file path; replace `data.train` / `data.eval`.
    - `env`: an environment class, a factory (called with `env.kwargs`) or an instance (copied
      per episode), with `reset(seed)` and `step(action)`; replaces `env.id`.

    Bad objects are a `ConfigError` before anything starts; a failing run raises `RunStopped`.
    """
    objects = _Objects(reward_funcs, reward_weights, train_dataset, eval_dataset, env)
    config, inputs = _prepare(config, overrides, objects, _kinds(RLConfig, AgenticConfig))
    check_model_path(config.model.path)  # before the pipeline imports torch (many seconds)
    from reroll.pipelines.run import train as run

    return RunSummary.of(config.pipeline, run(config, inputs))


def sft(config: ConfigLike, *, train_dataset: Any = None, eval_dataset: Any = None,
        overrides: Overrides = None) -> RunSummary:
    """Supervised fine-tuning (`pipeline: sft` configs); datasets as in `train`, with the target
    in `response` (`data.response_key`) or `messages` ending with the assistant's message."""
    objects = _Objects(train_dataset=train_dataset, eval_dataset=eval_dataset)
    config, inputs = _prepare(config, overrides, objects, _kinds(SFTConfig))
    check_model_path(config.model.path)
    from reroll.pipelines.run import train as run

    return RunSummary.of(config.pipeline, run(config, inputs))


class Trainer:
    """TRL-style: `Trainer(config, reward_funcs=[fn], train_dataset=ds).train()`. Holds the
    config and the objects; `train(resume=True)` continues the same run with the same objects."""

    def __init__(self, config: ConfigLike, *, reward_funcs: Any = None,
                 reward_weights: list[float] | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, env: Any = None, overrides: Overrides = None):
        self.config, self.overrides = config, overrides
        self.objects = dict(reward_funcs=reward_funcs, reward_weights=reward_weights,
                            train_dataset=train_dataset, eval_dataset=eval_dataset, env=env)

    def train(self, resume: bool | str | None = None) -> RunSummary:
        """Run (or, with `resume`, continue from the newest or the given checkpoint)."""
        overrides = self.overrides
        if resume is not None:
            base = _override_tree(overrides)
            overrides = _merge(base, {"resume": resume})
        return train(self.config, overrides=overrides, **self.objects)

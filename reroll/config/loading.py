"""YAML loading, dotted CLI overrides, and turning validation errors into one clear message."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from reroll.config.agentic import AgenticConfig
from reroll.config.errors import ConfigError
from reroll.config.pipelines import DEFAULT, KINDS
from reroll.config.reference import doc_anchor, key_path, model_at, section_of, takes_key
from reroll.config.schema import RLConfig, SFTConfig

PIPELINES: dict[str, type[BaseModel]] = {name: kind.config for name, kind in KINDS.items()}

T = TypeVar("T", bound=BaseModel)
FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class Replace(dict):
    """A mapping given as an override's value (`env.kwargs={}`, `env.kwargs={count: 4}`): it
    replaces the config's mapping, as in Hydra, where a dotted key (`env.kwargs.count=4`)
    changes one key of it."""


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=3", "c=true"]` -> `{"a": {"b": 3}, "c": True}`; values are parsed as YAML (a
    mapping value is a `Replace`)."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        if isinstance(value, str) and FLOAT.fullmatch(value):
            value = float(value)  # YAML 1.1 reads "1e-4" as a string
        if isinstance(value, dict):
            value = Replace(value)
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} was already set to a value")
            node = child
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) \
                and not isinstance(value, Replace):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path}: a directory, not a YAML file (a run's config "
                          f"is its config.yaml; `resume=true` resumes a run)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def format_validation_error(error: ValidationError, source: str,
                            schema: type[BaseModel] | None = None,
                            overrides: list[str] | None = None) -> str:
    """One line per problem, naming the key; a problem in a command-line override names the
    override, and an unknown key lists its section's keys and where docs/config.md documents
    them."""
    lines, from_file = [], False
    for item in error.errors():
        loc = tuple(item["loc"])  # union sections' tags included, as the schema is walked
        shown = key_path(schema, loc) if schema is not None else loc  # as the user writes it
        path = ".".join(str(p) for p in shown) or "(top level)"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = _unknown_key(schema, loc) if schema is not None else \
                "unknown key (check the spelling)"
        elif item["type"] == "model_type" and schema is not None:
            model = model_at(schema, loc)
            got = item.get("input")
            got = f"a list of {len(got)}" if isinstance(got, list) else repr(got)
            msg = (f"expected one `{path}` section (a mapping of its keys: "
                   f"{', '.join(model.model_fields)}), got {got}")
        elif item["type"] == "union_tag_invalid":
            ctx = item.get("ctx", {})
            path += "." + str(ctx.get("discriminator", "name")).removesuffix("()")
            msg = f"unknown choice {ctx.get('tag')!r} (choose from {ctx.get('expected_tags')})"
        elif item["type"] == "missing":
            msg = "required field is missing"
        elif "input" in item and item["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg} (got {item['input']!r})"
        override = _override_of(schema, loc, overrides or [])
        if override is None:
            from_file = True
            lines.append(f"  {path}: {msg}")
        else:
            lines.append(f"  command-line override {override!r}: {path}: {msg}")
    head = f"invalid config ({source}):" if from_file else \
        f"invalid command-line override (applied to {source}):"
    return "\n".join([head, *lines])


def _unknown_key(schema: type[BaseModel], loc: tuple) -> str:
    """An unknown key's message: the pipelines whose configs take it (`scheduler` in an agentic
    config), else the closest key of its section (`grup_size` -> `group_size`); then the
    section's keys and where docs/config.md documents them."""
    section, model = section_of(schema, loc)
    key, path = str(loc[-1]), key_path(schema, loc)
    this = next((name for name, other in PIPELINES.items() if other is schema), None)
    others = [] if takes_key(schema, path) else [  # else another variant of a union takes it
        name for name, other in PIPELINES.items() if other is not schema and takes_key(other, path)]
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    if others and this is not None:
        which = "pipelines that take" if len(others) > 1 else "pipeline that takes"
        msg = f"not a key of `pipeline: {this}` configs (the {which} it: {', '.join(others)})"
    elif close:
        msg = f"unknown key (did you mean `{close[0]}`?)"
    else:
        msg = "unknown key (check the spelling)"
    where = f"the keys of `{section}` are" if section else "the top-level keys are"
    return f"{msg}; {where} {', '.join(model.model_fields)} ({doc_anchor(schema, section, model)})"


def _override_of(schema: type[BaseModel] | None, loc: tuple, overrides: list[str]) -> str | None:
    """The command-line override that set the key at `loc` (or a section above or below it)."""
    if schema is None or not loc:
        return None

    key = key_path(schema, loc)
    for item in reversed(overrides):  # the last one given wins, as in the merge
        parts = tuple(item.partition("=")[0].split("."))
        if key[:len(parts)] == parts or parts[:len(key)] == key:
            return item
    return None


def validate(schema: type[T], data: dict[str, Any], source: str,
             overrides: list[str] | None = None) -> T:
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, schema, overrides)) from None


def pipeline_of(path: str | Path, overrides: list[str] | None = None) -> str:
    """The `pipeline` a config file (with its overrides) asks for; `rlvr` when it names none."""
    data = _merge(read_yaml(path), parse_overrides(overrides or []))
    return str(data.get("pipeline", DEFAULT.name))


def load_config(path: str | Path, overrides: list[str] | None = None,
                expect: str | None = None) -> RLConfig | SFTConfig | AgenticConfig:
    """Read a YAML config, apply `key.path=value` overrides, and validate it against the schema of
    its `pipeline` (or `expect` when the command implies one)."""
    data = _merge(read_yaml(path), parse_overrides(overrides or []))
    pipeline = data.get("pipeline", expect or DEFAULT.name)
    if expect is not None and pipeline != expect:
        raise ConfigError(f"{path}: pipeline is {pipeline!r}, but this command runs {expect!r} configs")
    if pipeline not in PIPELINES:
        raise ConfigError(f"{path}: pipeline: unknown pipeline {pipeline!r} (choose from {sorted(PIPELINES)})")
    return validate(PIPELINES[pipeline], data, str(path), overrides)

"""Render the config schemas as a Markdown reference (docs/config.md), from the field docstrings."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from reroll.config.agentic import AgenticConfig
from reroll.config.distill import DistillConfig
from reroll.config.preference import DPOConfig, RMConfig
from reroll.config.schema import RLConfig, SFTConfig


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models inside a field's annotation (through Optional, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    return str(annotation).replace("typing.", "")


def _implied_doc(name: str, field, models: list[type[BaseModel]]) -> str:
    if name in ("name", "type") and typing.get_origin(field.annotation) is typing.Literal:
        return "Selects this variant."
    if models and models[0].__doc__:
        return " ".join(models[0].__doc__.split()).split(". ")[0].rstrip(".") + "."
    return ""


def _default(field) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory in (list, dict):
            return f"`{field.default_factory()!r}`"
        return "required" if field.default_factory is None else "(section)"
    return f"`{field.default!r}`"


def render(model: type[BaseModel], prefix: str = "", seen: set | None = None) -> list[str]:
    seen = set() if seen is None else seen
    lines = []
    nested = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        models = _models_in(field.annotation)
        doc = (field.description or _implied_doc(name, field, models)).replace("\n", " ")
        lines.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
        nested += [(path, m) for m in models]
    out = []
    if lines:
        title = prefix.rstrip(".") or "top level"
        out += [f"### `{title}` ({model.__name__})", ""]
        if model.__doc__ and prefix:
            out += [" ".join(model.__doc__.split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *lines, ""]
    for path, sub in nested:
        if (path, sub) not in seen:
            seen.add((path, sub))
            out += render(sub, f"{path}.", seen)
    return out


def render_markdown() -> str:
    parts = ["# Config reference", "",
             "Generated from the schemas in `reroll/config/` (`python -m reroll.config.reference`).",
             "Unknown keys are errors; a union section picks its variant by `name` (or `type`). "
             "Every float must be a finite number (NaN and infinities are refused).",
             "The error names the pipelines whose configs take a key that this pipeline's do "
             "not (`data` in an agentic config: `rlvr`, `sft`, ...), or the closest key of the "
             "section (`grup_size`: did you mean `group_size`?).", "",
             "On the command line, `key.path=value` sets one key (its value read as YAML); a "
             "mapping as the value replaces the config's mapping, as in Hydra: "
             "`env.kwargs={}` clears the YAML's `env.kwargs`, `env.kwargs={count: 4}` leaves "
             "only `count`, while `env.kwargs.count=4` changes `count` and keeps the rest. "
             "Overrides apply in order, the last one given wins.", ""]
    for title, model in (("`reroll train` (RLVR)", RLConfig), ("`reroll sft`", SFTConfig),
                         ("`reroll train` with `pipeline: agentic`", AgenticConfig),
                         ("`reroll dpo`", DPOConfig), ("`reroll rm`", RMConfig),
                         ("`reroll distill`", DistillConfig)):
        parts += [f"## {title}", "", *render(model)]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render_markdown())


# -- where a key is documented (config errors point there) ------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to `-`."""
    text = heading.lstrip("#").strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def _walk(schema: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel], int]:
    """Follow `loc` (a validation error's location) through nested sections, skipping the tag
    of union sections; returns (section path, its model, index of the first key not walked)."""
    model, path, i = schema, [], 0
    while i < len(loc):
        field = model.model_fields.get(str(loc[i]))
        models = _models_in(field.annotation) if field is not None else []
        if not models:
            break
        path.append(str(loc[i]))
        i += 1
        if len(models) > 1 and i < len(loc):  # the union's tag comes next in `loc`
            tag = loc[i]
            models = [m for m in models if any(f.default == tag for f in
                                               m.model_fields.values())] or models
            i += 1
        model = models[0]
    return path, model, i


def section_of(schema: type[BaseModel], loc: tuple) -> tuple[str, type[BaseModel]]:
    """The config section (dotted path, model) holding the key at `loc` of a validation error,
    following union sections through their tag (`reward.custom.function` -> `reward`)."""
    path, model, _ = _walk(schema, loc[:-1])
    return ".".join(path), model


def model_at(schema: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The config model of the section at `loc` (`("env",)` -> EnvConfig)."""
    return _walk(schema, loc)[1]


def takes_key(schema: type[BaseModel], path: tuple[str, ...]) -> bool:
    """Whether `schema` has the key at `path`, as the user writes it (a union section's keys
    are those of any of its variants)."""
    models = [schema]
    for i, part in enumerate(path):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        if i < len(path) - 1:
            models = [m for f in fields for m in _models_in(f.annotation)]
    return True


def key_path(schema: type[BaseModel], loc: tuple) -> tuple[str, ...]:
    """`loc` as the user writes the key: union tags left out (`reward.function`)."""
    path, _, i = _walk(schema, loc)
    return (*path, *(str(part) for part in loc[i:]))


def doc_anchor(schema: type[BaseModel], section: str, model: type[BaseModel]) -> str:
    """`docs/config.md#...` of `section` (rendered as `model`) in `schema`'s part of the page."""
    lines = render_markdown().splitlines()
    seen: dict[str, int] = {}
    part, wanted = None, f"### `{section or 'top level'}` ({model.__name__})"
    for line in lines:
        if not line.startswith("#"):
            continue
        slug = _slug(line)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchor = slug if count == 0 else f"{slug}-{count}"
        if line.startswith("## "):
            part = line
        elif line == wanted and part == _part_title(schema):
            return f"docs/config.md#{anchor}"
    return "docs/config.md"


def _part_title(schema: type[BaseModel]) -> str:
    titles = {"RLConfig": "`reroll train` (RLVR)", "SFTConfig": "`reroll sft`",
              "AgenticConfig": "`reroll train` with `pipeline: agentic`",
              "DPOConfig": "`reroll dpo`", "RMConfig": "`reroll rm`",
              "DistillConfig": "`reroll distill`"}
    return f"## {titles.get(schema.__name__, schema.__name__)}"

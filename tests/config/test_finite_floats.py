"""Every float of the config schema refuses NaN and +-inf (issue 49: a domain's `weight: .inf`
passed `gt=0` and crashed the mixer; `reward_weights=[nan]` stopped the run at step 1). The
schema is walked, so a field added later is checked too."""

from __future__ import annotations

import importlib
import math
import pkgutil
import types
import typing

import pytest
from pydantic import ValidationError

import reroll.config
from reroll.config.base import Section

pytestmark = pytest.mark.unit


def sections() -> list[type[Section]]:
    for module in pkgutil.iter_modules(reroll.config.__path__):
        importlib.import_module(f"reroll.config.{module.name}")
    found, todo = [], [Section]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found.append(cls)
    return found[1:]


def bad_value(annotation, value: float):
    """`value` where `annotation` takes a float (inside an Optional, a union, a list or a dict
    value), or None when it takes none."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is float:
        return value
    if origin is typing.Annotated:
        return bad_value(args[0], value)
    if origin in (typing.Union, types.UnionType):
        return next((v for v in (bad_value(a, value) for a in args) if v is not None), None)
    if origin in (list, tuple) and args:
        inner = bad_value(args[0], value)
        return None if inner is None else [inner]
    if origin is dict and len(args) == 2:
        inner = bad_value(args[1], value)
        return None if inner is None else {"k": inner}
    return None


FIELDS = [(cls, name, field.annotation) for cls in sections()
          for name, field in cls.model_fields.items()
          if bad_value(field.annotation, math.nan) is not None]


def test_the_walk_finds_the_float_fields():
    names = {f"{cls.__name__}.{name}" for cls, name, _ in FIELDS}
    assert {"DomainConfig.weight", "LoRAConfig.alpha", "PythonReward.weights",
            "JudgeReward.choices"} <= names, sorted(names)
    assert len(FIELDS) > 50


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_every_float_field_refuses_non_finite_values(value):
    accepted = []
    for cls, name, annotation in FIELDS:
        try:
            cls.model_validate({name: bad_value(annotation, value)})
        except ValidationError as e:
            if any(err["loc"][:1] == (name,) and err["type"] == "finite_number"
                   for err in e.errors()):
                continue
        accepted.append(f"{cls.__name__}.{name}")
    assert not accepted, accepted

"""Building blocks of every config section."""

from __future__ import annotations

from functools import reduce
from operator import or_
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator


class Section(BaseModel):
    # allow_inf_nan=False: every float of every section (bounded or not, in lists and dicts)
    # refuses NaN and +-inf, which `gt=0`/`ge=0` bounds would let through (`weight: .inf`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False,
                              allow_inf_nan=False)


class RunSection(Section):
    """The top level of a run's config: its `name` titles the run (the report, the trackers);
    left unset with an `output_dir`, it is that folder's name, not the pipeline's default."""

    @model_validator(mode="after")
    def _name_from_output_dir(self) -> RunSection:
        folder = Path(getattr(self, "output_dir", None) or "").name
        if "name" not in self.model_fields_set and folder:
            self.name = folder
        return self


def choice(key: str, default: str, *options: type[BaseModel]) -> Any:
    """A typed union of config models told apart by the literal field `key`, which defaults to
    `default` when the YAML leaves it out. Used wherever the user picks one algorithm by name."""

    def tag_of(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get(key, default)
        return getattr(value, key, None)

    tag_of.__name__ = key  # pydantic names the field as "<name>()" in its error messages

    tagged = tuple(Annotated[o, Tag(o.model_fields[key].default)] for o in options)
    return Annotated[tagged[0] if len(tagged) == 1 else _union(tagged), Discriminator(tag_of)]


def _union(types: tuple[Any, ...]) -> Any:
    return reduce(or_, types)

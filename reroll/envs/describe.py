"""What an environment takes: its keyword arguments with their defaults and docs, read from the
factory itself, so that `reroll envs` shows built-in and user environments alike.

A keyword's doc comes from, first found: a pydantic field's `description`; a docstring under
the field or class attribute (dataclasses, pydantic models, this project's style); an entry of
the class's, its `__init__`'s or the function's docstring in Google (`Args:` / `name: text`),
NumPy (`Parameters` / `name : type`) or Sphinx (`:param name: text`) form.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reroll.config.errors import ConfigError
from reroll.envs.base import EnvError, checked_reset
from reroll.envs.registry import env_specs, make_env
from reroll.envs.user import USER_FILE_MODULE, is_user_id, load_factory
from reroll.envs.wrappers import EpisodeStats, MaxTurns

SECTION = re.compile(r"^(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Params)\s*:?\s*$")
GOOGLE_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
NUMPY_ENTRY = re.compile(r"^(\w+)\s*(:\s*.*)?$")
SPHINX_ENTRY = re.compile(r":param\s+(?:[\w\[\], |.]+\s+)?(\w+)\s*:\s*(.*)")


@dataclass
class KwargDoc:
    """One keyword argument of an environment's factory."""

    name: str
    default: str
    """The default's repr, or `required`."""
    type: str
    doc: str


def describe_factory(factory: Callable[..., Any]) -> str:
    """The first paragraph of the factory's docstring (else its module's), on one line."""
    doc = inspect.getdoc(factory) or inspect.getdoc(inspect.getmodule(factory)) or ""
    return " ".join(doc.split("\n\n")[0].split())


def kwarg_docs(factory: Callable[..., Any]) -> list[KwargDoc]:
    """The factory's keyword arguments, in signature order (`**kwargs` as one entry)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    docs = _docs(factory)
    rows = []
    for param in signature.parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            continue
        name = f"**{param.name}" if param.kind == param.VAR_KEYWORD else param.name
        default = "" if param.kind == param.VAR_KEYWORD else \
            "required" if param.default is param.empty else _short(repr(param.default))
        rows.append(KwargDoc(name, default, _annotation(param.annotation),
                             docs.get(param.name, docs.get(name, ""))))
    return rows


def _docs(factory: Callable[..., Any]) -> dict[str, str]:
    """name -> doc from every source; earlier sources win."""
    docs: dict[str, str] = {}
    sources: list[Any] = [factory]
    if inspect.isclass(factory):
        fields = getattr(factory, "model_fields", None)  # pydantic
        if isinstance(fields, dict):
            docs |= {n: " ".join(f.description.split()) for n, f in fields.items()
                     if getattr(f, "description", None)}
        for klass in factory.__mro__:
            if klass is not object:
                docs = _attribute_docs(klass) | docs
        sources.append(factory.__init__)
    for source in sources:
        docs = docstring_params(inspect.getdoc(source) or "") | docs
    return docs


def _attribute_docs(klass: type) -> dict[str, str]:
    """Docstrings written under class attributes (`x: int = 1` then `\"\"\"doc\"\"\"`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and isinstance(following, ast.Expr) \
                and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str):
            docs[target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def docstring_params(doc: str) -> dict[str, str]:
    """name -> text of the parameters a docstring documents (Google, NumPy or Sphinx form)."""
    docs = {m.group(1): m.group(2) for m in SPHINX_ENTRY.finditer(doc)}
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        if not SECTION.match(lines[i].strip()):
            i += 1
            continue
        numpy = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
        i += 2 if numpy else 1
        base = _indent(lines[i]) if i < len(lines) else 0
        name = None
        while i < len(lines):
            line, stripped = lines[i], lines[i].strip()
            if stripped and _indent(line) < base or \
                    numpy and i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}:
                break  # the section ended, or the next NumPy section starts
            if stripped and _indent(line) == base:
                entry = (NUMPY_ENTRY if numpy else GOOGLE_ENTRY).match(stripped)
                if not entry:
                    break
                name = entry.group(1).lstrip("*")
                docs[name] = "" if numpy else entry.group(3)
            elif stripped and name:
                docs[name] = f"{docs[name]} {stripped}"
            i += 1
    return {k: " ".join(v.split()) for k, v in docs.items()}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- one environment, for `reroll envs --describe ID` --------------------------------------------


def env_factory(env_id: str) -> tuple[Callable[..., Any], str]:
    """(factory, one-line description) of a built-in or user environment."""
    specs = env_specs()
    if env_id in specs:
        return specs[env_id].factory, specs[env_id].description
    if env_id.startswith("gem:") or not is_user_id(env_id):
        make_env(env_id)  # the error that names the problem (unknown id, gem missing)
        raise ConfigError(f"--describe {env_id}: gem-llm environments are described by gem "
                          f"(`gem.make` arguments); this lists built-in and user environments")
    factory = load_factory(env_id)
    return factory, describe_factory(factory)


def env_report(env_id: str, kwargs: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """What `reroll envs --describe` shows: where the factory lives, its keyword arguments,
    and a real check: the env is built with `kwargs`, checked against the protocol and reset
    with `seed` (its first observation is shown). A problem is a ConfigError."""
    factory, description = env_factory(env_id)
    env = make_env(env_id, **kwargs)
    try:
        obs, info = checked_reset(env.reset(seed))
    except EnvError as e:
        raise ConfigError(f"env.id {env_id!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's reset is broken; say how
        raise ConfigError(f"env.id {env_id!r}: reset({seed}) raised {type(e).__name__}: {e}"
                          ) from None
    inner = env
    while isinstance(inner, EpisodeStats | MaxTurns):
        inner = inner.env
    return {"id": env_id, "factory": _location(factory), "description": description,
            "kwargs": kwarg_docs(factory), "class": type(inner).__name__,
            "async": [m for m in ("areset", "astep") if hasattr(type(inner), m)],
            "expert": hasattr(inner, "expert_action"), "seed": seed,
            "observation": obs, "info": info}


def _location(factory: Callable[..., Any]) -> str:
    """`module.Name (file:line)`; a factory loaded from a file is named by its file only."""
    name = f"{factory.__module__}.{factory.__qualname__}"
    try:
        where = f"{inspect.getsourcefile(factory)}:{inspect.getsourcelines(factory)[1]}"
    except (OSError, TypeError):
        return name
    return f"{factory.__qualname__} ({where})" if factory.__module__.startswith(USER_FILE_MODULE) \
        else f"{name} ({where})"

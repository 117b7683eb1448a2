"""A user's environment, named by import path: `env.id: my_envs:CoinFlip` (a class or a factory
function in a module importable from the working directory or an installed package) or
`env.id: path/to/envs.py:CoinFlip` (a file).

Everything a user can get wrong is a ConfigError naming it, found at start-up rather than in
the middle of a run: the module or file is missing or fails to import, the attribute is missing
or not callable, the config's `env.kwargs` do not fit its signature, or what it builds lacks the
Env protocol (`reset(seed) -> (obs, info)`, `step(action) -> (obs, reward, terminated,
truncated, info)`).

The working directory goes on `sys.path` (at the front, as `python -m` and `reward.function` do),
so `reroll train` run from a project folder imports that folder's modules. The driver builds
one at start for these checks; the episodes' environments are built, by default, in an env
process started from the same folder and `sys.path` (`env.isolation`, `reroll.envs.process`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError

USER_FILE_MODULE = "reroll_user_env_"
"""Prefix of the module name a `path/to/file.py:Class` file is loaded as."""
PROTOCOL_HINT = "see `Write your own environment` in docs/agentic.md"


def is_user_id(env_id: str) -> bool:
    """`module:Name` or `file.py:Name` (gem's `gem:<id>` is checked before this)."""
    return ":" in env_id


def load_factory(env_id: str) -> Callable[..., Any]:
    """The class or function `env_id` names; ConfigError when it cannot be found or called."""
    where, _, name = env_id.rpartition(":")
    if not where or not name or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"env.id {env_id!r}: a user environment is named `module:Class` or "
                          f"`path/to/file.py:Class` (e.g. my_envs:CoinFlip)")
    module = _load_file(env_id, where) if where.endswith(".py") else _import(env_id, where)
    target: Any = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"env.id {env_id!r}: {_origin(module)} has no attribute {part!r}"
                              f"{_offer(target)}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"env.id {env_id!r}: {name} is a {type(target).__name__}, not a class "
                          f"or a function that returns an environment")
    return target


def _import(env_id: str, module_name: str):
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: the working directory imports
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            hint = " (a file is named path/to/file.py:Class)" if "/" in module_name else ""
            raise ConfigError(f"env.id {env_id!r}: no module named {e.name!r} in the working "
                              f"directory ({cwd}) or the installed packages{hint}") from None
        raise ConfigError(f"env.id {env_id!r}: importing {_where(module_name, e)} failed: "
                          f"{e}") from None
    except Exception as e:  # noqa: BLE001 - the module itself is broken: a syntax error, a raise
        raise ConfigError(f"env.id {env_id!r}: importing {_where(module_name, e)} failed "
                          f"({type(e).__name__}: {e})") from None


def _load_file(env_id: str, file: str):
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"env.id {env_id!r}: no file {file} (looked for {path})")
    # One module per file, reused by every env instance of the run.
    module_name = f"{USER_FILE_MODULE}{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # the file's own sibling imports work
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's file is their config's
        del sys.modules[module_name]
        raise ConfigError(f"env.id {env_id!r}: importing {_where(str(path), e)} failed "
                          f"({type(e).__name__}: {e})") from None
    return module


def _where(module_name: str, error: Exception) -> str:
    """`file:line` of a syntax error or of the failing line in the module, else its name."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = [f for f in inspect.getinnerframes(error.__traceback__, 0)
              if "importlib" not in f.filename] if error.__traceback__ else []
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    return module_name


def _origin(module) -> str:
    return f"{module.__name__} ({getattr(module, '__file__', None) or 'no file'})" \
        if not module.__name__.startswith(USER_FILE_MODULE) else str(module.__file__)


def _offer(target: Any) -> str:
    """The classes and functions that the module defines itself, to suggest one."""
    names = [n for n, v in vars(target).items() if not n.startswith("_") and callable(v)
             and getattr(v, "__module__", None) == getattr(target, "__name__", None)]
    return f"; it defines: {', '.join(sorted(names))}" if names else ""


# -- the checks of what the factory takes and makes --------------------------------------------


def check_kwargs(env_id: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """The config's `env.kwargs` bind to the factory's signature, or a ConfigError says which
    argument is unknown or missing and what the factory takes."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        takes = ", ".join(_show(p) for p in signature.parameters.values()
                          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) or "nothing"
        raise ConfigError(f"env.kwargs: {env_id} {_why(e, signature, kwargs)} "
                          f"(it takes: {takes})") from None


def _why(error: TypeError, signature: inspect.Signature, kwargs: dict[str, Any]) -> str:
    params = signature.parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        return f"does not take {', '.join(map(repr, unknown))}"
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        return f"needs {', '.join(map(repr, missing))} (no default; set env.kwargs.{missing[0]})"
    return f"cannot take these arguments ({error})"


def _show(param: inspect.Parameter) -> str:
    return param.name if param.default is param.empty else f"{param.name}={param.default!r}"


def protocol_problems(env: Any) -> list[str]:
    """What `env` lacks of the Env protocol, in words (empty: it is an environment)."""
    if env is None:
        return ["it returned None (a factory function must return the environment)"]
    problems = []
    for method, arg, shape in (("reset", None, "reset(seed) -> (observation, info)"),
                               ("step", "", "step(action) -> (observation, reward, terminated, "
                                            "truncated, info)")):
        function = getattr(env, method, None)
        if not callable(function):
            problems.append(f"it has no {shape}")
        elif not _accepts_one(function, arg):
            problems.append(f"its {method} cannot be called as {shape.split(' ->')[0]}")
    for method in ("areset", "astep"):
        function = getattr(env, method, None)
        if function is not None and not inspect.iscoroutinefunction(function):
            problems.append(f"its {method} is not an `async def` (define it async, or drop it "
                            f"and reroll runs {method[1:]} in a thread)")
    return problems


def _accepts_one(function: Callable, arg: Any) -> bool:
    try:
        inspect.signature(function).bind(arg)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect
        return True
    return True


def check_protocol(env_id: str, env: Any) -> None:
    problems = protocol_problems(env)
    if problems:
        made = type(env).__name__
        raise ConfigError(f"env.id {env_id!r}: what it builds ({made}) is not an environment: "
                          f"{'; '.join(problems)}; {PROTOCOL_HINT}")

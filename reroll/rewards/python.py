"""Reward functions passed as Python objects (`reward.type: python`, `reroll.train(...,
reward_funcs=[...], reward_weights=[...])`): each one a `CustomRewardFn` (sync functions in worker
processes, async ones on an event loop thread), their scores summed with weights.

The contract of one function: `fn(sample: RewardSample) -> float | RewardResult`, sync or
`async def`; `sample` has `prompt`, `response`, `answer`, `finish_reason` and `metadata` (the
dataset row's other columns).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.custom import CustomRewardFn, resolve

PYTHON_ONLY = "was passed as a Python object to reroll.train"


def object_name(fn: Callable) -> str:
    """`module:qualname` of a function or class; `module:Class()` for a callable instance (its
    name does not rebuild it). What the run's config.yaml records for an object."""
    if inspect.isfunction(fn) or inspect.isclass(fn) or inspect.ismethod(fn) \
            or inspect.isbuiltin(fn):
        return f"{fn.__module__}:{fn.__qualname__}"
    kind = type(fn)
    return f"{kind.__module__}:{kind.__qualname__}()"


def importable(name: str) -> bool:
    """Whether `module:qualname` can rebuild the object in another process (the CLI)."""
    module, _, qualname = name.partition(":")
    return module != "__main__" and "<" not in qualname and not qualname.endswith("()")


def check_signature(fn: Callable, where: str) -> None:
    """A reward function takes one argument, the sample; anything else is refused at start
    (TRL's batched `(prompts, completions, **kwargs)` included, with what to write instead)."""
    if not callable(fn):
        raise ConfigError(f"{where}: {fn!r} is not callable; a reward function is "
                          f"fn(sample) -> float | RewardResult")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call will tell
    try:
        signature.bind(RewardSample("", ""))
    except TypeError:
        hint = (" (TRL's batched signature: reroll calls the function once per completion, "
                "fn(sample) with sample.prompt, sample.response, sample.answer, "
                "sample.metadata)") if "completions" in signature.parameters else ""
        raise ConfigError(f"{where}: {object_name(fn)}{signature} must take one argument, the "
                          f"sample: fn(sample) -> float | RewardResult{hint}") from None


class WeightedRewardFn:
    """The weighted sum of several reward functions' scores; `info` carries each one's score
    (`rewards`) and the functions' own info (merged, later functions winning on a clash)."""

    times_itself = True
    """Each part bounds its own calls (`CustomRewardFn`)."""

    def __init__(self, parts: list[CustomRewardFn], weights: list[float]):
        self.parts, self.weights = parts, weights
        self.name = " + ".join(f"{w:g}*{p.name}" for p, w in zip(parts, weights, strict=True))

    async def __call__(self, sample: RewardSample) -> RewardResult:
        results = await asyncio.gather(*(part(sample) for part in self.parts))
        info: dict = {}
        for result in results:
            info |= result.info
        info["rewards"] = {part.name: r.score for part, r in zip(self.parts, results, strict=True)}
        return RewardResult(sum(w * r.score for w, r in zip(self.weights, results, strict=True)), info)

    def queue_metrics(self) -> dict[str, float]:
        """The longest wait for a free worker among the parts, per metric."""
        merged: dict[str, float] = {}
        for part in self.parts:
            for key, value in getattr(part, "queue_metrics", dict)().items():
                merged[key] = max(merged.get(key, value), value)
        return merged

    def close(self) -> None:
        for part in self.parts:
            part.close()


def python_reward(config, functions: list[Callable]) -> RewardFn:
    """The RewardFn of a `reward.type: python` section with its functions (objects, in the
    order of `config.functions`)."""
    memory = config.memory_mb << 20 if config.memory_mb else None
    parts = [CustomRewardFn(fn, config.timeout_s, config.num_workers, memory, name=name)
             for fn, name in zip(functions, config.functions, strict=True)]
    weights = config.weights or [1.0] * len(parts)
    if len(parts) == 1 and weights[0] == 1.0:
        return parts[0]
    return WeightedRewardFn(parts, weights)


def resolve_recorded(config) -> list[Callable]:
    """The functions a `reward.type: python` section names, imported (a config read from a run
    directory by the CLI); a name that cannot rebuild its object is one clear error."""
    functions = []
    for i, name in enumerate(config.functions):
        field = f"reward.functions[{i}]"
        if not importable(name):
            raise ConfigError(f"{field}: {name} {PYTHON_ONLY} and cannot be imported by name; "
                              f"run (or resume) this config from Python with the same functions: "
                              f"reroll.train(config, reward_funcs=[...]) (docs/python-api.md)")
        fn = resolve(name, field)
        check_signature(fn, field)
        functions.append(fn)
    return functions

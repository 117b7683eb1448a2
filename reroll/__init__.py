"""reroll: RL post-training of language models.

The Python API (docs/python-api.md) is importable from here: `reroll.train`, `reroll.sft`,
`reroll.Trainer`, `reroll.load_config`, `reroll.make_config`, `reroll.RunSummary`, and the reward
contract's `reroll.RewardSample` / `reroll.RewardResult`. They load on first use, so `import
reroll` (and the CLI's start) stays cheap.
"""

__version__ = "0.1.0"

_API = {"train", "sft", "Trainer", "load_config", "make_config", "RunSummary"}
_REWARDS = {"RewardSample", "RewardResult"}
__all__ = sorted(_API | _REWARDS | {"ConfigError", "RunStopped", "__version__"})


def __getattr__(name: str):
    if name in _API:
        from reroll import api

        return getattr(api, name)
    if name in _REWARDS:
        from reroll.rewards import base

        return getattr(base, name)
    if name in ("ConfigError", "RunStopped"):
        from reroll.config import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'reroll' has no attribute {name!r}")

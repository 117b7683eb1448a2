"""SFT warm-start data from the scripted experts: one chat row per expert turn.

Each row's `messages` is the episode so far (observations as user messages, earlier actions as
assistant messages) ending with the expert's next action, the format `reroll sft` trains on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.envs.registry import make_env


def expert_rows(env_id: str, episodes: int, seed: int = 0, kwargs: dict[str, Any] | None = None,
                system_prompt: str | None = None, max_turns: int = 50,
                successful_only: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for k in range(episodes):
        env = make_env(env_id, **(kwargs or {}))
        if not hasattr(env, "expert_action"):
            raise ConfigError(f"--env {env_id}: this environment has no scripted expert")
        obs, _ = env.reset(seed + k)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": obs})
        episode_rows, success = [], False
        for _ in range(max_turns):
            action = env.expert_action()
            episode_rows.append({"messages": messages + [{"role": "assistant", "content": action}],
                                 "env": env_id, "env_seed": seed + k})
            obs, _, terminated, truncated, info = env.step(action)
            messages = messages + [{"role": "assistant", "content": action},
                                   {"role": "user", "content": obs}]
            if terminated or truncated:
                success = bool(info.get("success", False))
                break
        if success or not successful_only:
            rows += episode_rows
    return rows


def write_expert_rows(out: str | Path, rows: list[dict[str, Any]]) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return out

"""SFT warm-start data from the scripted experts: one chat row per expert turn.

Each row's `messages` is the episode so far (observations as user messages, earlier actions as
assistant messages) ending with the expert's next action, the format `reroll sft` trains on.
An environment with tools gives one row per episode instead: its tool calls and results as
OpenAI-style messages, its tool schemas as `tools` (SFT trains every assistant turn).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.envs.registry import make_env
from reroll.tools.execute import run_calls
from reroll.tools.parsers import parse_tool_calls
from reroll.tools.schema import as_tools


def expert_rows(env_id: str, episodes: int, seed: int = 0, kwargs: dict[str, Any] | None = None,
                system_prompt: str | None = None, max_turns: int = 50,
                successful_only: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for k in range(episodes):
        env = make_env(env_id, **(kwargs or {}))
        if not hasattr(env, "expert_action"):
            raise ConfigError(f"--env {env_id}: this environment has no scripted expert")
        tools = as_tools(getattr(env, "tools", None))
        episode_rows, success = _expert_episode(env, env_id, seed + k, tools, system_prompt,
                                                max_turns)
        if success or not successful_only:
            rows += episode_rows
    return rows


def _expert_episode(env: Any, env_id: str, seed: int, tools: list, system_prompt: str | None,
                    max_turns: int) -> tuple[list[dict[str, Any]], bool]:
    """The rows of one expert episode and whether it succeeded. An env with tools gives one
    row, the whole episode (its tool calls as `tool_calls`, their results as `tool` messages,
    the schemas as `tools`: SFT trains every assistant turn of it); others one row per turn."""
    obs, _ = env.reset(seed)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": obs})
    rows, success = [], False
    for _ in range(max_turns):
        action = env.expert_action()
        parsed = parse_tool_calls(action, "hermes") if tools else None
        if parsed is not None and parsed.calls:
            results = asyncio.run(run_calls(parsed.calls, tools, timeout_s=30.0))
            messages = messages + [{"role": "assistant", "content": parsed.content,
                                    "tool_calls": [c.openai() for c in parsed.calls]},
                                   *(r.message() for r in results)]
            continue
        if not tools:
            rows.append({"messages": messages + [{"role": "assistant", "content": action}],
                         "env": env_id, "env_seed": seed})
        obs, _, terminated, truncated, info = env.step(action)
        messages = messages + [{"role": "assistant", "content": action}]
        if terminated or truncated:
            success = bool(info.get("success", False))
            break
        messages.append({"role": "user", "content": obs})
    if tools:
        rows.append({"messages": messages, "tools": [t.schema for t in tools], "env": env_id,
                     "env_seed": seed})
    return rows, success


def write_expert_rows(out: str | Path, rows: list[dict[str, Any]]) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return out

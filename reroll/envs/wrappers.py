"""Wrappers around any Env: a turn limit, episode statistics, and the formatting of observations
as chat-template tokens (so the agent loop appends them without re-tokenising history)."""

from __future__ import annotations

import time
from typing import Any

from reroll.envs.base import reset_async, step_async
from reroll.tools.render import render_messages, supports_tools


class _Wrapper:
    """Forwards everything (sync and async calls, `expert_action`, attributes) to `env`."""

    def __init__(self, env: Any):
        self.env = env

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self.after_step(self.env.step(action))

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.before_reset()
        return await reset_async(self.env, seed)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self.after_step(await step_async(self.env, action))

    def before_reset(self) -> None:
        pass

    def after_step(self, result):
        return result

    def __getattr__(self, name: str) -> Any:
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


class MaxTurns(_Wrapper):
    """End the episode (truncated) after `max_turns` steps, whatever the env says."""

    def __init__(self, env: Any, max_turns: int):
        super().__init__(env)
        self.max_turns, self.turns = max_turns, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.before_reset()
        return self.env.reset(seed)

    def before_reset(self) -> None:
        self.turns = 0

    def after_step(self, result):
        obs, reward, terminated, truncated, info = result
        self.turns += 1
        return obs, reward, terminated, truncated or self.turns >= self.max_turns, info


class EpisodeStats(_Wrapper):
    """Adds `episode` = {return, turns, success, seconds} to the info of the last step."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.before_reset()
        return self.env.reset(seed)

    def before_reset(self) -> None:
        self.total, self.turns, self.started = 0.0, 0, time.perf_counter()

    def after_step(self, result):
        obs, reward, terminated, truncated, info = result
        self.total += reward
        self.turns += 1
        if terminated or truncated:
            info = {**info, "episode": {"return": self.total, "turns": self.turns,
                                        "success": bool(info.get("success", False)),
                                        "seconds": time.perf_counter() - self.started}}
        return obs, reward, terminated, truncated, info


class ChatFormat:
    """Observations as the tokens the chat template puts between two assistant turns.

    After the model's turn (which ended with a stop token, or was cut off by a length limit) the
    env's text becomes: the rest of the template's end-of-assistant markup, a user message with
    the observation, and the header of the next assistant turn. Only these new tokens are
    encoded; the history's tokens are never re-encoded, so the trainer sees exactly the tokens
    the engine consumed and produced.
    """

    PLACEHOLDER = "\x00reroll-turn\x00"

    def __init__(self, tokenizer, system_prompt: str | None = None,
                 tools: list[dict[str, Any]] | None = None, tool_parser: str = "hermes",
                 native_tools: bool | None = None):
        """`tools`: the env's tool schemas, rendered in every prompt (`reroll.tools.render`:
        by the template where it renders tools, else the fallback block for `tool_parser`)."""
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.tools, self.tool_parser = list(tools or []), tool_parser
        self.native_tools = native_tools
        if self.tools and native_tools is None:
            self.native_tools = supports_tools(tokenizer)
        head = self._messages("first")
        closed = self._render(head + [{"role": "assistant", "content": self.PLACEHOLDER}], False)
        self.turn_end = closed[closed.index(self.PLACEHOLDER) + len(self.PLACEHOLDER):]
        """The template's markup after an assistant message's content (e.g. `<|im_end|>\\n`)."""

    THOUGHT = "<think>\nweighing the options\n</think>\n\nmy answer"

    def history_mismatch(self) -> str | None:
        """Why this template renders a finished assistant turn otherwise than the loop records it,
        or None. The loop keeps the model's text verbatim in later turns' contexts; a template
        that rewrites history (Qwen3's drops earlier turns' `<think>` blocks) shows a
        template-based server's model different contexts than the ones trained on. Probed with a
        turn that holds a think block (the placeholder of `observation_ids` has none, so its
        check cannot see this)."""
        head = self._messages("first")
        turn = head + [{"role": "assistant", "content": self.THOUGHT}]
        template = self._render(turn + [{"role": "user", "content": "second"}], True)
        before = self._render(head + [{"role": "assistant", "content": self.PLACEHOLDER}], False)
        after = self._render(head + [{"role": "assistant", "content": self.PLACEHOLDER},
                                     {"role": "user", "content": "second"}], True)
        loop = (self._render(head, True) + self.THOUGHT + self.turn_end
                + after[len(before):])
        if template == loop:
            return None
        dropped = "</think>" in loop and "</think>" not in template
        return ("the chat template renders an earlier assistant turn differently from what the "
                "model wrote" + (" (it drops the turn's <think>...</think> block, as Qwen3's "
                                 "does)" if dropped else "")
                + f": template {template!r} vs agent loop {loop!r}")

    def messages_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's own rendering of a conversation, up to the next assistant header."""
        return self._encode(self._render(messages, True))

    def first_messages(self, first_obs: str) -> list[dict[str, str]]:
        """The episode's conversation before the model's first turn."""
        return self._messages(first_obs)

    def _messages(self, first_obs: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": first_obs}]

    def with_tools(self, tools: list[dict[str, Any]], tool_parser: str) -> ChatFormat:
        """This format for an env offering `tools` (schemas); the template probed once."""
        if self.native_tools is None:
            self.native_tools = supports_tools(self.tokenizer)
        return ChatFormat(self.tokenizer, self.system_prompt, tools, tool_parser,
                          self.native_tools)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return render_messages(self.tokenizer, messages, self.tools, self.tool_parser,
                               generation_prompt, self.native_tools)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, first_obs: str) -> list[int]:
        """The episode's first prompt: (system,) the first observation, the assistant header."""
        return self._encode(self._render(self._messages(first_obs), True))

    def observation_ids(self, obs: str, stopped_with: str | None) -> list[int]:
        """Tokens that close the model's turn and present `obs`. `stopped_with` is the decoded stop
        token the model ended with (part of the template's turn end), None after a length cut."""
        return self.reply_ids([{"role": "user", "content": obs}], stopped_with)

    def reply_ids(self, messages: list[dict[str, Any]], stopped_with: str | None) -> list[int]:
        """Tokens that close the model's turn and present `messages` (a user observation, or
        the `tool` messages of its calls' results) up to the next assistant header."""
        closing = self.turn_end
        if stopped_with and closing.startswith(stopped_with):
            closing = closing[len(stopped_with):]
        before = self._messages("first") + [{"role": "assistant", "content": self.PLACEHOLDER}]
        after = self._render(before + messages, True)
        rendered = self._render(before, False)
        if not after.startswith(rendered):
            raise ValueError("the chat template renders a conversation differently once a message "
                             "is added; it cannot be extended turn by turn")
        return self._encode(closing + after[len(rendered):])

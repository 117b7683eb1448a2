"""Native tool calls in the agent loop: the env's tools are rendered by the chat template (the
Qwen3-style template on Qwen's vocabulary), the model's calls parsed, run and answered with
`tool` messages in the template's tokens; malformed calls, unknown tools and tools that raise
are answered with an error message and counted, and the episode goes on."""

from __future__ import annotations

import json
import re

import pytest

from reroll.engines.base import Completion, SamplingParams
from reroll.envs import make_env
from reroll.rollout.agent_loop import AgentJob, run_episodes
from reroll.tools import render_messages

pytestmark = pytest.mark.unit

GOOD, MALFORMED, UNKNOWN, SEVERAL = range(4)


def _call(name: str, expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"expression": expression}}) \
        + "\n</tool_call>"


class ToolUsingEngine:
    """Writes, in real tokens ending with the stop token: first a tool call (which kind depends
    on the question: good, malformed JSON, an unknown tool, or two calls of which one raises),
    then `\\boxed{R}` with R the first tool result it was shown (0 if it was an error)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.log = tokenizer, 0, []

    async def generate(self, request):
        prompt = self.tokenizer.decode(request.prompt_ids)
        expression = re.findall(r"What is (\d+ \* \d+ \+ \d+)\?", prompt)[-1]
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
        mode = int(expression.split()[0]) % 4
        if results:
            text = f"The answer is \\boxed{{{results[0] if results[0].isdigit() else 0}}}."
        elif mode == GOOD:
            text = _call("calculator", expression)
        elif mode == MALFORMED:
            text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>'
        elif mode == UNKNOWN:
            text = _call("abacus", expression)
        else:
            text = _call("calculator", expression) + "\n" + _call("calculator", "1 / 0")
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.log.append((list(request.prompt_ids), ids, mode))
        return Completion(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "stop",
                          self.version)

    def abort(self, request_id):
        pass


def _episodes(tokenizer, seeds):
    engine = ToolUsingEngine(tokenizer)
    params = SamplingParams(200, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: make_env("calculator", max_turns=4), params,
                   max_turns=4, max_context_tokens=4096)
    trajectories, stats = run_episodes(job, seeds, 1, run_seed=0, step=1)
    return engine, trajectories, stats


def _modes(seeds):
    env = make_env("calculator")
    return [int(env.reset(s)[0].split()[2]) % 4 for s in seeds]


def test_tool_calls_are_run_and_failures_answered_and_counted(qwen_tokenizer):
    seeds = list(range(12))
    modes = _modes(seeds)
    assert set(modes) == {GOOD, MALFORMED, UNKNOWN, SEVERAL}
    engine, trajectories, stats = _episodes(qwen_tokenizer, seeds)
    assert stats.env_errors == 0 and len(trajectories) == len(seeds)
    for mode, t in zip(modes, trajectories, strict=True):
        assert t.reward_info["success"] == (mode in (GOOD, SEVERAL)), (mode, t.response_text)
        assert t.reward_info["turns"] == 2 and t.turn_rewards[0] == 0.0
    assert stats.tool_calls == sum({GOOD: 1, UNKNOWN: 1, SEVERAL: 2}.get(m, 0) for m in modes)
    assert stats.tool_parse_errors == modes.count(MALFORMED)
    assert stats.tool_errors == modes.count(UNKNOWN) + modes.count(SEVERAL)
    metrics = stats.metrics()
    assert metrics["env/tool_parse_errors"] == modes.count(MALFORMED) > 0
    assert metrics["env/tool_errors"] == modes.count(UNKNOWN) + modes.count(SEVERAL) > 0
    texts = {m: t.response_text for m, t in zip(modes, trajectories, strict=True)}
    assert "error: invalid JSON in a tool call" in texts[MALFORMED]
    assert "error: unknown tool 'abacus' (tools: calculator)" in texts[UNKNOWN]
    assert "error: calculator raised ValueError: division by zero" in texts[SEVERAL]


def test_episode_tokens_are_the_requests_and_the_templates_rendering(qwen_tokenizer):
    """Token in, token out: each request is exactly the episode's tokens so far, and the whole
    episode decodes to the template's own rendering of the conversation (tools in the system
    block, the call, the `tool` message, the answer)."""
    tok = qwen_tokenizer
    seeds = [s for s, m in zip(range(12), _modes(range(12)), strict=True) if m == GOOD][:2]
    engine, trajectories, _ = _episodes(tok, seeds)
    env = make_env("calculator")
    for seed, t in zip(seeds, trajectories, strict=True):
        ids = t.prompt_ids + t.response_ids
        requests = [p for p, _, _ in engine.log if ids[: len(p)] == p]
        assert len(requests) == 2 and requests[0] == t.prompt_ids
        question, _ = env.reset(seed)
        call, answer = env.expert_action(), env.expert_action()
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [{
                        "id": "call_0", "type": "function", "function": {
                            "name": "calculator",
                            "arguments": {"expression": env.expression}}}]},
                    {"role": "tool", "tool_call_id": "call_0", "content": str(env.answer)},
                    {"role": "assistant", "content": answer}]
        assert call.startswith("<tool_call>")
        rendered = render_messages(tok, messages, env.tools, add_generation_prompt=False)
        assert rendered == tok.decode(ids) + "\n"
        policy = [i for i, flag in enumerate(t.policy_mask) if flag]
        assert tok.decode([t.response_ids[i] for i in policy]).count("<|im_end|>") == 2

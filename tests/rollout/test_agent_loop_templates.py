"""The agent loop with real chat templates and vocabularies: SmolLM2's (49,152 tokens, ChatML
with a default system message) and a Qwen3-style template on Qwen's 151,669-token vocabulary.

The engine writes real text in the tokenizer's vocabulary (reasoning in `<think>` blocks, a
guess, the stop token; some turns cut short by a length limit), so the checks are the ones of
test_agent_loop.py: every request is exactly the episode's tokens so far, and the decoded
episode is the chat template's rendering of the conversation. Qwen3's template drops earlier
turns' reasoning: `history_mismatch` detects it, `keep` trains on the tokens as generated, and
`strip` gives one sample per turn whose prompt is the template's own rendering."""

from __future__ import annotations

import random

import pytest

from reroll.engines.base import Completion, SamplingParams
from reroll.envs import ChatFormat, make_env
from reroll.rollout.agent_loop import AgentJob, run_episodes


class WritingEngine:
    """Writes `<think>\\nmaybe G\\n</think>\\n\\nG` (or just `G`) in real tokens and stops with the
    tokenizer's stop token; one turn in four is cut after a few tokens (finish `length`)."""

    def __init__(self, tokenizer, think: bool):
        self.tokenizer, self.think, self.version, self.log = tokenizer, think, 0, []

    async def generate(self, request):
        rng = random.Random(request.seed)
        guess = rng.randint(1, 8)
        text = f"<think>\nmaybe {guess}\n</think>\n\n{guess}" if self.think else f"{guess}"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if rng.random() < 0.25:
            ids, finish = ids[:3], "length"
        else:
            ids, finish = ids + [self.tokenizer.eos_token_id], "stop"
        self.log.append((list(request.prompt_ids), ids))
        return Completion(request.request_id, request.prompt_ids, ids, [-0.25] * len(ids),
                          finish, self.version)

    def abort(self, request_id):
        pass


def _run(tokenizer, think: bool, history: str = "keep", system_prompt: str | None = None,
         one_sample: bool = False, with_stats: bool = False):
    engine = WritingEngine(tokenizer, think)
    params = SamplingParams(24, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: make_env("guess_number", high=8, max_turns=4),
                   params, max_context_tokens=2048, system_prompt=system_prompt,
                   history_thinking=history, one_sample=one_sample)
    trajectories, stats = run_episodes(job, [1, 2, 3], 3, run_seed=0, step=1)
    assert stats.env_errors == 0
    return (engine, trajectories, stats) if with_stats else (engine, trajectories)


def _conversation(tokenizer, env_seed: int, turns: list[list[int]], system_prompt=None):
    """The episode's messages, replayed: the same env seed and actions give the same
    observations (the final observation is not part of the episode)."""
    env = make_env("guess_number", high=8, max_turns=4)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": env.reset(env_seed)[0]})
    for tokens in turns:
        content = tokens[:-1] if tokens[-1] == tokenizer.eos_token_id else tokens
        messages.append({"role": "assistant", "content": tokenizer.decode(content)})
        obs, *_ = env.step(tokenizer.decode(tokens, skip_special_tokens=True))
        messages.append({"role": "user", "content": obs})
    return messages[:-1]


def _policy_spans(t):
    spans, start = [], None
    for j, flag in enumerate(t.policy_mask + [0]):
        if flag and start is None:
            start = j
        if not flag and start is not None:
            spans.append((start, j))
            start = None
    return spans


def _check_keep(tokenizer, engine, trajectories, system_prompt=None):
    """Token in/token out, and the decoded episode is the template's rendering."""
    requests = {}
    for prompt, ids in engine.log:
        requests.setdefault(tuple(prompt), []).append(ids)
    assert len(trajectories) == 9
    for t in trajectories:
        ids = t.prompt_ids + t.response_ids
        spans = _policy_spans(t)
        assert len(spans) == t.reward_info["turns"] >= 1
        for a, b in spans:
            at = len(t.prompt_ids) + a
            assert ids[at : len(t.prompt_ids) + b] in requests[tuple(ids[:at])]
        turns = [t.response_ids[a:b] for a, b in spans]
        messages = _conversation(tokenizer, t.reward_info["env_seed"], turns, system_prompt)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        decoded = tokenizer.decode(ids)
        assert rendered.startswith(decoded), (rendered, decoded)
        assert len(rendered) - len(decoded) <= len(ChatFormat(tokenizer, system_prompt).turn_end)


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("system_prompt", [None, "Play well."])
def test_smollm2_template_loop_tokens_equal_the_template(smollm2_tokenizer, think, system_prompt):
    tok = smollm2_tokenizer
    assert len(tok) == 49_152 and "You are a helpful AI assistant named SmolLM" in \
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert ChatFormat(tok, system_prompt).history_mismatch() is None  # history kept verbatim
    engine, trajectories = _run(tok, think, system_prompt=system_prompt)
    _check_keep(tok, engine, trajectories, system_prompt)


def test_qwen3_template_without_thinking_loop_tokens_equal_the_template(qwen_tokenizer):
    engine, trajectories = _run(qwen_tokenizer, think=False)
    assert trajectories and all(t.response_ids for t in trajectories)
    _check_keep(qwen_tokenizer, engine, trajectories)


def test_qwen3_template_dropping_thinking_is_detected(qwen_tokenizer, tokenizer):
    problem = ChatFormat(qwen_tokenizer).history_mismatch()
    assert problem is not None and "drops the turn's <think>...</think> block" in problem
    assert ChatFormat(qwen_tokenizer, "sys").history_mismatch() is not None
    assert ChatFormat(tokenizer).history_mismatch() is None  # the tiny model's ChatML
    # What the detection is about: with thinking, `keep` episodes are not the template's view.
    _, trajectories = _run(qwen_tokenizer, think=True)
    multi = [t for t in trajectories if len(_policy_spans(t)) > 1]
    assert multi
    for t in multi:
        turns = [t.response_ids[a:b] for a, b in _policy_spans(t)]
        messages = _conversation(qwen_tokenizer, t.reward_info["env_seed"], turns)
        rendered = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
        assert not rendered.startswith(qwen_tokenizer.decode(t.prompt_ids + t.response_ids))


def test_qwen3_keep_trains_on_the_tokens_as_generated(qwen_tokenizer):
    """`keep`: every request is the episode's tokens so far, earlier reasoning included."""
    engine, trajectories = _run(qwen_tokenizer, think=True, history="keep")
    requests = {tuple(prompt) for prompt, _ in engine.log}
    kept_thinking = 0
    for t in trajectories:
        ids = t.prompt_ids + t.response_ids
        for a, _ in _policy_spans(t):
            context = ids[: len(t.prompt_ids) + a]
            assert tuple(context) in requests
            kept_thinking += "</think>" in qwen_tokenizer.decode(context)
    assert kept_thinking > 0


def test_qwen3_strip_one_sample_per_turn_with_the_templates_context(qwen_tokenizer):
    """`strip`: each turn is a sample whose prompt is exactly its request, which is the
    template's rendering of the conversation so far (earlier reasoning dropped)."""
    tok = qwen_tokenizer
    engine, samples = _run(tok, think=True, history="strip")
    pairs = sorted((s.prompt_ids, s.response_ids) for s in samples)
    assert pairs == sorted(engine.log)  # token in, token out, per sample
    episodes = []  # an episode's samples are contiguous, from turn 0 on
    for s in samples:
        if s.reward_info["turn"] == 0:
            episodes.append([])
        episodes[-1].append(s)
    assert len(episodes) == 9 and any(len(e) > 1 for e in episodes)
    for episode in episodes:
        assert [s.reward_info["turn"] for s in episode] == list(range(len(episode)))
        assert episode[0].reward_info["turns"] == len(episode)
        assert len({(s.reward, s.group_id) for s in episode}) == 1
        turns = [s.response_ids for s in episode]
        for k, s in enumerate(episode):
            assert s.policy_mask == [1] * len(s.response_ids)
            assert s.behaviour_logprobs == [-0.25] * len(s.response_ids)
            messages = _conversation(tok, s.reward_info["env_seed"], turns[:k] + [[0]])[:-1]
            template = tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
            assert tok.decode(s.prompt_ids) == template
            # Finished reasoning is gone (a turn cut inside its think block has no </think>
            # and stays verbatim, as with Qwen3's template).
            assert "</think>" not in template
        if len(episode) > 1 and episode[0].finish_reason and "</think>" in tok.decode(turns[0]):
            assert "maybe" not in tok.decode(episode[1].prompt_ids)


def test_training_start_check_asks_to_choose(qwen_tokenizer, smollm2_tokenizer):
    """The agentic pipeline's start-up check: a template that drops reasoning needs an explicit
    `env.history_thinking`; templates that keep history verbatim need nothing."""
    from reroll.config.errors import ConfigError
    from reroll.pipelines.agentic import check_history

    with pytest.raises(ConfigError, match=r"env.history_thinking: .*<think>.*keep"):
        check_history(qwen_tokenizer, None, None)
    check_history(qwen_tokenizer, None, "keep")
    check_history(smollm2_tokenizer, "Play well.", None)
    check_history(qwen_tokenizer, None, "strip")  # trains its last chain (test below)


def test_qwen3_strip_in_training_trains_each_episodes_last_chain(qwen_tokenizer):
    """`strip` in the RL pipeline (`one_sample`): one sample per episode, the group's size
    kept; its tokens are the engine's own: the last chain's first request, then each later
    turn's completion and the template's tokens up to the next request. With Qwen3's template
    every turn after reasoning starts a new chain; the earlier ones are counted."""
    tok = qwen_tokenizer
    engine, samples, stats = _run(tok, think=True, history="strip", one_sample=True,
                                  with_stats=True)
    assert len(samples) == 9  # 3 env seeds x 3 episodes
    requests = {}
    for prompt, ids in engine.log:
        requests.setdefault(tuple(prompt), []).append(ids)
    chained = 0
    for t in samples:
        ids = t.prompt_ids + t.response_ids
        assert tuple(t.prompt_ids) in requests  # the chain starts at a real request
        for a, b in _policy_spans(t):
            at = len(t.prompt_ids) + a
            assert ids[at : len(t.prompt_ids) + b] in requests[tuple(ids[:at])]
        chain = t.reward_info.get("chain")
        if chain is not None:
            chained += 1
            assert chain["calls"][-1] == t.reward_info["turns"] - 1  # the episode's last turn
            assert "</think>" not in tok.decode(t.prompt_ids)  # the template's own context
    assert chained > 0 and stats.chains_dropped > 0
    assert stats.metrics()["env/chains_dropped"] == stats.chains_dropped

"""The agent loop: the trainer's tokens are exactly what the engine consumed and produced (for
several chat templates), env tokens are masked out, failures stay inside their episode."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from reroll.data.batch import collate
from reroll.engines.base import Completion, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.envs import ChatFormat, make_env
from reroll.models.loading import load_model
from reroll.rewards.base import RewardResult
from reroll.rewards.runner import RewardRunner
from reroll.rollout.agent_loop import AgentJob, EpisodeReward, run_episodes

LLAMA3_STYLE = (
    "{{ '<|endoftext|>' }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '<|im_start|>\\n\\n' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_start|>\\n\\n' }}"
    "{% endif %}")
MISTRAL_STYLE = (
    "{{ '<|endoftext|>' }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
    "{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}")


class RecordingEngine:
    """The real HF engine, with a log of every request's tokens and completion."""

    def __init__(self, engine: HFEngine):
        self.engine, self.log = engine, []
        self.version = 0

    async def generate(self, request):
        completion = await self.engine.generate(request)
        self.log.append((list(request.prompt_ids), completion))
        return completion

    def abort(self, request_id):
        self.engine.abort(request_id)


@pytest.fixture(scope="module")
def hf_engine(tiny_model, tokenizer):
    torch.set_num_threads(1)
    return HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)


def _job(engine, tokenizer, make=None, max_new=6, **kw):
    params = SamplingParams(max_new, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    make = make or (lambda: make_env("guess_number", high=8, max_turns=4))
    return AgentJob(engine, tokenizer, make, params, **kw)


@pytest.mark.parametrize("template", ["chatml", "llama3", "mistral"])
def test_trainer_tokens_equal_engine_tokens(hf_engine, tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    if template != "chatml":
        tok.chat_template = LLAMA3_STYLE if template == "llama3" else MISTRAL_STYLE
    engine = RecordingEngine(hf_engine)
    trajectories, stats = run_episodes(_job(engine, tok, max_context_tokens=400), [1, 2], 3,
                                       run_seed=0, step=1)
    assert stats.env_errors == 0 and len(trajectories) == 6
    by_prefix = {}  # episodes of a group share their first prompt
    for prompt, completion in engine.log:
        by_prefix.setdefault(tuple(prompt), []).append(completion)
    batch, _ = collate(trajectories, tok.pad_token_id)
    for i, t in enumerate(trajectories):
        ids = t.prompt_ids + t.response_ids
        # Walk the episode: every policy span is one engine completion, requested with exactly
        # the episode's tokens before it.
        spans, start = [], None
        for j, flag in enumerate(t.policy_mask + [0]):
            if flag and start is None:
                start = j
            if not flag and start is not None:
                spans.append((start, j))
                start = None
        assert len(spans) == t.reward_info["turns"] >= 1
        for turn, (a, b) in enumerate(spans):
            at = len(t.prompt_ids) + a
            produced = ids[at : len(t.prompt_ids) + b]
            matches = [c for c in by_prefix[tuple(ids[:at])] if c.token_ids == produced]
            assert matches, "no engine request had exactly these tokens and this completion"
            assert t.behaviour_logprobs[a:b] == matches[0].logprobs
            assert set(t.turn_ids[a:b]) == {turn}
        env_tokens = [j for j, flag in enumerate(t.policy_mask) if not flag]
        assert all(t.behaviour_logprobs[j] == 0.0 and t.turn_ids[j] == -1 for j in env_tokens)
        # The batch the trainer sees: the same ids, the policy mask as response_mask.
        n = len(ids)
        assert batch["input_ids"][i, :n].tolist() == ids
        assert batch["response_mask"][i, len(t.prompt_ids) : n].tolist() == t.policy_mask
        assert batch["response_mask"][i, : len(t.prompt_ids)].sum() == 0
        assert batch["turn_ids"][i, len(t.prompt_ids) : n].tolist() == t.turn_ids
        _check_matches_chat_template(tok, t, spans)


def _check_matches_chat_template(tok, t, spans):
    """Decoded, the episode is the chat template's rendering of its conversation (replayed: the
    same env seed and the model's actions give the same observations)."""
    env = make_env("guess_number", high=8, max_turns=4)
    messages = [{"role": "user", "content": env.reset(t.reward_info["env_seed"])[0]}]
    for a, b in spans:
        tokens = t.response_ids[a:b]
        content = tokens[:-1] if tokens[-1] == tok.eos_token_id else tokens
        messages.append({"role": "assistant", "content": tok.decode(content)})
        obs, *_ = env.step(tok.decode(tokens, skip_special_tokens=True))
        messages.append({"role": "user", "content": obs})
    rendered = tok.apply_chat_template(messages[:-1], tokenize=False)
    decoded = tok.decode(t.prompt_ids + t.response_ids)
    # All but the template's markup closing the final turn (the episode ends there).
    assert rendered.startswith(decoded), (rendered, decoded)
    assert len(rendered) - len(decoded) <= len(ChatFormat(tok).turn_end)


class BrokenEnv:
    def __init__(self, mode: str):
        self.mode = mode

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("env bug")
        if self.mode == "hang":
            time.sleep(5)
        if self.mode == "nan":
            return "again", float("nan"), False, False, {}
        return "again", float(self.mode == "paid"), False, False, {}


def test_env_that_raises_or_hangs_fails_only_its_episode(hf_engine, tokenizer):
    modes = iter(["raise", "hang", "ok", "ok"])
    job = _job(hf_engine, tokenizer, make=lambda: BrokenEnv(next(modes)), max_turns=2,
               step_timeout_s=0.5)
    trajectories, stats = run_episodes(job, [0], 4, run_seed=0, step=1)
    finishes = [t.finish_reason for t in trajectories]
    assert finishes.count("env_error") == 2 and stats.env_errors == 2
    broken = [t for t in trajectories if t.finish_reason == "env_error"]
    assert all(sum(t.policy_mask) == 0 and t.reward == 0.0 for t in broken)
    assert {"env bug" in e or "longer than" in e for e in stats.errors} == {True}
    healthy = [t for t in trajectories if t.finish_reason != "env_error"]
    assert all(t.reward_info["turns"] == 2 and sum(t.policy_mask) > 0 for t in healthy)


class WordCount:
    """A reward of the episode's text: its words, counted; fails on every third call."""

    name = "words"

    def __init__(self):
        self.samples = []

    async def __call__(self, sample):
        self.samples.append(sample)
        if len(self.samples) % 3 == 0:
            raise RuntimeError("reward bug")
        return RewardResult(float(len(sample.response.split())), {"words": True})


def test_a_learned_reward_scores_each_episode_into_its_return(hf_engine, tokenizer):
    words = WordCount()
    runner = RewardRunner(words, timeout_s=5.0)
    modes = iter(["raise"] + ["paid"] * 7)  # paid: 1.0 a turn
    job = _job(hf_engine, tokenizer, make=lambda: BrokenEnv(next(modes)), max_turns=2,
               episode_reward=EpisodeReward(runner, weight=0.5, env_weight=2.0))
    trajectories, _ = run_episodes(job, [0, 1], 4, run_seed=0, step=1)
    assert len(trajectories) == 8 and runner.counters.calls == 7  # the env's failure: no call
    by_response = {s.response: s for s in words.samples}
    for t in trajectories:
        learned, env_return = t.reward_info["learned_reward"], t.reward_info["env_return"]
        if t.finish_reason == "env_error":
            assert learned == {} and t.reward == 0.0
            continue
        sample = by_response[t.response_text]  # the whole episode after its first observation
        assert sample.prompt == t.prompt_text == "go"
        score = learned["score"]
        assert score == (0.0 if "error" in learned else len(t.response_text.split()))
        assert env_return == 2.0 and t.turn_rewards == pytest.approx([2.0, 2.0 + 0.5 * score])
        assert t.reward == pytest.approx(2.0 * env_return + 0.5 * score)
    assert runner.counters.errors == 2  # calls 3 and 6 failed, scored 0, counted


def test_env_with_a_non_finite_reward_fails_only_its_episode(hf_engine, tokenizer):
    modes = iter(["nan", "ok"])
    job = _job(hf_engine, tokenizer, make=lambda: BrokenEnv(next(modes)), max_turns=2)
    trajectories, stats = run_episodes(job, [0], 2, run_seed=0, step=1)
    assert [t.finish_reason == "env_error" for t in trajectories].count(True) == 1
    assert stats.env_errors == 1 and "non-finite reward" in stats.errors[0]
    assert all(t.reward == 0.0 for t in trajectories)

def test_context_limit_ends_the_episode_cleanly(hf_engine, tokenizer):
    job = _job(hf_engine, tokenizer, max_new=8, max_context_tokens=70, max_turns=10)
    trajectories, stats = run_episodes(job, [0, 1], 2, run_seed=0, step=1)
    for t in trajectories:
        assert len(t.prompt_ids) + len(t.response_ids) <= 70
        assert t.finish_reason in ("length", "stop", "truncated")
        assert t.policy_mask[-1] == 1  # never ends on dangling env tokens
    assert stats.context_limit >= 1


class EveryOtherReplyCutEngine:
    """Guesses 9 (never right in 1..8, so every episode plays all its turns); the first reply,
    and every other one after it, is cut at the token budget (finish `length`, no stop token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.finishes, self.version = tokenizer, [], 0

    async def generate(self, request):
        cut = len(self.finishes) % 2 == 0
        ids = self.tokenizer.encode("9", add_special_tokens=False)
        ids += [] if cut else [self.tokenizer.eos_token_id]
        self.finishes.append("length" if cut else "stop")
        return Completion(request.request_id, request.prompt_ids, ids, [-1.0] * len(ids),
                          self.finishes[-1], self.version)

    def abort(self, request_id):
        pass


def test_replies_cut_at_the_token_budget_are_counted(tokenizer):
    """A reply that hits `max_new_tokens` reaches the env unfinished; the episode goes on, so the
    episode's finish reason does not show it: `env/truncated_replies_frac` does (per reply)."""
    engine = EveryOtherReplyCutEngine(tokenizer)
    trajectories, stats = run_episodes(_job(engine, tokenizer, max_context_tokens=400), [0, 1],
                                       1, run_seed=0, step=1)
    assert len(engine.finishes) == 8  # 2 episodes x 4 turns
    assert {t.finish_reason for t in trajectories} == {"truncated"}  # out of turns, not cut
    metrics = stats.metrics()
    assert metrics["env/truncated_replies_frac"] == 0.5
    assert metrics["env/context_limit_frac"] == 0.0


class SlowFirstEnv:
    """Instances made first are slow: the redundant, faster ones should win."""

    made = 0

    def __init__(self):
        SlowFirstEnv.made += 1
        self.delay = 1.5 if SlowFirstEnv.made <= 2 else 0.0

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        time.sleep(self.delay)
        return "done", 1.0, True, False, {"success": True}


def test_redundant_envs_first_finishers_win(hf_engine, tokenizer):
    SlowFirstEnv.made = 0
    job = _job(hf_engine, tokenizer, make=SlowFirstEnv)
    t0 = time.perf_counter()
    trajectories, stats = run_episodes(job, [0], 2, run_seed=0, step=1, redundancy=2)
    assert len(trajectories) == 2 and stats.aborted == 2
    assert all(t.reward == 1.0 for t in trajectories)
    assert time.perf_counter() - t0 < 1.5 + 5  # did not wait for both slow ones in turn


def test_env_steps_overlap_generation(hf_engine, tokenizer):
    """Slow env steps run off the event loop: 8 concurrent episodes of 0.2 s steps take far less
    than 8 x their summed step time."""
    class Slow:
        def reset(self, seed=None):
            return "go", {}

        def step(self, action):
            time.sleep(0.2)
            return "more", 0.0, False, False, {}

    job = _job(hf_engine, tokenizer, make=Slow, max_turns=3)
    trajectories, stats = run_episodes(job, [0, 1], 4, run_seed=0, step=1)
    assert stats.turns == 24 and stats.env_seconds >= 24 * 0.2 * 0.9
    asyncio.run(asyncio.sleep(0))

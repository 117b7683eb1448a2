"""Context management in the agent loop (`env.context`): when an episode's history outgrows the
context, `drop_oldest`, `truncate` and a user hook rewrite it and the episode goes on. The
sample that trains is the episode's last token chain, exactly what the engine saw; each
policy's edit is checked on the requests the engine got."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.engines.base import Completion, SamplingParams
from reroll.envs import ChatFormat
from reroll.rollout.agent_loop import AgentJob, run_episodes
from reroll.rollout.context import ContextPolicy, cut, drop_oldest, truncate

SYSTEM = "You read logs."
TASK = "Find the failing service. Reply with one word per turn."


class LogEnv:
    """Every step answers with a long log excerpt; the episode only ends at its turn limit."""

    def __init__(self, max_turns: int = 12):
        self.max_turns = max_turns

    def reset(self, seed=None):
        self.turn, self.seed = 0, seed or 0
        return TASK, {}

    def step(self, action):
        self.turn += 1
        obs = f"step {self.turn}: " + " ".join(f"svc{(self.seed + i) % 7} ok" for i in range(4))
        return obs, 0.25, False, self.turn >= self.max_turns, {}


class WordEngine:
    """Replies `check N` and the stop token; logs every request and its completion."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.log = tokenizer, 0, []

    async def generate(self, request):
        n = len(self.log)
        ids = self.tokenizer.encode(f"check {n % 10}", add_special_tokens=False)
        ids = ids[: request.params.max_new_tokens - 1] + [self.tokenizer.eos_token_id]
        logprobs = [-0.1 - 0.01 * n] * len(ids)
        self.log.append((list(request.prompt_ids), ids, logprobs))
        return Completion(request.request_id, request.prompt_ids, ids, logprobs, "stop", 0)

    def abort(self, request_id):
        pass


def _run(tokenizer, policy: ContextPolicy, max_context: int = 260, max_turns: int = 12):
    engine = WordEngine(tokenizer)
    params = SamplingParams(8, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: LogEnv(max_turns), params, max_turns=max_turns,
                   max_context_tokens=max_context, system_prompt=SYSTEM, context=policy)
    trajectories, stats = run_episodes(job, [1, 2], 1, run_seed=0, step=1)
    assert stats.env_errors == 0, stats.errors
    return engine, trajectories, stats


def _check_faithful(engine, t):
    """The trained sample is the engine's tokens: it starts at a request, and every policy span
    is a completion (with its logprobs) of the request holding exactly the tokens before it."""
    by_prompt = {tuple(p): (ids, lp) for p, ids, lp in engine.log}
    assert tuple(t.prompt_ids) in by_prompt
    ids, p = t.prompt_ids + t.response_ids, len(t.prompt_ids)
    spans, start = [], None
    for j, flag in enumerate(t.policy_mask + [0]):
        if flag and start is None:
            start = j
        if not flag and start is not None:
            spans.append((start, j))
            start = None
    assert spans
    for a, b in spans:
        done, lp = by_prompt[tuple(ids[: p + a])]
        assert ids[p + a : p + b] == done and t.behaviour_logprobs[a:b] == lp
    env = [j for j, flag in enumerate(t.policy_mask) if not flag]
    assert all(t.behaviour_logprobs[j] == 0.0 and t.turn_ids[j] == -1 for j in env)
    return spans


def test_end_stops_the_episode_at_the_context(tokenizer):
    _, trajectories, stats = _run(tokenizer, ContextPolicy("end"))
    assert {t.finish_reason for t in trajectories} == {"length"}
    assert stats.context_edits == 0 and stats.chains_dropped == 0
    assert all(t.reward_info["turns"] < 12 for t in trajectories)


def test_drop_oldest_keeps_the_system_prompt_and_task_and_trains_the_last_chain(tokenizer):
    engine, trajectories, stats = _run(tokenizer, ContextPolicy("drop_oldest",
                                                                target_fraction=0.6))
    assert [t.reward_info["turns"] for t in trajectories] == [12, 12]  # past the context
    assert {t.finish_reason for t in trajectories} == {"truncated"}  # the turn limit
    assert stats.context_edits >= 2 and stats.chains_dropped == stats.context_edits
    assert all(len(p) + len(ids) <= 260 for p, ids, _ in engine.log)
    for prompt, _, _ in engine.log:  # every request, edited or not, starts with both
        text = tokenizer.decode(prompt)
        assert SYSTEM in text and TASK in text
    dropped = [p for p, _, _ in engine.log if "step 1:" not in tokenizer.decode(p)]
    assert len(dropped) > 2  # later requests lost the oldest observations
    for t in trajectories:
        spans = _check_faithful(engine, t)
        chain = t.reward_info["chain"]
        assert chain["calls"][-1] == 11 and len(chain["calls"]) == len(spans) > 1
        assert t.turn_ids[t.policy_mask.index(1)] == chain["calls"][0]  # the episode's turns
        assert t.turn_rewards == [0.25] * 12 and t.reward == 3.0  # the whole episode's return
        assert len(t.conversation["messages"]) == 2 + 2 * 12 - 1  # the full record


def test_truncate_caps_each_observation(tokenizer):
    engine, trajectories, stats = _run(tokenizer, ContextPolicy("truncate",
                                                                observation_tokens=6))
    assert stats.context_edits >= 1
    fmt = ChatFormat(tokenizer, SYSTEM)
    for t in trajectories:
        _check_faithful(engine, t)
        first = t.reward_info["chain"]["calls"][0]
        cut_messages = truncate(t.conversation["messages"][: 2 + 2 * first], tokenizer, 6)
        assert t.prompt_ids == fmt.messages_ids(cut_messages)  # the cut history, rendered
        assert "svc" not in tokenizer.decode(t.prompt_ids)  # each observation lost its tail
        for m in cut_messages[2:]:
            if m["role"] == "user":
                assert len(tokenizer.encode(m["content"], add_special_tokens=False)) <= 6


def test_a_hook_edits_what_the_engine_sees(tokenizer):
    seen = []

    def keep_last_two(messages):
        seen.append(len(messages))
        return messages[:2] + [{"role": "user", "content": "(earlier turns summarised)"}] \
            + messages[-2:]

    engine, trajectories, stats = _run(tokenizer, ContextPolicy("hook", hook=keep_last_two))
    assert seen and stats.context_edits == len(seen)
    summarised = [p for p, _, _ in engine.log if "summarised" in tokenizer.decode(p)]
    assert summarised
    assert [t.reward_info["turns"] for t in trajectories] == [12, 12]
    for t in trajectories:
        _check_faithful(engine, t)
        assert "summarised" in tokenizer.decode(t.prompt_ids)


def test_a_failing_hook_fails_only_its_episode(tokenizer):
    def broken(messages):
        raise RuntimeError("summariser down")

    engine = WordEngine(tokenizer)
    params = SamplingParams(8, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: LogEnv(12), params, max_turns=12,
                   max_context_tokens=260, context=ContextPolicy("hook", hook=broken))
    trajectories, stats = run_episodes(job, [1], 2, run_seed=0, step=1)
    assert stats.env_errors == 2 and "summariser down" in stats.errors[0]
    assert all(t.finish_reason == "env_error" and sum(t.policy_mask) == 0 for t in trajectories)


def test_drop_oldest_and_truncate_on_messages(tokenizer):
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    turns = []
    for k in range(4):
        turns += [{"role": "assistant", "content": f"a{k}"},
                  {"role": "tool", "content": f"r{k}"}, {"role": "user", "content": f"o{k}"}]
    messages = head + turns
    # Whole exchanges go, oldest first, until the budget fits; the latest always stays.
    assert drop_oldest(messages, len, 8) == head + turns[6:]
    assert drop_oldest(messages, len, 0) == head + turns[9:]
    assert drop_oldest(head + turns[:3], len, 0) == head + turns[:3]  # nothing to drop
    long = " ".join(["word"] * 50)
    cut_one = truncate(head[:1] + [{"role": "user", "content": long},
                                   {"role": "assistant", "content": long},
                                   {"role": "tool", "content": long}], tokenizer, 5)
    assert cut_one[1]["content"] == long and cut_one[2]["content"] == long  # task, model turn
    assert len(tokenizer.encode(cut_one[3]["content"], add_special_tokens=False)) <= 5
    assert long.startswith(cut_one[3]["content"].strip()) and cut_one[3]["content"]
    assert cut("short", tokenizer, 5) == "short"


def _agentic_config(tmp_path, tiny_model, **env):
    import yaml

    config = {"pipeline": "agentic", "output_dir": str(tmp_path / "run"), "steps": 1,
              "model": {"path": tiny_model},
              "env": {"id": "guess_number", "max_turns": 3, **env},
              "rollout": {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 4}}
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_bad_hook_is_a_config_error(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_hooks.py").write_text("def two(messages, extra):\n    return messages\n")
    for function, expect in [("no_such_module:f", "cannot be imported"),
                             ("my_hooks:missing", "cannot be imported"),
                             ("my_hooks:two", "does not fit function(messages) -> messages")]:
        path = _agentic_config(tmp_path, tiny_model,
                               context={"policy": "hook", "function": function})
        assert main(["train", str(path)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "env.context.function" in err and expect in err and "Traceback" not in err
        assert not list((tmp_path / "run").glob("*"))  # refused before anything is written


def test_context_past_the_model_is_a_config_error_and_unset_is_the_models(tiny_model, tmp_path,
                                                                          capsys):
    from reroll.config import load_config
    from reroll.models.files import model_context
    from reroll.pipelines.validation import context_tokens

    path = _agentic_config(tmp_path, tiny_model, max_context_tokens=10**6)
    assert main(["train", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "env.max_context_tokens: 1000000 is past the model's context" in err
    unset = load_config(_agentic_config(tmp_path, tiny_model))
    assert unset.env.max_context_tokens is None and unset.env.context.policy == "end"
    assert context_tokens(unset.env.max_context_tokens, "env.max_context_tokens",
                          tiny_model) == model_context(tiny_model) > 512
    with pytest.raises(ConfigError, match="observation_tokens"):
        load_config(_agentic_config(tmp_path, tiny_model,
                                    context={"policy": "truncate", "observation_tokens": 0}))


def test_eval_of_a_run_takes_its_context_policy_and_the_models_context(tmp_path):
    """`reroll eval --model <checkpoint>` of an agentic run plays episodes as training did: the
    run's `env.context` and, unset, the model's own context as the limit (not eval's 1024)."""
    import json

    import yaml

    from reroll.evaluation_settings import run_settings

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (run / "config.yaml").write_text(yaml.safe_dump({
        "pipeline": "agentic", "steps": 1, "model": {"path": "m"},
        "env": {"id": "guess_number", "context": {"policy": "truncate",
                                                  "observation_tokens": 32}}}))
    _, settings = run_settings(str(checkpoint), {})
    assert settings["max_prompt_tokens"] == (2048, "env.max_context_tokens")
    section, key = settings["context"]
    assert key == "env.context" and section.observation_tokens == 32
    from reroll.rollout.context import from_config

    assert from_config(section) == ContextPolicy("truncate", observation_tokens=32)

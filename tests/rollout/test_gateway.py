"""The agents' gateway in front of a real engine (the HF engine on the tiny model), driven by the
real `openai` SDK: sessions by base URL or API key, exact tokens recorded and assembled
(append-only calls into one trajectory, rewritten history into chains with lineage), streaming,
OpenAI-style errors, and every harness fault isolated and counted."""

import asyncio
import json
import os
import sys
import threading
import time

import httpx
import openai
import pytest

from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model
from reroll.rollout.gateway import AgentSpec, Gateway, run_episodes
from reroll.rollout.gateway.agents import run_agent, run_episode
from reroll.rollout.gateway.chat import parse_reply

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gateway(tiny_model, tokenizer):
    made = Gateway(HFEngine(load_model(tiny_model), 16, tokenizer.pad_token_id), tokenizer,
                   "tiny", SamplingParams(8, 1.0, 1.0, 0, (tokenizer.eos_token_id,)), 256)
    yield made
    made.close()


def chatty(turns: int, rewrite: bool = False):
    """A harness: `turns` calls, each resending the conversation with the reply and a new user
    message (`rewrite`: the second call drops the first exchange, as a summariser would)."""
    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": task["prompt"]}]
        for turn in range(turns):
            reply = client.chat.completions.create(model="tiny", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"and {turn}?"}]
            if rewrite and turn == 0:
                messages = [{"role": "user", "content": "summary: " + task["prompt"]}]
        return 1.0
    return agent


def episodes(gateway, agent, n=1, limit=60.0, **spec):
    return run_episodes(gateway, AgentSpec(entrypoint=agent, time_limit_s=limit, **spec),
                        [{"prompt": "2 + 3 = ?"}], n, seed=0)


def test_append_only_calls_are_one_faithful_trajectory(gateway):
    trajectories, stats = episodes(gateway, chatty(3), n=2)
    assert [t.reward for t in trajectories] == [1.0, 1.0] and stats.calls == 6
    assert stats.faithful_calls == 6 and stats.chains == 2
    t = trajectories[0]
    assert t.reward_info["lineage"]["calls"] == [0, 1, 2]
    # The policy's tokens are in the loss, the harness's between them are not.
    assert sorted(set(t.turn_ids)) == [-1, 0, 1, 2]
    assert all((m == 1) == (k >= 0) for m, k in zip(t.policy_mask, t.turn_ids, strict=True))
    assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.policy_mask, strict=True)
               if m == 0)


def test_rewritten_history_becomes_chains_with_lineage(gateway):
    spec = AgentSpec(entrypoint=chatty(3, rewrite=True), time_limit_s=60)
    out = asyncio.run(_one(gateway, spec, one_sample=False))
    samples, stats = out
    assert stats.chains == 2 and stats.faithful_calls == stats.calls == 3
    assert [s.reward_info["lineage"]["calls"] for s in samples] == [[0], [1, 2]]
    assert samples[1].reward_info["lineage"]["parent"] == 0
    assert {s.reward_info["lineage"]["episode"] for s in samples} == \
        {samples[0].reward_info["lineage"]["episode"]}
    # The RL pipeline's form: the last chain trains, the earlier one is counted.
    samples, stats = asyncio.run(_one(gateway, spec, one_sample=True))
    assert len(samples) == 1 and stats.chains_dropped == 1


async def _one(gateway, spec, one_sample):
    from reroll.rollout.gateway.agents import GatewayEpisodeStats

    stats = GatewayEpisodeStats()
    samples = await run_episode(gateway, spec, {"prompt": "2 + 3 = ?"}, 0, 0, stats, one_sample)
    return samples, stats


def test_api_key_alone_streaming_models_and_reward_post(gateway):
    seen = {}

    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=gateway.url, api_key=api_key)  # the key names the session
        seen["models"] = [m.id for m in client.models.list()]
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        seen["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen["usage"] = chunks[-1].usage.completion_tokens
        httpx.post(f"{base_url}/reward", json={"reward": 0.25}).raise_for_status()
        return None

    trajectories, stats = episodes(gateway, agent)
    assert seen["models"] == ["tiny"] and seen["usage"] >= 1
    assert trajectories[0].reward == 0.25 and stats.faithful_calls == 1
    assert seen["text"] == gateway.tokenizer.decode(trajectories[0].response_ids,
                                                    skip_special_tokens=True)


def test_request_errors_are_openai_errors(gateway):
    seen = {}

    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                      "content": "x"}],
                                           response_format={"type": "json_object"})
        seen["param"] = bad.value.body["param"]
        with pytest.raises(openai.BadRequestError) as long:
            client.chat.completions.create(model="tiny", messages=[
                {"role": "user", "content": "1 2 3 4 5 6 7 8 9 " * 60}])
        seen["code"] = long.value.code
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway.url, api_key="sk-other",
                          max_retries=0).models.list()
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        return 1.0

    trajectories, stats = episodes(gateway, agent)
    assert seen == {"param": "response_format", "code": "context_length_exceeded"}
    assert stats.refused == 2 and trajectories[0].reward == 1.0  # the run goes on


def test_harness_faults_fail_only_their_episode(gateway):
    def crash(task, base_url, api_key):
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
        raise RuntimeError("the harness broke")

    def hang(task, base_url, api_key):
        time.sleep(30)

    def silent(task, base_url, api_key):
        return 1.0

    for agent, status, limit in ((crash, "crashed", 60), (hang, "timeout", 0.5),
                                 (silent, "no_calls", 60)):
        trajectories, stats = episodes(gateway, agent, limit=limit)
        t = trajectories[0]
        assert stats.failures[status] == 1 and t.reward_info["agent_status"] == status
        # An infrastructure failure is masked out of the loss, not a reward the policy earned.
        assert not any(t.policy_mask or []) and t.reward == 0.0


def test_a_call_after_the_episode_ended_is_a_409(gateway):
    keys = {}

    def agent(task, base_url, api_key):
        keys["url"], keys["key"] = base_url, api_key
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
        return 1.0

    trajectories, _ = episodes(gateway, agent)
    late = openai.OpenAI(base_url=keys["url"], api_key=keys["key"], max_retries=0)
    before = gateway.sessions.late_calls
    with pytest.raises(openai.ConflictError):
        late.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert gateway.sessions.late_calls == before + 1
    assert len(trajectories[0].reward_info["lineage"]["calls"]) == 1  # not added afterwards


def test_a_command_agent_gets_the_url_key_and_task(gateway, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\nimport openai\n"
        "task = json.loads(sys.stdin.read())\n"
        "assert task == json.loads(os.environ['REROLL_TASK'])\n"
        "client = openai.OpenAI()\n"  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        "client.chat.completions.create(model='tiny', messages=[{'role': 'user', "
        "'content': task['prompt']}])\n"
        "print(json.dumps({'reward': 0.5}))\n")
    spec = AgentSpec(command=[sys.executable, str(script)], time_limit_s=120)
    trajectories, stats = run_episodes(gateway, spec, [{"prompt": "2 + 3 = ?"}], 1, seed=0)
    assert trajectories[0].reward == 0.5 and stats.calls == 1
    crash = AgentSpec(command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    trajectories, stats = run_episodes(gateway, crash, [{"prompt": "x"}], 1, seed=0)
    assert stats.failures["crashed"] == 1 and "status 3" in stats.errors[0]


def test_a_cancelled_command_agent_is_killed(tmp_path):
    """An episode cancelled while its harness runs (an async run stopping) kills the harness
    process, not only one past its time limit: nothing is left running."""
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    spec = AgentSpec(command=[sys.executable, "-c", code], time_limit_s=120)

    async def cancelled() -> None:
        episode = asyncio.ensure_future(run_agent(spec, {}, "http://127.0.0.1:9/v1", "k"))
        while not (pidfile.exists() and pidfile.read_text()):
            await asyncio.sleep(0.02)
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(cancelled())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pidfile.read_text()), 0)


def test_a_verifier_scores_the_final_conversation(gateway):
    def agent(task, base_url, api_key):
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": task["prompt"]}])

    def verifier(task, messages):
        return 0.75 if messages[-1]["role"] == "assistant" else 0.0

    trajectories, _ = episodes(gateway, agent, verifier=verifier)
    assert trajectories[0].reward == 0.75


@pytest.mark.parametrize("text, calls, errors", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', 1, 0),
    ('a <tool_call>{"name": "add"}</tool_call><tool_call>{"name": "mul", '
     '"arguments": {}}</tool_call>', 2, 0),
    ("<tool_call>{not json}</tool_call>", 0, 1),
    ("no calls here", 0, 0),
])
def test_tool_calls_are_parsed_from_the_text(text, calls, errors):
    parsed = parse_reply(text, [{"type": "function", "function": {"name": "add"}}])
    assert len(parsed.tool_calls) == calls and parsed.errors == errors
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert parse_reply(text, None).tool_calls == []  # no tools offered: text only


def test_a_crashed_episode_does_not_move_its_groups_baseline(gateway):
    runs, lock = [], threading.Lock()

    def flaky(task, base_url, api_key):
        with lock:
            first = not runs
            runs.append(api_key)
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
        if first:
            raise ConnectionError("the harness lost its sandbox")
        return 0.5

    trajectories, stats = episodes(gateway, flaky, n=3)
    assert stats.failures["crashed"] == 1
    crashed = [t for t in trajectories if t.reward_info["agent_status"] == "crashed"]
    assert len(crashed) == 1 and not any(crashed[0].policy_mask)
    # It takes the good episodes' mean: their advantages are what they would be without it.
    assert [t.reward for t in trajectories] == [0.5, 0.5, 0.5]


def test_text_completions_are_recorded_and_chained(gateway):
    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        first = client.completions.create(model="tiny", prompt=task["prompt"], max_tokens=4)
        ids = first.choices[0].model_extra["token_ids"]
        assert len(ids) == len(first.choices[0].logprobs.token_logprobs) >= 1
        # A token-id prompt that extends the first call continues its trajectory.
        prompt = gateway.renderer.encode(task["prompt"]) + ids + [5, 6]
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        return 1.0

    trajectories, stats = episodes(gateway, agent)
    assert stats.calls == 2 and stats.chains == 1 and stats.faithful_calls == 2
    assert trajectories[0].reward_info["lineage"]["calls"] == [0, 1]


def test_held_out_success_is_over_the_episodes_whose_harness_did_not_fail(gateway):
    """Two good episodes (one solved) and two whose harness hung past its limit: the held-out
    success is 1 of 2, not 1 of 4, and the failed share is reported (it was 0.25 and silent)."""
    from reroll.pipelines.agents import held_out_metrics

    calls, lock = [], threading.Lock()

    def agent(task, base_url, api_key):
        with lock:
            calls.append(api_key)
            n = len(calls)
        if n > 2:
            time.sleep(30)
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
        return 1.0 if n == 1 else 0.0

    trajectories, stats = episodes(gateway, agent, n=4, limit=3.0)
    assert stats.failures["timeout"] == 2
    assert held_out_metrics(trajectories) == {"eval/reward_mean": 0.5,
                                              "eval/success_rate": 0.5,
                                              "eval/infra_failure_frac": 0.5}

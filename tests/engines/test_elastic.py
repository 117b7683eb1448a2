"""ROSE's elastic rollouts: the lending cap's rule (hand-checked), the serving endpoint's latency
log, and an ElasticEngine against reroll's real server on loopback around the tiny model's HF
engine: rollouts are lent while the endpoint is idle, lending stops within a control interval
once its own traffic nears the objective, and new weights reach both sides (fingerprint)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import yaml
from engine_checks import generate_all

from reroll.engines.base import Completion, Request, SamplingParams, fingerprint
from reroll.engines.elastic import ElasticEngine, ServingObjective, next_beside, next_cap
from reroll.engines.hf import HFEngine
from reroll.engines.remote import RemoteEngine
from reroll.engines.server import CompletionServer, LatencyLog, p99
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit

OBJECTIVE = ServingObjective(ttft_p99_s=1.0, tpot_p99_s=0.1, headroom=0.8, max_lent=8)


@pytest.mark.parametrize(("cap", "serving", "expected"), [
    (0, {"requests": 0, "ttft_p99_s": None, "tpot_p99_s": None}, 8),  # idle: lend the most
    (0, {"requests": 5, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 1),  # within: start at 1
    (3, {"requests": 5, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 6),  # within: double
    (6, {"requests": 5, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 8),  # ... up to max_lent
    (8, {"requests": 5, "ttft_p99_s": 0.81, "tpot_p99_s": 0.05}, 0),  # ttft past 0.8 x 1.0
    (8, {"requests": 5, "ttft_p99_s": 0.5, "tpot_p99_s": 0.09}, 0),  # tpot past 0.8 x 0.1
    (8, {"requests": 5, "ttft_p99_s": 0.8, "tpot_p99_s": 0.08}, 8),  # at the line: still fine
    (8, {"requests": 5, "in_flight": 1, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 0),  # users now
])
def test_the_lending_cap_follows_the_serving_latency(cap, serving, expected):
    assert next_cap(cap, serving, OBJECTIVE) == expected


@pytest.mark.parametrize(("cap", "serving", "expected"), [
    (0, {"requests": 5, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 8),  # within: all at once
    (8, {"requests": 5, "in_flight": 1, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 0),  # users now
    (8, {"requests": 5, "ttft_p99_s": 0.81, "tpot_p99_s": 0.05}, 0),  # past the headroom
])
def test_an_endpoint_that_yields_lends_its_most_at_once_while_its_users_are_within(
        cap, serving, expected):
    assert next_cap(cap, serving, OBJECTIVE, yields=True) == expected


@pytest.mark.parametrize(("serving", "expected"), [
    ({"requests": 5, "in_flight": 2, "ttft_p99_s": 0.5, "tpot_p99_s": 0.05}, 3),  # within: all
    ({"requests": 5, "in_flight": 2, "ttft_p99_s": 0.8, "tpot_p99_s": 0.08}, 3),  # at the line
    ({"requests": 5, "in_flight": 2, "ttft_p99_s": 0.81, "tpot_p99_s": 0.05}, 0),  # ttft near
    ({"requests": 5, "in_flight": 0, "ttft_p99_s": 0.5, "tpot_p99_s": 0.081}, 0),  # tpot near
    ({"requests": 0, "in_flight": 0, "ttft_p99_s": None, "tpot_p99_s": None}, 3),  # quiet: all
])
def test_the_rollouts_kept_beside_the_users_go_first_when_their_latency_nears_the_objective(
        serving, expected):
    assert next_beside(serving, OBJECTIVE, most=3) == expected


def test_p99_is_the_nearest_rank():
    assert p99([]) is None
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0  # rank ceil(0.99 x 100) = 99
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_the_latency_log_splits_ttft_and_tpot_per_kind():
    log = LatencyLog()
    log.started("serving")
    log.started("rollout")
    assert log.report(10)["serving"]["in_flight"] == 1
    out = Completion("a", [1], [5, 6, 7, 8, 9], [0.0] * 5, "length", 0, first_token_s=0.2)
    log.finished("serving", 1.0, out)  # 0.2 s to the first token, then 0.8 s for 4 more
    log.finished("rollout", 3.0, Completion("b", [1], [5], [0.0], "stop", 0))
    report = log.report(10)
    assert report["serving"] == {"requests": 1, "in_flight": 0, "ttft_p99_s": 0.2,
                                 "tpot_p99_s": pytest.approx(0.2)}
    assert report["rollout"]["ttft_p99_s"] == 3.0  # no engine measure: the whole latency
    assert report["rollout"]["tpot_p99_s"] == 0.0


def test_the_hf_engine_measures_time_to_first_token(tiny_model, tokenizer):
    engine = HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id)
    [out] = generate_all(engine, [Request([1, 2, 3], SamplingParams(6), seed=0)])
    assert out.first_token_s is not None and 0 < out.first_token_s < 30


def rollout_requests(n: int, length: int = 12) -> list[Request]:
    return [Request([1, 5 + i % 7, 9], SamplingParams(length, temperature=1.0), seed=i)
            for i in range(n)]


@pytest.fixture
def endpoint(tiny_model, tokenizer):
    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id), "tiny")
    yield server
    server.close()


def elastic(tiny_model, tokenizer, url: str, objective: ServingObjective) -> ElasticEngine:
    dedicated = HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)
    return ElasticEngine(dedicated, url, objective, dedicated_max_in_flight=2, model="tiny")


@contextlib.contextmanager
def lending_to_a_yielding_endpoint(tiny_model, tokenizer, objective: ServingObjective,
                                   settle_s: float, **server_options):
    """A yielding endpoint around the tiny model (with ``server_options``), an ElasticEngine
    lending to it under ``objective``, and its users' client; after ``settle_s`` of control
    ticks. Closed after."""
    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id),
                              "tiny", yield_to_serving=True, **server_options)
    engine = elastic(tiny_model, tokenizer, server.url, objective)
    users = RemoteEngine([server.url])
    try:
        time.sleep(settle_s)
        yield server, engine, users
    finally:
        users.close()
        engine.close()
        server.close()


def test_rollouts_are_lent_to_an_idle_endpoint_and_weights_reach_both(
        endpoint, tiny_model, tokenizer):
    roomy = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=0.05, max_lent=4)
    engine = elastic(tiny_model, tokenizer, endpoint.url, roomy)
    try:
        time.sleep(0.3)  # a few control intervals: the idle endpoint lends its most
        assert engine.cap == 4
        outs = generate_all(engine, rollout_requests(24))
        assert all(len(o.token_ids) == 12 for o in outs)
        assert engine.counters.lent > 0 and engine.counters.dedicated > 0
        assert engine.counters.lent + engine.counters.dedicated == 24
        assert endpoint.latency.report(60)["rollout"]["requests"] == engine.counters.lent
        assert endpoint.latency.report(60)["serving"]["requests"] == 0

        new = {n: t + 0.01 for n, t in load_model(tiny_model).state_dict().items()}
        engine.load_weights(new.items(), version=1)
        assert engine.weights_fingerprint() == fingerprint(new.items())
        assert endpoint.engine.weights_fingerprint() == fingerprint(new.items())
        engine.dedicated.load_weights(((n, t * 2) for n, t in new.items()), version=2)
        assert engine.weights_fingerprint() != engine.dedicated.weights_fingerprint()
        assert "serving endpoint" in engine.weights_fingerprint()  # a sync check would stop
    finally:
        engine.close()


def test_lending_stops_within_a_control_interval_when_serving_latency_nears_the_objective(
        endpoint, tiny_model, tokenizer):
    strict = ServingObjective(ttft_p99_s=1e-6, tpot_p99_s=60, control_interval_s=0.05,
                              window_s=5.0, max_lent=4)
    engine = elastic(tiny_model, tokenizer, endpoint.url, strict)
    users = RemoteEngine([endpoint.url])  # the endpoint's own traffic
    try:
        time.sleep(0.3)
        assert engine.cap == 4  # idle so far
        generate_all(users, rollout_requests(2, length=4))  # any TTFT passes 0.8 x 1e-6
        deadline = time.perf_counter() + 2 * strict.control_interval_s + 0.5
        while engine.cap and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert engine.cap == 0 and engine.counters.backoffs == 1
        lent_before = engine.counters.lent
        generate_all(engine, rollout_requests(12))
        assert engine.counters.lent == lent_before  # nothing more lent while threatened
    finally:
        users.close()
        engine.close()


def test_an_aborted_wait_does_not_block_the_queue(endpoint, tiny_model, tokenizer):
    engine = elastic(tiny_model, tokenizer, endpoint.url,
                     ServingObjective(ttft_p99_s=1e-6, tpot_p99_s=1e-6, control_interval_s=0.05))
    try:
        async def scenario():
            waiting = [asyncio.create_task(engine.generate(r)) for r in rollout_requests(4, 200)]
            await asyncio.sleep(0.05)  # two run on the dedicated engine, two wait for room
            waiting[2].cancel()  # the third gives up before it gets room
            return await asyncio.gather(waiting[0], waiting[1], waiting[3])

        outs = asyncio.run(scenario())
        assert [len(o.token_ids) for o in outs] == [200, 200, 200]
    finally:
        engine.close()



def test_a_yielding_endpoint_aborts_lent_rollouts_for_its_users_and_they_finish_elsewhere(
        tiny_model, tokenizer):
    idle = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=0.05, max_lent=4)
    with lending_to_a_yielding_endpoint(tiny_model, tokenizer, idle,
                                        settle_s=0.3) as (server, engine, users):

        async def scenario():
            rollouts = [asyncio.create_task(engine.generate(r))
                        for r in rollout_requests(6, length=300)]
            while server.latency.report(60)["rollout"]["in_flight"] == 0:
                await asyncio.sleep(0.01)  # some are lent and running on the endpoint
            user = await users.generate(rollout_requests(1, length=4)[0])
            return user, await asyncio.gather(*rollouts)

        user, outs = asyncio.run(scenario())
        assert user.finish_reason == "length" and len(user.token_ids) == 4
        assert engine.counters.preempted > 0
        assert [len(o.token_ids) for o in outs] == [300] * 6  # every rollout finished whole
        assert all(len(o.logprobs) == 300 for o in outs)


def test_a_yielding_endpoint_turns_rollouts_away_while_users_are_served_and_says_when_they_end(
        tiny_model, tokenizer):
    import threading

    import httpx

    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id),
                              "tiny", yield_to_serving=True)
    try:
        user = threading.Thread(target=server.complete, args=(
            {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True},))
        user.start()
        while server.latency.report(60)["serving"]["in_flight"] == 0:
            time.sleep(0.005)
        started = time.perf_counter()
        reply = server.complete({"prompt": [1, 2], "max_tokens": 50, "reroll_kind": "rollout"})
        assert time.perf_counter() - started < 1.0  # back at once, not after the user's 400
        assert reply["choices"][0]["finish_reason"] == "abort"
        assert reply["choices"][0]["token_ids"] == [] and server.refused == 1
        # the read waits for the user's request to end (not for the whole 60 s)
        load = httpx.get(f"{server.url}/load", params={"window_s": 60, "wait_idle_s": 60},
                         timeout=120).json()
        assert load["serving"]["in_flight"] == 0 and load["serving"]["requests"] == 1
        assert load["yield_to_serving"] is True and load["refused"] == 1
        assert not user.join(timeout=5) and not user.is_alive()
        assert load["rollout"]["requests"] == 0  # the refused one never ran
        reply = server.complete({"prompt": [1, 2], "max_tokens": 5, "reroll_kind": "rollout"})
        assert len(reply["choices"][0]["token_ids"]) == 5  # idle again: it runs
        assert httpx.get(f"{server.url}/load", params={"wait_idle_s": "x"}).status_code == 400
    finally:
        server.close()


def two_rollouts_then_a_user(server: CompletionServer, rollout_tokens: int, user_tokens: int):
    """Start rollouts "older" then "newer" on `server`, then a user request once both run; returns
    (the rollouts' threads, the user's thread, the replies by name, filled as they end)."""
    import threading

    replies: dict[str, dict] = {}

    def call(name: str, body: dict) -> None:
        replies[name] = server.complete(body | {"ignore_eos": True})

    calls = [threading.Thread(target=call, args=(name, {
        "prompt": [1, 2], "max_tokens": rollout_tokens, "reroll_kind": "rollout"}))
        for name in ("older", "newer")]
    for running, thread in enumerate(calls, start=1):
        thread.start()  # in order: "older" runs before "newer" starts
        while len(server._rollouts) < running:
            time.sleep(0.002)
    user = threading.Thread(target=call, args=("user", {"prompt": [1, 2, 3],
                                                        "max_tokens": user_tokens}))
    user.start()
    while server.latency.report(60)["serving"]["in_flight"] == 0:
        time.sleep(0.002)
    return calls, user, replies


def test_an_endpoint_that_keeps_one_rollout_beside_its_users_aborts_only_the_later_ones(
        tiny_model, tokenizer):
    import httpx

    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id),
                              "tiny", yield_to_serving=True, rollouts_beside_serving=1)
    try:
        calls, user, replies = two_rollouts_then_a_user(server, 200, 300)
        # one rollout (the older) already runs beside the user: a third is turned away
        third = server.complete({"prompt": [1, 2], "max_tokens": 50, "reroll_kind": "rollout"})
        assert third["choices"][0]["finish_reason"] == "abort" and server.refused == 1
        for thread in [*calls, user]:
            thread.join(timeout=120)
        older, newer = (replies[n]["choices"][0] for n in ("older", "newer"))
        assert older["finish_reason"] == "length" and len(older["token_ids"]) == 200
        assert newer["finish_reason"] == "abort" and len(newer["token_ids"]) < 200
        assert len(replies["user"]["choices"][0]["token_ids"]) == 300
        load = httpx.get(f"{server.url}/load").json()
        assert load["rollouts_beside_serving"] == 1 and load["yield_to_serving"] is True
    finally:
        server.close()
    with pytest.raises(ValueError, match="rollouts_beside_serving"):
        CompletionServer(HFEngine(load_model(tiny_model), 4, 0), "tiny",
                         rollouts_beside_serving=-1)


def test_an_endpoint_told_to_keep_fewer_beside_its_users_aborts_the_later_ones_at_once(
        tiny_model, tokenizer):
    import httpx

    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id),
                              "tiny", yield_to_serving=True, rollouts_beside_serving=2)
    try:
        calls, user, replies = two_rollouts_then_a_user(server, 600, 600)
        assert len(server._rollouts) == 2  # both kept beside the user so far
        reply = httpx.post(f"{server.url}/beside", json={"keep": 1}).json()
        assert reply == {"keep": 1, "rollouts_beside_serving": 2}
        calls[1].join(timeout=60)  # the newer one comes back now, not after its 600 tokens
        newer = replies["newer"]["choices"][0]
        assert newer["finish_reason"] == "abort" and len(newer["token_ids"]) < 600
        assert user.is_alive() and len(server._rollouts) == 1
        assert httpx.post(f"{server.url}/beside", json={"keep": 9}).json()["keep"] == 2  # at most K
        assert httpx.get(f"{server.url}/load").json()["beside"] == 2
        assert httpx.post(f"{server.url}/beside", json={"keep": "x"}).status_code == 400
        for thread in [calls[0], user]:
            thread.join(timeout=120)
        assert len(replies["older"]["choices"][0]["token_ids"]) == 600
    finally:
        server.close()


def test_an_endpoint_that_pauses_rollouts_for_its_users_resumes_them_when_they_leave(
        tiny_model, tokenizer):
    """Pause room for 1: the older rollout is paused (KV kept, no work) and finishes whole after
    the user, as if never paused; the newer one, past the pause cap, is aborted as before."""
    import httpx

    engine = HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)
    server = CompletionServer(engine, "tiny", yield_to_serving=True, pause_rollouts=1)
    try:
        calls, user, replies = two_rollouts_then_a_user(server, 300, 400)
        calls[1].join(timeout=60)  # the newer comes back at once (aborted)
        assert replies["newer"]["choices"][0]["finish_reason"] == "abort"
        assert user.is_alive() and "older" not in replies
        load = httpx.get(f"{server.url}/load").json()
        assert load["paused"] == 1 and load["pauses"] == 1 and load["pause_rollouts"] == 1
        parked = engine._parked.get(next(iter(server._paused)))  # None: paused before it began
        assert parked is None or len(parked.rows[0].tokens) < 300
        user.join(timeout=120)
        calls[0].join(timeout=120)
        older = replies["older"]["choices"][0]
        assert older["finish_reason"] == "length" and len(older["token_ids"]) == 300
        alone = engine.generate_batch([Request([1, 2], SamplingParams(300, temperature=1.0),
                                               seed=0)])[0]
        assert older["token_ids"] == alone.token_ids  # resumed where it stopped
        assert engine.paused() == 0 and not server._paused
    finally:
        server.close()
    for bad in ({"pause_rollouts": -1}, {"pause_rollouts": 1, "engine": RemoteEngine(
            ["http://127.0.0.1:9/v1"])}):
        with pytest.raises(ValueError, match="pause_rollouts"):
            CompletionServer(bad.pop("engine", engine), "tiny", **bad)


def test_an_endpoint_gives_back_its_paused_rollouts_when_asked_with_their_tokens(
        tiny_model, tokenizer):
    import httpx

    engine = HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id)
    server = CompletionServer(engine, "tiny", yield_to_serving=True, pause_rollouts=2)
    try:
        calls, user, replies = two_rollouts_then_a_user(server, 300, 600)
        while httpx.get(f"{server.url}/load").json()["paused"] < 2:
            time.sleep(0.002)
        assert httpx.post(f"{server.url}/reclaim", json={"n": 1}).json() == {"reclaimed": 1}
        calls[1].join(timeout=60)  # the one paused last comes back now, with its tokens
        newer = replies["newer"]["choices"][0]
        assert newer["finish_reason"] == "abort" and len(newer["token_ids"]) < 300
        assert len(newer["logprobs"]["token_logprobs"]) == len(newer["token_ids"])
        assert user.is_alive() and httpx.get(f"{server.url}/load").json()["paused"] == 1
        assert httpx.post(f"{server.url}/reclaim", json={"n": "x"}).status_code == 400
        user.join(timeout=120)
        calls[0].join(timeout=120)
        assert len(replies["older"]["choices"][0]["token_ids"]) == 300
    finally:
        server.close()


def test_the_controller_takes_paused_rollouts_back_when_the_dedicated_engine_has_room(
        tiny_model, tokenizer):
    """2 short rollouts on the dedicated engine, 2 long ones lent and paused under a long user
    request: once the short ones end, the controller takes the paused ones back (before the user
    leaves) and they finish whole on the dedicated engine."""
    idle = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=0.05, max_lent=2)
    with lending_to_a_yielding_endpoint(tiny_model, tokenizer, idle, settle_s=0.3,
                                        pause_rollouts=4) as (server, engine, users):

        async def scenario():
            requests = [Request([1, 2, i], SamplingParams(n, temperature=1.0), seed=i)
                        for i, n in enumerate((20, 20, 300, 300))]
            rollouts = [asyncio.create_task(engine.generate(r)) for r in requests]
            await until(lambda: server.latency.report(60)["rollout"]["in_flight"] == 2)
            user = asyncio.create_task(users.generate(Request([1, 2, 3], SamplingParams(3000),
                                                              seed=0)))
            await until(lambda: engine.counters.reclaimed == 2 or user.done())
            assert not user.done() and server.pauses == 2
            outs = await asyncio.gather(*rollouts)
            assert not user.done()  # they finished while the user was still served
            return await user, outs

        user, outs = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert len(user.token_ids) == 3000
        assert [len(o.token_ids) for o in outs] == [20, 20, 300, 300]
        assert engine.counters.preempted == 2 and engine.metrics()["elastic/reclaimed"] == 2


def test_the_controller_takes_the_kept_rollouts_back_while_the_users_latency_nears_the_objective(
        tiny_model, tokenizer):
    strict = ServingObjective(ttft_p99_s=1e-6, tpot_p99_s=60, control_interval_s=0.05,
                              window_s=1.0, max_lent=4)
    with lending_to_a_yielding_endpoint(tiny_model, tokenizer, strict, settle_s=0.3,
                                        rollouts_beside_serving=2) as (server, engine, users):
        assert server.beside == 2 and engine.counters.unkept == 0  # quiet: keeps its 2
        generate_all(users, rollout_requests(1, length=4))  # any TTFT passes 0.8 x 1e-6
        deadline = time.perf_counter() + 2 * strict.control_interval_s + 0.5
        while not (server.beside == 0 and engine.counters.unkept and engine.cap == 0) \
                and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert server.beside == 0 and engine.counters.unkept == 1 and engine.cap == 0
        deadline = time.perf_counter() + strict.window_s + 1.0  # the slow request leaves the window
        while not (server.beside == 2 and engine.cap == 4) and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert server.beside == 2 and engine.cap == 4 and engine.counters.unkept == 1


def test_an_endpoint_that_keeps_rollouts_beside_its_users_starts_no_new_one_while_they_run(
        tiny_model, tokenizer):
    """Room for 2 beside the user, 1 running: a new rollout is still turned away (its prefill
    would stall the user's decoding); the running one goes on to its end."""
    import threading

    server = CompletionServer(HFEngine(load_model(tiny_model), 64, tokenizer.pad_token_id),
                              "tiny", yield_to_serving=True, rollouts_beside_serving=2)
    replies: dict[str, dict] = {}

    def call(name: str, body: dict) -> None:
        replies[name] = server.complete(body | {"ignore_eos": True})

    try:
        kept = threading.Thread(target=call, args=("kept", {
            "prompt": [1, 2], "max_tokens": 400, "reroll_kind": "rollout"}))
        kept.start()
        while not server._rollouts:
            time.sleep(0.002)
        user = threading.Thread(target=call, args=("user", {"prompt": [1, 2, 3],
                                                            "max_tokens": 400}))
        user.start()
        while server.latency.report(60)["serving"]["in_flight"] == 0:
            time.sleep(0.002)
        new = server.complete({"prompt": [1, 2], "max_tokens": 50, "reroll_kind": "rollout"})
        assert new["choices"][0]["finish_reason"] == "abort" and new["choices"][0]["token_ids"] == []
        assert server.refused == 1 and user.is_alive()
        for thread in (kept, user):
            thread.join(timeout=120)
        assert replies["kept"]["choices"][0]["finish_reason"] == "length"
        assert len(replies["kept"]["choices"][0]["token_ids"]) == 400
    finally:
        server.close()


def test_lending_resumes_as_soon_as_the_users_leave_not_on_the_next_tick(tiny_model, tokenizer):
    slow = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=1.0, max_lent=4)
    with lending_to_a_yielding_endpoint(tiny_model, tokenizer, slow,
                                        settle_s=1.3) as (server, engine, users):
        assert engine.cap == 4

        async def scenario():
            rollouts = [asyncio.create_task(engine.generate(r))
                        for r in rollout_requests(6, length=300)]
            while server.latency.report(60)["rollout"]["in_flight"] == 0:
                await asyncio.sleep(0.01)  # lent and running on the endpoint
            user = await users.generate(Request([1, 2, 3], SamplingParams(300), seed=0))
            ended = time.perf_counter()
            assert engine.counters.preempted > 0
            while engine.cap == 0 and time.perf_counter() - ended < 5:
                await asyncio.sleep(0.005)
            return user, time.perf_counter() - ended, await asyncio.gather(*rollouts)

        user, reopened_s, outs = asyncio.run(scenario())
        assert len(user.token_ids) == 300
        # the controller was waiting on the endpoint: the whole cap again well within a tick
        assert reopened_s < 0.8 and engine.cap == 4
        assert [len(o.token_ids) for o in outs] == [300] * 6


async def until(condition, timeout_s: float = 60.0) -> None:
    """Wait (on the event loop) for `condition()`; fail the test after `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_the_rest_of_a_yielded_rollout_goes_ahead_and_the_caller_can_still_abort_it(
        tiny_model, tokenizer):
    idle = ServingObjective(ttft_p99_s=60, tpot_p99_s=60, control_interval_s=0.05, max_lent=2)
    with lending_to_a_yielding_endpoint(tiny_model, tokenizer, idle,
                                        settle_s=0.3) as (server, engine, users):

        async def scenario():
            requests = rollout_requests(8, length=200)
            rollouts = [asyncio.create_task(engine.generate(r)) for r in requests]
            # 2 on the dedicated engine, 2 lent, 4 waiting
            await until(lambda: server.latency.report(60)["rollout"]["in_flight"] == 2)
            lent = [r.request_id for r in requests
                    if engine._where.get(r.request_id, ("",))[0] == "serving"]
            user = asyncio.create_task(users.generate(Request([1, 2, 3], SamplingParams(200),
                                                              seed=0)))
            # the two lent rollouts come back and wait ahead of the four that never started
            await until(lambda: sum(w.first for w in engine._waiting) == 2)
            order = [w.first for w in engine._waiting]
            assert order[:2] == [True, True] and order == sorted(order, reverse=True)
            assert engine.cap == 0  # and nothing is lent while the user is served
            await until(lambda: engine._where.get(lent[0], ("", lent[0]))[1] != lent[0])
            engine.abort(lent[0])  # its rest runs under its own id; the original id reaches it
            await user
            return requests, lent, await asyncio.gather(*rollouts)

        requests, lent, outs = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert [o.request_id for o in outs] == [r.request_id for r in requests]
        assert engine.counters.preempted >= 2
        by_id = {o.request_id: o for o in outs}
        assert by_id[lent[0]].finish_reason == "abort" and len(by_id[lent[0]].token_ids) < 200
        assert [len(o.token_ids) for o in outs if o.request_id != lent[0]] == [200] * 7


@pytest.mark.e2e
def test_grpo_lends_rollouts_to_a_serving_endpoint_and_keeps_it_on_the_policy(
        tmp_path, endpoint, tiny_model, arithmetic):
    """A 3-step GRPO run with `rollout.serving_endpoint`: the idle endpoint answers part of the
    rollouts, gets the new weights after every update, and the run's fingerprint check passes."""
    from reroll.config import load_config
    from reroll.pipelines.rlvr import train
    from reroll.tracking import read_metrics

    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "steps": 3, "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12,
                    "serving_endpoint": {"url": endpoint.url, "ttft_p99_s": 60,
                                         "tpot_p99_s": 60, "control_interval_s": 0.05,
                                         "dedicated_max_in_flight": 4, "max_lent": 8}},
        "eval": {"every_steps": 0, "max_prompts": 4}, "tracking": {"progress": False}}))
    train(load_config(config))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["elastic/lent_frac"] > 0 for r in rows)
    trained = load_model(str(tmp_path / "run" / "checkpoints" / "step_3"))
    assert endpoint.engine.weights_fingerprint() == fingerprint(trained.state_dict().items())


def test_an_unreachable_serving_endpoint_is_a_config_error(tiny_model):
    from reroll.config.errors import ConfigError
    from reroll.config.schema import RolloutConfig
    from reroll.engines import build_engine

    rollout = RolloutConfig(serving_endpoint={"url": "http://127.0.0.1:9/v1", "ttft_p99_s": 1,
                                              "tpot_p99_s": 1})
    with pytest.raises(ConfigError, match="rollout.serving_endpoint.url: .*reroll.engines.server"):
        build_engine(rollout, tiny_model)

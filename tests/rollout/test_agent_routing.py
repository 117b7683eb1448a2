"""Routing replay for multi-turn episodes on the tiny Qwen3-MoE: each episode's trajectory
carries one routing record aligned with all its tokens (prompt, every turn's reply and
observation), built from each turn's engine call, and the trainer's forward replays it."""

from __future__ import annotations

import copy

import openai
import pytest
import torch

from reroll.data.batch import Trajectory, collate
from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.envs import make_env
from reroll.models.loading import load_model, load_tokenizer
from reroll.models.logprobs import batched_logprobs
from reroll.models.routing import (
    RoutingReplayError,
    agreement,
    joined_record,
    recording,
    replaying,
    routers,
    top_k,
)
from reroll.rollout.agent_loop import AgentJob, run_episodes
from reroll.rollout.context import ContextPolicy
from reroll.rollout.gateway import AgentSpec, Gateway
from reroll.rollout.gateway import run_episodes as gateway_episodes

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def moe_parts(tiny_moe):
    torch.set_num_threads(1)
    return load_model(tiny_moe), load_tokenizer(tiny_moe)


def _episodes(model, tokenizer, dtype=None, **kw):
    engine = HFEngine(copy.deepcopy(model), 16, tokenizer.pad_token_id, dtype=dtype,
                      record_routing=True)
    params = SamplingParams(6, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: make_env("guess_number", high=8, max_turns=4),
                   params, **kw)
    trajectories, stats = run_episodes(job, [1, 2], 2, run_seed=0, step=1)
    assert stats.env_errors == 0, stats.errors
    return trajectories, stats


def trainer_routing(model, batch):
    """The float32 trainer's own routing of the batch's tokens, [B, T, layers, k]."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), recording(model) as recorder:
        model(input_ids=ids, attention_mask=mask)
        return recorder.take().view(*ids.shape, len(routers(model)), top_k(model))


def fed_as_the_trainer_routes(model, tokenizer, trajectories) -> list[torch.Tensor]:
    """Each trajectory's record has one entry per token and equals the float32 trainer's own
    routing of the trajectory wherever the engine fed a token; returns where it fed ([n] bool
    per trajectory)."""
    batch, _ = collate(trajectories, tokenizer.pad_token_id)
    own = trainer_routing(model, batch)
    out = []
    for i, t in enumerate(trajectories):
        n = len(t.prompt_ids) + len(t.response_ids)
        assert t.routed_experts.shape == (n, len(routers(model)), top_k(model))
        fed = (t.routed_experts >= 0).all(-1).all(-1)
        assert agreement(t.routed_experts[fed], own[i, :n][fed]) == 1.0
        out.append(fed)
    return out


def test_an_episode_carries_the_routing_of_every_token_it_fed(moe_parts):
    """float32 engine and trainer route alike, so the episode's record must equal the
    trainer's routing of the whole trajectory wherever the engine fed a token: a record shifted
    by a turn, or holding another call's tokens, would not."""
    model, tokenizer = moe_parts
    trajectories, stats = _episodes(model, tokenizer, max_context_tokens=400)
    assert stats.turns > len(trajectories)  # multi-turn: some episode took several turns
    for t, fed in zip(trajectories, fed_as_the_trainer_routes(model, tokenizer, trajectories),
                      strict=True):
        # no record only past the last token the engine fed: the final reply's last token and
        # an observation no turn read
        assert fed[: int(fed.nonzero().max()) + 1].all()
        assert int(fed.sum()) >= len(t.prompt_ids) + sum(t.policy_mask) - 1


def test_the_trainer_replays_a_bf16_engines_episode_routing(moe_parts):
    """bf16 engine, float32 trainer: with the record replayed the trainer routes every fed
    token as the engine did, and its logprobs of the policy's tokens are no further from the
    engine's than when it routes afresh."""
    model, tokenizer = moe_parts
    trajectories, _ = _episodes(model, tokenizer, dtype=torch.bfloat16, max_context_tokens=400)
    batch, _ = collate(trajectories, tokenizer.pad_token_id)
    record = batch["routed_experts"]
    args = (model, batch["input_ids"], batch["attention_mask"], 4)
    with torch.no_grad():
        free = batched_logprobs(*args, response_mask=batch["response_mask"])
        replayed = batched_logprobs(*args, response_mask=batch["response_mask"],
                                    routed_experts=record)
        with replaying(model, record):
            forced = trainer_routing(model, batch)
    fed = (record >= 0).all(-1).all(-1)
    assert agreement(forced[fed], record[fed]) == 1.0
    policy = batch["response_mask"] > 0
    behaviour = batch["behaviour_logprobs"]
    gap_free = (free - behaviour)[policy].abs()
    gap_replayed = (replayed - behaviour)[policy].abs()
    apart = 1 - agreement(trainer_routing(model, batch)[fed], record[fed])
    print(f"routed apart without replay {apart:.4f}; mean |dlogp| free {gap_free.mean():.3e} "
          f"replayed {gap_replayed.mean():.3e}; max {gap_free.max():.3e} / {gap_replayed.max():.3e}")
    assert gap_replayed.mean() <= gap_free.mean() + 1e-6


def test_an_edited_history_keeps_the_record_of_its_trained_chain(moe_parts):
    """drop_oldest rewrites the conversation: the sample is the last token chain, and its
    record is that chain's, one entry per token."""
    model, tokenizer = moe_parts
    trajectories, stats = _episodes(model, tokenizer, max_context_tokens=150,
                                    context=ContextPolicy("drop_oldest"))
    assert stats.context_edits > 0 and stats.chains_dropped > 0
    fed_as_the_trainer_routes(model, tokenizer, trajectories)


def test_a_call_that_does_not_line_up_is_an_error():
    record = torch.zeros(5, 2, 2, dtype=torch.int16)
    ids = [1, 2, 3, 4, 5, 6, 7]
    joined = joined_record(ids, [([1, 2, 3, 4, 5], record), ([1, 2, 3, 4, 5, 6, 7], None)])
    assert joined.shape == (7, 2, 2) and (joined[5:] == -1).all()
    with pytest.raises(RoutingReplayError, match="call 1's 5 tokens are not a prefix"):
        joined_record(ids, [([1, 2], None), ([1, 2, 9, 4, 5], record)])
    with pytest.raises(RoutingReplayError, match=r"shape \(5, 2, 2\); its request and "
                                                 r"completion hold 6"):
        joined_record(ids, [([1, 2, 3, 4, 5, 6], record)])
    with pytest.raises(ValueError, match="one entry per prompt and response token"):
        Trajectory(prompt_ids=[1, 2], response_ids=[3], behaviour_logprobs=[0.0],
                   finish_reason="stop", group_id=0, routed_experts=record)


def test_gateway_chains_carry_their_routing_record(moe_parts):
    """The gateway's sessions (a harness on the OpenAI API) too: a chain's trajectory carries
    the record of its tokens, one entry per token, equal to the float32 trainer's routing
    wherever the engine fed a token, also after the harness rewrote its history."""
    model, tokenizer = moe_parts

    def agent(task, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": task["prompt"]}]
        for turn in range(3):
            reply = client.chat.completions.create(model="tiny", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"and {turn}?"}]
            if turn == 0:  # a summariser's rewrite: calls 1 and 2 are a new chain
                messages = [{"role": "user", "content": "summary: " + task["prompt"]}]
        return 1.0

    engine = HFEngine(copy.deepcopy(model), 16, tokenizer.pad_token_id, record_routing=True)
    gateway = Gateway(engine, tokenizer, "tiny",
                      SamplingParams(6, 1.0, 1.0, 0, (tokenizer.eos_token_id,)), 256)
    try:
        trajectories, stats = gateway_episodes(gateway, AgentSpec(entrypoint=agent,
                                                                  time_limit_s=60.0),
                                               [{"prompt": "2 + 3 = ?"}], 1, seed=0)
    finally:
        gateway.close()
    assert stats.chains == 2 and stats.faithful_calls == 3
    assert trajectories[-1].reward_info["lineage"]["calls"] == [1, 2]  # the trained chain
    for t, fed in zip(trajectories, fed_as_the_trainer_routes(model, tokenizer, trajectories),
                      strict=True):
        assert int(fed.sum()) == len(t.prompt_ids) + len(t.response_ids) - 1  # all but the last

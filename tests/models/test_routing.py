"""Routing replay on a tiny Qwen3-MoE: the engine records each token's experts, the trainer's
forward replays them (gradient still reaching the router), a record that does not fit the batch is
an error naming both shapes, and the router's auxiliary and z-losses."""

import copy

import pytest
import torch

from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.logprobs import batched_logprobs, forward_logprobs
from reroll.models.routing import (
    RoutingReplayError,
    agreement,
    recording,
    replaying,
    routed_forward,
    router_terms,
    routers,
)

pytestmark = pytest.mark.unit


def routing_of(model, ids):
    with recording(model) as recorder:
        model(input_ids=ids)
        return recorder.take().view(*ids.shape, len(routers(model)), -1)


def other_experts(record: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """Another valid routing: every expert index shifted by one."""
    return (record.long() + 1) % experts


def test_replayed_indices_are_the_recorded_ones_and_the_router_gets_gradient(moe):
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    own = routing_of(moe, ids)
    forced = other_experts(own)
    assert agreement(own, forced) == 0.0
    model = copy.deepcopy(moe).train()
    with replaying(model, forced):
        replayed = routing_of(model, ids)
        logits = model(input_ids=ids).logits
    assert torch.equal(replayed.long(), forced)
    logits.float().logsumexp(-1).sum().backward()
    for router in routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # -1 keeps the router's own choice; outside the block the model routes itself again
    with replaying(model, torch.full_like(forced, -1)):
        assert torch.equal(routing_of(model, ids), own)
    assert torch.equal(routing_of(model, ids), own)


def test_replaying_its_own_routing_changes_nothing(moe):
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    free, _ = forward_logprobs(moe, ids, mask)
    with replaying(moe, routing_of(moe, ids)):
        replayed, _ = forward_logprobs(moe, ids, mask)
    torch.testing.assert_close(free, replayed)


def test_a_record_that_does_not_fit_the_batch_is_an_error_naming_both(moe):
    ids = torch.randint(1, 64, (2, 5))
    record = routing_of(moe, ids)
    with pytest.raises(RoutingReplayError, match=r"10 tokens .* routes 12"), \
            replaying(moe, record):
        moe(input_ids=torch.randint(1, 64, (2, 6)))
    with pytest.raises(RoutingReplayError, match=r"shape \(2, 5, 3, 2\) .* 2 MoE layers"), \
            replaying(moe, torch.zeros(2, 5, 3, 2, dtype=torch.long)):
        pass
    response = torch.ones_like(ids, dtype=torch.float)
    with pytest.raises(RoutingReplayError, match="does not match the batch"):
        batched_logprobs(moe, ids, torch.ones_like(ids), 2, response_mask=response,
                         routed_experts=record[:, :4])


def test_the_engine_records_what_a_forward_of_the_same_tokens_routes(moe):
    engine = HFEngine(copy.deepcopy(moe), record_routing=True)
    requests = [Request([1, 5, 6, 7], SamplingParams(max_new_tokens=5), seed=s) for s in range(3)]
    requests.append(Request([2, 9], SamplingParams(max_new_tokens=5), seed=7))
    for completion in engine.generate_batch(requests):
        record = completion.routed_experts
        tokens = completion.prompt_ids + completion.token_ids
        assert record.shape == (len(tokens), 2, 2)
        assert (record[-1] == -1).all() and (record[:-1] >= 0).all()  # the last token is not fed
        # float32 engine, float32 forward: the same experts token for token
        own = routing_of(moe, torch.tensor([tokens]))[0]
        assert agreement(record[:-1], own[:-1]) == 1.0
    assert HFEngine(copy.deepcopy(moe)).generate_batch(requests[:1])[0].routed_experts is None


def test_router_losses_are_logged_and_differentiable(moe):
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    model = copy.deepcopy(moe)
    with routed_forward(model, None) as logits:
        model(input_ids=ids)
    aux, z = router_terms(model, logits, mask)
    # the load-balancing loss transformers trains with (its own function, unmasked)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    theirs = load_balancing_loss_func(tuple(logits), 4, 2)
    torch.testing.assert_close(aux.detach(), theirs.detach())
    by_hand = torch.stack([(torch.logsumexp(x, -1) ** 2).mean() for x in logits]).mean()
    torch.testing.assert_close(z.detach(), by_hand.detach())
    (aux + z).backward()
    assert all(r.weight.grad is not None for r in routers(model))


def test_batched_routing_is_the_forward_routing_and_marks_padding(moe):
    from reroll.models.routing import batched_routing

    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    routing = batched_routing(moe, ids, mask, micro_batch_size=2)
    assert routing.shape == (3, 6, 2, 2)
    assert torch.equal(routing[0], routing_of(moe, ids[:1])[0])
    assert torch.equal(routing[1, :4], routing_of(moe, ids[1:2, :4])[0])
    assert (routing[1, 4:] == -1).all()


def test_the_record_follows_each_row_through_continuous_batching(moe):
    """Rows join a running batch, end at different lengths and are compacted away: each
    completion's record is still its own tokens' routing."""
    import asyncio

    engine = HFEngine(copy.deepcopy(moe), max_batch_size=4, record_routing=True)

    async def go():
        first = [engine.generate(Request([1, 2, 3], SamplingParams(max_new_tokens=n), seed=n))
                 for n in (2, 3, 9, 9)]
        started = [asyncio.ensure_future(f) for f in first]
        await asyncio.sleep(0.01)
        later = [engine.generate(Request([4, 5, 6, 7, 8], SamplingParams(max_new_tokens=6),
                                         seed=s)) for s in (11, 12)]
        return await asyncio.gather(*started, *later)

    for completion in asyncio.run(go()):
        tokens = completion.prompt_ids + completion.token_ids
        own = routing_of(moe, torch.tensor([tokens]))[0]
        assert agreement(completion.routed_experts[:-1], own[:-1]) == 1.0

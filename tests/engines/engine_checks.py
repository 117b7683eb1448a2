"""Checks shared by the engine tests (imported from the test modules next to it)."""

import asyncio

import torch

from reroll.models.logprobs import forward_logprobs


def generate_all(engine, requests):
    """Every request sent to `engine` at once; completions in request order."""
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    return asyncio.run(go())


def assert_trainer_logprobs(completions, model, temperature: float, atol: float) -> None:
    """Each completion's behaviour logprobs are what the trainer computes for its tokens."""
    for out in completions:
        ids = torch.tensor([out.prompt_ids + out.token_ids])
        logprobs, _ = forward_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
        assert torch.allclose(logprobs[0, len(out.prompt_ids):], torch.tensor(out.logprobs),
                              atol=atol)

"""Engine against trainer on a mixture-of-experts model: do they route tokens alike, and what
does routing replay change?

The HF engine (in `engine_dtype`, recording its routing) samples responses to a few prompts; the
trainer's forward (float32, the rows right-padded in one batch, as `forward_logprobs` computes
pi_old) then scores them twice: routing afresh, and replaying the engine's routing
(`reroll.models.routing`). For each: the share of tokens routed to another expert set than the
engine's in at least one layer (every token the engine fed: prompts and responses but the last
token), and the per-token behaviour KL (k3 of the engine's sampling distribution against the
trainer's, over the response tokens, as `actor/behaviour_kl_k3` logs it) with its largest token.
Used by `reroll check-model` (its `routing` check) and `benchmarks/weight_sync.py --moe`.
Layer: beside `evaluation` (it uses models and engines).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from reroll import algorithms
from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.logprobs import forward_logprobs
from reroll.models.routing import recording, replaying, routers


def compare_routing(model: torch.nn.Module, prompts: list[list[int]], engine_dtype: torch.dtype,
                    tokens: int = 16, samples: int = 4, pad_token_id: int = 0) -> dict:
    """The figures above for `samples` responses of up to `tokens` tokens per prompt."""
    engine = HFEngine(copy.deepcopy(model), pad_token_id=pad_token_id, dtype=engine_dtype,
                      record_routing=True)
    params = SamplingParams(tokens, temperature=1.0)
    requests = [Request(p, params, seed=i * samples + s)
                for i, p in enumerate(prompts) for s in range(samples)]
    completions = engine.generate_batch(requests)
    ids, attention, response, behaviour, record = _rows(completions, pad_token_id)
    out = {"engine_dtype": str(engine_dtype).removeprefix("torch."), "responses": len(requests),
           "response_tokens": int(response.sum())}
    for name, replay in (("without", False), ("with_replay", True)):
        routed, logprobs = _trainer(model, ids, attention, record if replay else None)
        known = (record >= 0).all(-1).all(-1) & attention.bool()
        same = (routed.long().sort(-1).values == record.long().sort(-1).values).all(-1).all(-1)
        kl = algorithms.behaviour_kl_k3(logprobs, behaviour, response)
        out[f"routing_mismatch_{name}"] = float(1 - same[known].float().mean())
        out[f"behaviour_kl_{name}"] = float(algorithms.masked_mean(kl, response))
        out[f"behaviour_kl_max_{name}"] = float(kl.max())
    return out


def _rows(completions, pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """input_ids, attention, response mask, behaviour logprobs [B, L] and the engine's routing
    [B, L, layers, k] (-1 past each row's end), right-padded."""
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    shape = completions[0].routed_experts.shape[1:]
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros((len(completions), width))
    behaviour = torch.zeros((len(completions), width))
    record = torch.full((len(completions), width, *shape), -1, dtype=torch.int16)
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.prompt_ids) + len(c.token_ids)
        ids[i, :n] = torch.tensor(c.prompt_ids + c.token_ids)
        attention[i, :n] = 1
        response[i, p:n] = 1
        behaviour[i, p:n] = torch.tensor(c.logprobs)
        record[i, :n] = c.routed_experts
    return ids, attention, response, behaviour, record


@torch.no_grad()
def _trainer(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor,
             record: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's routing [B, L, layers, k] and logprobs [B, L] (`record` replayed if given)."""
    replay = replaying(model, record) if record is not None else contextlib.nullcontext()
    with replay, recording(model) as recorder:  # replay's hook first: the record sees its result
        logprobs, _ = forward_logprobs(model, ids, attention)
        routed = recorder.take()
    return routed.view(*ids.shape, len(routers(model)), -1), logprobs


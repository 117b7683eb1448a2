"""A teacher's top-k next-token distribution at every response position, and a student's
log-probabilities of given token ids there: the two sides of a dense (every-position)
distillation loss on the student's own samples (`algorithm.distill.mode: dense`).

Both score the response positions only (the prompts never reach the LM head), a chunk of
positions at a time from the final hidden states when the model's head is known
(`reroll.models.lm_head.OutputHead`), so a 49k-152k vocabulary is never held as [B, L, V] in
float32: the teacher keeps k numbers a position, and the student's chunks are recomputed in the
backward (`torch.utils.checkpoint`). Other models (or FSDP2-sharded ones) take the model's own
forward: logits of the response positions only, the reference path. Tensors are [B, L, ...]
aligned with `input_ids` like `reroll.models.logprobs` (position t: the distribution of token
t), 0 off the response.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from reroll.algorithms import entropy_from_logits
from reroll.models.lm_head import CHUNK_ELEMENTS, OutputHead


def _response_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, response_mask: torch.Tensor
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], OutputHead | None, torch.Tensor]:
    """((rows, cols) of the response tokens, the head or None, and [N, hidden] hidden states
    predicting them (with a head) or [N, V] logits (without))."""
    rows, cols = (response_mask.bool() & attention_mask.bool()).nonzero(as_tuple=True)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    head = OutputHead.of(model)
    if head is not None:
        hidden = head.hidden_states(input_ids, attention_mask, position_ids)
        return (rows, cols), head, hidden[rows, cols - 1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=False).logits
    return (rows, cols), None, logits[rows, cols - 1]


def _chunks(head: OutputHead | None, states: torch.Tensor) -> int:
    vocab = head.head.weight.shape[0] if head is not None else states.shape[-1]
    return max(1, CHUNK_ELEMENTS // vocab)


def _log_softmax(head: OutputHead | None, states: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    logits = (head.logits(states) if head is not None else states).float()
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, -1)


@torch.no_grad()
def teacher_top_k(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor, k: int, temperature: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L, k] long, logprobs [B, L, k] float32): the k likeliest next tokens at each
    response position and their log-probabilities under softmax(logits / temperature)."""
    (rows, cols), head, states = _response_logits(model, input_ids, attention_mask,
                                                  response_mask)
    ids = torch.zeros(*input_ids.shape, k, dtype=torch.long, device=input_ids.device)
    logprobs = torch.zeros(*input_ids.shape, k, dtype=torch.float32, device=input_ids.device)
    chunk = _chunks(head, states)
    for start in range(0, states.shape[0], chunk):
        top = _log_softmax(head, states[start:start + chunk], temperature).topk(k, dim=-1)
        where = rows[start:start + chunk], cols[start:start + chunk]
        ids[where], logprobs[where] = top.indices, top.values
    return ids, logprobs


def _gather_chunk(head: OutputHead | None, states: torch.Tensor, ids: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = _log_softmax(head, states, temperature)
    with torch.no_grad():
        entropy = entropy_from_logits(logprobs)
    return logprobs.gather(-1, ids), entropy


def logprobs_at(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_mask: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, L, j] of the token ids `ids` [B, L, j] at each response position, with
    gradients; entropy [B, L] of the whole distribution there, a metric without gradients)."""
    (rows, cols), head, states = _response_logits(model, input_ids, attention_mask,
                                                  response_mask)
    picked = ids[rows, cols]
    grad = torch.is_grad_enabled() and (states.requires_grad or head is not None and any(
        p.requires_grad for p in head.head.parameters()))
    chunk = _chunks(head, states)
    parts, entropies = [], []
    for start in range(0, states.shape[0], chunk):
        args = (head, states[start:start + chunk], picked[start:start + chunk], temperature)
        lp, ent = checkpoint(_gather_chunk, *args, use_reentrant=False,
                             preserve_rng_state=False) if grad and head is not None \
            else _gather_chunk(*args)
        parts.append(lp)
        entropies.append(ent)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    if parts:
        out = out.index_put((rows, cols), torch.cat(parts))
        entropy[rows, cols] = torch.cat(entropies)
    return out, entropy

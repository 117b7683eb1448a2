"""Logprobs and entropies from final hidden states, a chunk of positions at a time.

A causal LM's forward returns logits [tokens, vocab]: with a 49k-token vocabulary and 16x256
tokens that is 800 MB in float32 per copy, and the log-softmax, its exp and their gradients keep
several copies alive until the backward. Here the model's backbone returns hidden states
[tokens, hidden] (576 floats a token for SmolLM2-135M instead of 49,152), and the LM head,
temperature, log-softmax, gather and entropy run over chunks of `chunk_tokens` positions inside
`torch.utils.checkpoint`: the forward keeps only each chunk's outputs, and the backward
recomputes one chunk's logits at a time. The price is one more LM-head matmul per scored token,
paid only when there are several chunks (a single chunk's logits are kept for the backward).

`OutputHead.of(model)` says whether a model's logits are exactly `lm_head(last_hidden_state)`
(possibly scaled or soft-capped, applied here as its forward does); for any other model it is
None and callers use the model's own forward (`reroll.models.logprobs`' reference path).

A model sharded by FSDP2 gathers its root parameters (embeddings, final norm, LM head) only
inside its own forward, so its head cannot be called from outside. For those, `scoring_head`
swaps the LM head, for one forward, for a module that does the same chunked scoring from inside
that forward: the model then returns [positions, 2] (logprob, entropy) as its "logits".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from reroll.algorithms import entropy_from_logits

CHUNK_ELEMENTS = 2 ** 23
"""Logits per chunk (positions x vocabulary): 32 MB of float32, ~170 positions of a 49k
vocabulary. The chunk's log-softmax and entropy hold a few such tensors at once."""

PLAIN_HEADS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3",
    "olmo", "olmo2", "olmo3", "gpt2", "gpt_neox", "gemma", "smollm3", "starcoder2", "stablelm",
})
"""Model types whose `ForCausalLM.forward` computes `logits = lm_head(last_hidden_state)` and
nothing more (checked against transformers 5.19's modeling files)."""

SOFTCAPPED_HEADS = frozenset({"gemma2", "gemma3", "gemma3_text"})
"""`logits = cap * tanh(lm_head(h) / cap)` with `config.final_logit_softcapping` (when set)."""

SCALED_HEADS = {"cohere": "logit_scale", "cohere2": "logit_scale", "granite": "logits_scaling"}
"""`logits = lm_head(h) * config.logit_scale` (Cohere) or `/ config.logits_scaling` (Granite)."""


@dataclass(frozen=True)
class OutputHead:
    """How a model turns its last hidden state into logits: `scale * lm_head(h)`, then an
    optional tanh soft-cap."""

    backbone: torch.nn.Module
    head: torch.nn.Module
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> OutputHead | None:
        """The head of a known architecture, or None (unknown architecture, a model without
        separate backbone and head, or one sharded by FSDP2, whose root parameters are gathered
        only inside its own forward)."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type is None or _is_fsdp(model):
            return None
        backbone = getattr(model, "base_model", None)
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if get_head is not None else None
        if backbone is None or backbone is model or head is None:
            return None
        if model_type in PLAIN_HEADS:
            return cls(backbone, head)
        if model_type in SOFTCAPPED_HEADS:
            return cls(backbone, head, softcap=getattr(config, "final_logit_softcapping", None))
        if model_type in SCALED_HEADS:
            value = getattr(config, SCALED_HEADS[model_type], None)
            if value is None:
                return None
            return cls(backbone, head, value if model_type.startswith("cohere") else 1 / value)
        return None

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] final hidden states (after the last norm), as the LM head sees them."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=False).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, V] in the head's dtype, exactly as the model's forward makes them."""
        logits = self.head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def chunked_scores(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor,
                   temperature: float, with_entropy: bool, entropy_grad: bool,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, hidden] of the positions that predict `targets` [N] -> (logprobs [N],
    entropy [N] or None) of softmax(logits / temperature), without ever holding more than one
    chunk's logits. `entropy_grad=False` keeps the entropy out of the autograd graph."""
    vocab = head.head.weight.shape[0]
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or _head_requires_grad(head))
    # One chunk's logits are alive at the backward's peak either way (recomputed or kept), so
    # only several chunks gain from recomputing: one chunk skips checkpoint's extra head pass.
    recompute = grad and hidden.shape[0] > chunk
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        if recompute:
            lp, ent = checkpoint(_chunk_scores, head, h, t, temperature, with_entropy,
                                 entropy_grad, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _chunk_scores(head, h, t, temperature, with_entropy, entropy_grad)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:  # nothing to score
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def _chunk_scores(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor,
                  temperature: float, with_entropy: bool, entropy_grad: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: the same maths as the full-logits path (`picked_logprobs`, `entropy_from_logits`
    on float32 logits divided by the temperature)."""
    logits = head.logits(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
    return logprobs, entropy


class _ScoringHead(torch.nn.Module):
    """Stands in for a sharded model's LM head during one forward: scores the positions
    `select` of the hidden states it receives, predicting `targets`, in chunks."""

    def __init__(self, head: torch.nn.Module, select: tuple[torch.Tensor, torch.Tensor],
                 targets: torch.Tensor, temperature: float, with_entropy: bool, entropy_grad: bool):
        super().__init__()
        self.head = head  # the model's own module: FSDP2 swaps its gathered weight in and out
        self.select, self.targets = select, targets
        self.options = temperature, with_entropy, entropy_grad

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> [N, 2]: each selected position's logprob and entropy (0 without)."""
        logprobs, entropy = chunked_scores(OutputHead(self, self.head), hidden[self.select],
                                           self.targets, *self.options)
        return torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)],
                           dim=-1)


def sharded_plain_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head of an FSDP2-sharded model whose logits are exactly `lm_head(hidden)`, or
    None. (A scaled or soft-capped head post-processes the head's output in the model's forward,
    which the scoring head's output would not survive.)"""
    config = getattr(model, "config", None)
    if not _is_fsdp(model) or getattr(config, "model_type", None) not in PLAIN_HEADS:
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if get_head is not None else None


@contextlib.contextmanager
def scoring_head(model: torch.nn.Module, head: torch.nn.Module,
                 select: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor,
                 temperature: float, with_entropy: bool, entropy_grad: bool) -> Iterator[None]:
    """Within the block, `model(...).logits` is [N, 2]: logprob and entropy of the positions
    `select` (rows, cols of the [B, T] hidden states) predicting `targets` [N], computed by
    `chunked_scores` inside the model's forward, where FSDP2 has gathered the head's weight (the
    root stays gathered until its backward, which recomputes the chunks)."""
    model.set_output_embeddings(_ScoringHead(head, select, targets, temperature, with_entropy,
                                             entropy_grad))
    try:
        yield
    finally:
        model.set_output_embeddings(head)


def _head_requires_grad(head: OutputHead) -> bool:
    return any(p.requires_grad for p in head.head.parameters())


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(model, FSDPModule)


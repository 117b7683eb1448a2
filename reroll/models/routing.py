"""MoE routing: record the experts a forward routes each token to, and replay them (R3).

A mixture-of-experts layer sends each token to the `top_k` experts its router scores highest. An
engine in bf16 and a trainer in fp32 score almost alike, but where two experts are close they can
pick differently, and then the trainer's logprob is of another network than the one that sampled.
Routing replay records the engine's choices (`recording`) and forces them in the trainer's forward
(`replaying`), R3 in the literature.

The hook point is the router module (transformers' `Qwen3MoeTopKRouter`: `forward(hidden [N, H])
-> (router_logits [N, E], weights [N, k], indices [N, k])`, N every token of the forward's batch,
row by row). Replay replaces the indices and recomputes the weights from the current router logits
at the forced experts (softmax, then renormalised over the k when the config says so, as the router
does): the experts the token goes to are the recorded ones, but their mixing weights stay a
function of the router, so the router still gets its gradient. (Detaching the weights, or taking
the recorded ones, would freeze the router for the replayed tokens.)

A record is an int tensor [tokens, layers, top_k]; -1 marks a token without a record (padding,
the completion's last token, which no engine forward saw): the router's own choice stands there.
Layer: models (imports torch only; transformers is duck-typed by the router's attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

NO_RECORD = -1


class RoutingReplayError(ValueError):
    """A routing record that does not fit the forward it is replayed into."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model). A router is a module
    with `top_k`, `num_experts` and a `weight` [E, H]: transformers' Qwen3-MoE family."""
    return [m for m in model.modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(
                getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() == 2]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(routers(model))


def top_k(model: torch.nn.Module) -> int:
    found = routers(model)
    return int(found[0].top_k) if found else 0


class Recorder:
    """A running record for an engine: after each model forward `take()` returns that forward's
    routed experts [N, layers, k] (None for a dense model). Hooks stay on until `close()`."""

    def __init__(self, model: torch.nn.Module):
        self._routers = routers(model)
        self._calls: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._record) for r in self._routers]

    def _record(self, module, args, output) -> None:
        self._calls.append(output[2].detach().to("cpu", torch.int16))

    def take(self) -> torch.Tensor | None:
        if not self._routers:
            return None
        if len(self._calls) != len(self._routers):
            self._calls.clear()
            raise RuntimeError("routing recorder: a forward did not call every router once")
        record = torch.stack(self._calls, dim=1)
        self._calls.clear()
        return record

    def discard(self) -> None:
        self._calls.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[Recorder]:
    """A `Recorder` on `model` for the block."""
    recorder = Recorder(model)
    try:
        yield recorder
    finally:
        recorder.close()


@contextlib.contextmanager
def replaying(model: torch.nn.Module, record: torch.Tensor) -> Iterator[None]:
    """Force the routing of the next forward(s) of `model` to `record`: [B, L, layers, k] aligned
    with the forward's input_ids [B, L] (or [N, layers, k] with N = B*L). Entries of -1 keep the
    router's own choice. A record whose token count, layer count or top-k does not fit the forward
    is a `RoutingReplayError` naming both shapes."""
    found = routers(model)
    if not found:
        raise RoutingReplayError("routing replay needs a mixture-of-experts model; this one has "
                                 "no router")
    flat = record.reshape(-1, *record.shape[-2:]) if record.dim() == 4 else record
    if flat.dim() != 3 or flat.shape[1] != len(found) or flat.shape[2] != found[0].top_k:
        raise RoutingReplayError(
            f"routing record of shape {tuple(record.shape)} does not fit the model: it has "
            f"{len(found)} MoE layers with top_k {found[0].top_k} ([tokens, layers, top_k])")
    handles = [r.register_forward_hook(_forcing(flat[:, i], i)) for i, r in enumerate(found)]
    model._reroll_replaying = True  # forward_logprobs keeps the rows unpacked (see `replay_on`)
    try:
        yield
    finally:
        model._reroll_replaying = False
        for h in handles:
            h.remove()


def replay_on(model: torch.nn.Module) -> bool:
    """Whether a `replaying` block is active on `model` (packing would reorder its tokens)."""
    return bool(getattr(model, "_reroll_replaying", False))


def _forcing(indices: torch.Tensor, layer: int):
    def force(module, args, output):
        router_logits, _, own = output
        if router_logits.shape[0] != indices.shape[0]:
            raise RoutingReplayError(
                f"routing record has {indices.shape[0]} tokens for MoE layer {layer}, the forward "
                f"routes {router_logits.shape[0]} (the record does not match the batch)")
        forced = indices.to(own.device, own.dtype)
        chosen = torch.where(forced >= 0, forced, own)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, chosen)
        if getattr(module, "norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), chosen
    return force


def joined_record(ids: list[int], calls: list[tuple[list[int], torch.Tensor | None]]
                  ) -> torch.Tensor | None:
    """One record [len(ids), layers, k] for a sequence that several engine calls built in turn
    (a multi-turn episode: each turn's request is the tokens so far). `calls`: per call, in call
    order, the tokens it fed and produced (its request, then its completion) and its record of
    them (`Completion.routed_experts`; None: none recorded). Each call's tokens must be a prefix
    of `ids`.

    Each position takes the routing of the first call that fed it: a turn's sampled tokens were
    scored with that call's routing of them, while a later turn's prefill re-encodes them and
    may route a near-tie otherwise. Positions no call fed (the last sampled token, an
    observation no turn read) stay -1. None when no call has a record. A call whose tokens are
    not a prefix of `ids`, or whose record is not as long as its tokens or of another
    [layers, k], is a `RoutingReplayError`."""
    records = [(k, tokens, record) for k, (tokens, record) in enumerate(calls)
               if record is not None]
    if not records:
        return None
    shape = records[0][2].shape[1:]
    out = torch.full((len(ids), *shape), NO_RECORD, dtype=records[0][2].dtype)
    for k, tokens, record in records:
        if record.shape != (len(tokens), *shape):
            raise RoutingReplayError(
                f"routing record of call {k} has shape {tuple(record.shape)}; its request and "
                f"completion hold {len(tokens)} tokens, the first record is "
                f"[tokens, {', '.join(map(str, shape))}]")
        if ids[:len(tokens)] != tokens:
            raise RoutingReplayError(
                f"call {k}'s {len(tokens)} tokens are not a prefix of the sequence's "
                f"{len(ids)}: its routing record would not line up with the sequence")
        head = out[:len(tokens)]
        head.copy_(torch.where(head >= 0, head, record.to(out.dtype)))
    return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (token, layer) pairs whose top-k expert sets are equal; a, b [..., layers, k]
    (order within the k ignored; tokens where either has -1 left out)."""
    a, b = a.reshape(-1, a.shape[-1]).long(), b.reshape(-1, b.shape[-1]).long()
    known = (a >= 0).all(-1) & (b >= 0).all(-1)
    if not bool(known.any()):
        return 1.0
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return float(same[known].float().mean())


def token_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens whose experts are the same in every layer; a, b [tokens, layers, k]."""
    known = (a >= 0).all(-1).all(-1) & (b >= 0).all(-1).all(-1)
    if not bool(known.any()):
        return 1.0
    same = (a.long().sort(-1).values == b.long().sort(-1).values).all(-1).all(-1)
    return float(same[known].float().mean())


def router_losses(router_logits: list[torch.Tensor], top_k: int, num_experts: int,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing auxiliary loss, z-loss) over the layers' router logits [N, E] each.

    The auxiliary loss is the Switch-Transformer one transformers trains with
    (`load_balancing_loss_func`, all layers' tokens together: E * sum over the k choices and the
    experts of tokens_share * prob_share); the z-loss (ST-MoE) is the mean over tokens and layers
    of logsumexp(logits)^2. `mask` [N] (1 on real tokens) leaves padding out of both."""
    logits = torch.cat([x.float() for x in router_logits])  # [layers * N, E]
    keep = torch.ones(logits.shape[0], device=logits.device) if mask is None \
        else mask.reshape(-1).to(logits.device).float().repeat(len(router_logits))
    denom = keep.sum().clamp(min=1)
    probs = torch.softmax(logits, -1)
    chosen = torch.nn.functional.one_hot(torch.topk(probs, top_k, -1).indices, num_experts)
    tokens_share = (chosen.float() * keep[:, None, None]).sum(0) / denom  # [k, E]
    prob_share = (probs * keep[:, None]).sum(0) / denom  # [E]
    aux = num_experts * (tokens_share * prob_share[None]).sum()
    z = (torch.logsumexp(logits, -1) ** 2 * keep).sum() / denom
    return aux, z


@contextlib.contextmanager
def router_logits_of(model: torch.nn.Module, out: list[torch.Tensor]) -> Iterator[None]:
    """Append each router's logits [N, E] (in the autograd graph) to `out` during the block."""
    handles = [r.register_forward_hook(lambda m, a, o: out.append(o[0])) for r in routers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def routed_forward(model: torch.nn.Module, record: torch.Tensor | None
                   ) -> Iterator[list[torch.Tensor]]:
    """The block's forwards with `record` replayed (None: routed afresh); yields the list the
    routers' logits are appended to (empty for a dense model), for `router_losses`."""
    logits: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        if record is not None:
            stack.enter_context(replaying(model, record))
        if is_moe(model):
            stack.enter_context(router_logits_of(model, logits))
        yield logits


def router_terms(model: torch.nn.Module, logits: list[torch.Tensor], attention: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_losses` of a forward's router logits, padding left out when the forward was
    unpacked (its tokens are `attention`'s)."""
    found = routers(model)
    mask = attention if logits[0].shape[0] == attention.numel() else None
    return router_losses(logits, int(found[0].top_k), int(found[0].num_experts), mask)


@torch.no_grad()
def batched_routing(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """The routing [B, L, layers, k] the model gives a right-padded batch now (-1 on padding),
    in micro-batches: pi_old's routing, for `algorithm.routing_replay: old_policy`."""
    found = routers(model)
    out = torch.full((*input_ids.shape, len(found), int(found[0].top_k)), NO_RECORD,
                     dtype=torch.int16)
    device = next(model.parameters()).device
    for start in range(0, input_ids.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        width = int(attention_mask[rows].sum(-1).max())
        mask = attention_mask[rows, :width]
        with recording(model) as recorder:
            model(input_ids=input_ids[rows, :width].to(device), attention_mask=mask.to(device),
                  position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0).to(device),
                  use_cache=False)
            routed = recorder.take().view(*mask.shape, *out.shape[2:])
        out[rows, :width] = routed.masked_fill(~mask.bool()[..., None, None], NO_RECORD)
    return out

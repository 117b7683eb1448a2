"""Per-token log-probabilities and entropies of a causal LM over a padded batch.

Conventions used across reroll: tensors are [B, L] aligned with `input_ids`; the value at
position t is about token t given tokens < t (so position 0 is always 0). Logits are divided by
the sampling temperature first, so trainer logprobs match the engine's behaviour logprobs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from tensordict import TensorDict

from reroll.algorithms import entropy_from_logits
from reroll.data.batch import model_kwargs
from reroll.models.lm_head import OutputHead, chunked_scores, scoring_head, sharded_plain_head
from reroll.models.packing import (
    MASKED_ATTENTION,
    PackedBatch,
    pack_shared_prefixes,
    packed_masks,
    supports_packing,
)
from reroll.models.routing import replay_on, replaying


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, K, V] (already temperature-scaled) of the last K positions, input_ids [B, L] ->
    logprobs [B, L]; positions before L-K+1 (whose logits were not computed) are 0."""
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    first = input_ids.shape[1] - logits.shape[1] + 1
    logprobs[:, first:] = picked_logprobs(logits[:, :-1].float(), input_ids[:, first:])
    return logprobs


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] over the last dim: logits [..., V], targets [...]."""
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _entropy_grad(enabled: bool) -> contextlib.AbstractContextManager:
    """The entropy in the autograd graph (a bonus in the loss) or outside it (a metric)."""
    return contextlib.nullcontext() if enabled else torch.no_grad()


def aligned_entropy(logits: torch.Tensor, length: int) -> torch.Tensor:
    """logits [B, K, V] of the last K of `length` positions -> entropy [B, length] of the
    next-token distribution, aligned like logprobs (position t holds the entropy of the
    distribution that produced token t; positions without logits are 0)."""
    entropy = torch.zeros((logits.shape[0], length), dtype=torch.float32, device=logits.device)
    entropy[:, length - logits.shape[1] + 1:] = entropy_from_logits(logits[:, :-1].float())
    return entropy


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `model`; only keys tied to another weight (lm_head) may be missing."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or [key for key in missing if key not in tied]:
        raise ValueError(f"{source} does not fit the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")


def forward_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     temperature: float = 1.0, with_entropy: bool = False,
                     response_mask: torch.Tensor | None = None, entropy_grad: bool = True,
                     chunked: bool = True, model_inputs: dict[str, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model on a right-padded batch; returns (logprobs [B, L], entropy [B, L] or None).

    With `response_mask`, only the positions a trainer reads are scored: from the batch's first
    response token on (earlier ones are 0), so the LM head and softmax skip the prompts, which
    for a large vocabulary is much of the memory; and rows that share their prompt (a GRPO
    group) are forwarded as one packed row (`reroll.models.packing`), the prompt once.
    `entropy_grad=False` computes the entropy as a metric only, outside the autograd graph.

    `chunked` (the default) scores from the final hidden states a chunk of positions at a time
    (`reroll.models.lm_head`), never holding the full-vocabulary logits, for the architectures
    whose head it knows (sharded by FSDP2 too: then from inside the model's forward); there
    padding positions (attention 0) are 0. `chunked=False`, or an unknown architecture, takes
    the model's own forward and its logits: the reference path.

    `model_inputs` (the batch's inputs beyond tokens, as `reroll.data.batch.model_kwargs` gives
    them: an image's pixel values...) go to the model's forward, on the reference path without
    position ids: such a model places its image features by the image tokens of each row and
    computes its own positions from them (Qwen2-VL's M-RoPE), which a packed row (several rows'
    images, a custom mask and positions) or a backbone called without the images would bypass;
    so packing and the chunked head are off for these batches, and for every batch of such a
    model (`placeholder_ids`)."""
    if model_inputs or placeholder_ids(model):
        return _forward_with_inputs(model, input_ids, attention_mask, model_inputs, temperature,
                                    with_entropy, response_mask, entropy_grad)
    head = OutputHead.of(model) if chunked else None
    sharded_head = sharded_plain_head(model) if chunked and head is None else None
    scores = functools.partial(_chunked_scores, model, head, sharded_head,
                               shape=input_ids.shape, temperature=temperature,
                               with_entropy=with_entropy, entropy_grad=entropy_grad)
    if response_mask is not None and supports_packing(model) and not replay_on(model):
        packed = pack_shared_prefixes(input_ids, attention_mask, response_mask,
                                      getattr(model.config, "hidden_size", 0))
        if packed is not None and head is None and sharded_head is None:
            return _packed_forward(model, packed, input_ids.shape, temperature, with_entropy,
                                   entropy_grad)
        if packed is not None:
            return scores(packed.input_ids, _packed_mask(model, packed), packed.position_ids,
                          select=(packed.source_row, packed.source_col),
                          targets=packed.target_ids, where=(packed.target_row, packed.target_col))
    first_position = 1 if response_mask is None else first_response_position(response_mask)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if head is not None or sharded_head is not None:
        scored = attention_mask.bool().clone()
        scored[:, :first_position] = False
        rows, cols = scored.nonzero(as_tuple=True)
        return scores(input_ids, attention_mask, position_ids, select=(rows, cols - 1),
                      targets=input_ids[rows, cols], where=(rows, cols))
    keep = {} if first_position <= 1 else {"logits_to_keep": input_ids.shape[1] - first_position + 1}
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=False, **keep).logits
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = token_logprobs_from_logits(logits, input_ids)
    entropy = None
    if with_entropy:
        with _entropy_grad(entropy_grad):
            entropy = aligned_entropy(logits, input_ids.shape[1])
    return logprobs, entropy


def _forward_with_inputs(model: torch.nn.Module, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None,
                         temperature: float, with_entropy: bool,
                         response_mask: torch.Tensor | None, entropy_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_logprobs` of a batch with model inputs beyond tokens, or of a vision-language
    model: the model's own forward, its placeholder tokens out of the distribution (logprob 0
    where one is the target: a prompt's image, never a sampled token)."""
    first_position = 1 if response_mask is None else first_response_position(response_mask)
    keep = {} if first_position <= 1 else {"logits_to_keep": input_ids.shape[1] - first_position + 1}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   **(model_inputs or {}), **keep).logits
    placeholders = placeholder_ids(model)
    logits = without_placeholders(logits, placeholders)
    if temperature != 1.0:
        logits = logits / temperature
    entropy = None
    if with_entropy:
        with _entropy_grad(entropy_grad):
            entropy = aligned_entropy(logits, input_ids.shape[1])
    logprobs = token_logprobs_from_logits(logits, input_ids)
    if placeholders:
        logprobs = logprobs.masked_fill(torch.isin(input_ids, torch.tensor(
            placeholders, device=input_ids.device)), 0.0)
    return logprobs, entropy


def placeholder_ids(model: torch.nn.Module) -> list[int]:
    """A vision-language model's image (and video) placeholder token ids: where its processor
    puts an image, never an action of the policy. The engine never samples them and the
    trainer's logprobs leave them out alike, so both see one distribution (a random-init VLM
    would otherwise sample one, and the trainer's forward would look for its image)."""
    return config_placeholder_ids(getattr(model, "config", None))


def config_placeholder_ids(config) -> list[int]:
    """`placeholder_ids` from a model's config (an engine that holds no transformers model)."""
    found = (getattr(config, name, None) for name in ("image_token_id", "video_token_id"))
    return [i for i in found if isinstance(i, int)]


def without_placeholders(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """`logits` [..., V] with the `ids` columns at -inf (none: unchanged)."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), float("-inf"))


def _packed_forward(model: torch.nn.Module, packed: PackedBatch, shape: torch.Size,
                    temperature: float, with_entropy: bool, entropy_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_logprobs` through a packing: logits of the packed positions that predict a
    scored token, scattered back to [B, L]."""
    width = packed.input_ids.shape[1]
    keep = width - int(packed.source_col.min())
    logits = model(input_ids=packed.input_ids, attention_mask=_packed_mask(model, packed),
                   position_ids=packed.position_ids, use_cache=False, logits_to_keep=keep).logits
    logits = logits[packed.source_row, packed.source_col - (width - keep)].float()  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    where = packed.target_row, packed.target_col

    def scattered(values: torch.Tensor) -> torch.Tensor:  # [N] -> [B, L], 0 elsewhere
        return torch.zeros(shape, dtype=torch.float32, device=logits.device).index_put(where, values)

    logprobs = scattered(picked_logprobs(logits, packed.target_ids))
    entropy = None
    if with_entropy:
        with _entropy_grad(entropy_grad):
            entropy = scattered(entropy_from_logits(logits))
    return logprobs, entropy


def _packed_mask(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    mask_dtype = MASKED_ATTENTION[model.config._attn_implementation]
    return packed_masks(model.config, packed, mask_dtype or next(model.parameters()).dtype)


def _chunked_scores(model: torch.nn.Module, head: OutputHead | None,
                    sharded_head: torch.nn.Module | None, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                    select: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor,
                    where: tuple[torch.Tensor, torch.Tensor], shape: torch.Size,
                    temperature: float, with_entropy: bool, entropy_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked scores of the final hidden states at `select` (rows, cols) predicting `targets`
    [N], scattered to [B, L] at `where`, 0 elsewhere: from the backbone's hidden states
    (`head`), or inside the forward of a model sharded by FSDP2 (`sharded_head`)."""
    if head is not None:
        hidden = head.hidden_states(input_ids, attention_mask, position_ids)
        logprobs, entropy = chunked_scores(head, hidden[select], targets, temperature,
                                           with_entropy, entropy_grad)
    else:
        with scoring_head(model, sharded_head, select, targets, temperature, with_entropy,
                          entropy_grad):
            scores = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False).logits
        logprobs, entropy = scores[:, 0], (scores[:, 1] if with_entropy else None)

    def scattered(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=input_ids.device).index_put(where, values)

    return scattered(logprobs), (scattered(entropy) if entropy is not None else None)


def first_response_position(response_mask: torch.Tensor) -> int:
    """The earliest response token over the rows of [B, L] (1 when there is none)."""
    rows = response_mask.any(-1)
    if not bool(rows.any()):
        return 1
    return max(1, int(response_mask[rows].float().argmax(-1).min()))


def trimmed_micro_batches(attention_mask: torch.Tensor, micro_batch_size: int
                          ) -> list[tuple[slice, int]]:
    """(rows, width) of each micro-batch of a right-padded batch: its row slice and its longest
    row's length (the padding all its rows share is trimmed)."""
    return [(rows, int(attention_mask[rows].sum(-1).max()))
            for rows in (slice(start, start + micro_batch_size)
                         for start in range(0, attention_mask.shape[0], micro_batch_size))]


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     micro_batch_size: int, temperature: float = 1.0,
                     response_mask: torch.Tensor | None = None,
                     model_inputs: TensorDict | None = None,
                     routed_experts: torch.Tensor | None = None) -> torch.Tensor:
    """`forward_logprobs` without gradients over micro-batches of a large batch -> [B, L]
    (with `response_mask`: from each row's first response token on, see `forward_logprobs`;
    `model_inputs`: the batch's field of that name, each micro-batch's rows passed on; with
    `routed_experts` [B, L, layers, k]: that routing replayed, `reroll.models.routing`)."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    device = next(model.parameters()).device  # inputs go to the model, results come back
    for rows, width in trimmed_micro_batches(attention_mask, micro_batch_size):
        response = None if response_mask is None else response_mask[rows, :width].to(device)
        extra = {} if model_inputs is None else model_kwargs(
            TensorDict({"model_inputs": model_inputs[rows]}, batch_size=[]), device)
        replay = contextlib.nullcontext() if routed_experts is None \
            else replaying(model, routed_experts[rows, :width])
        with replay:
            logprobs, _ = forward_logprobs(model, input_ids[rows, :width].to(device),
                                           attention_mask[rows, :width].to(device), temperature,
                                           response_mask=response, model_inputs=extra)
        out[rows, :width] = logprobs.to(out.device)
    return out

"""`reroll check-model DIR --diagnose`: where do the engine's and the trainer's numbers part?

The same token rows (one chat prompt, several responses of different lengths, as a GRPO group)
go through the trainer's forward (float32, as training computes logprobs: the rows right-padded
in one batch, or packed with the prompt once, `models/packing.py`) and through the HF engine's
model (in the engine's dtype, the rows prefilled `batch_size` at a time, right-padded). Forward
hooks record every module's output at the positions that predict a response token, so each
module of the trainer is compared with the same module of the engine, in the order the trainer
ran them; the first whose outputs differ by more than `tolerance` (relative to the output's
largest value) is where the two part, and the one whose difference is the largest multiple of
any before it is where the most new error enters. The sweep covers what users change: the engine's dtype,
its batch size and the trainer's layout, and on a mixture-of-experts model routing replay off
or on (`algorithm.routing_replay`): the engine's forward records each token's experts and the
trainer's routes afresh or replays them (`reroll.models.routing`; replay keeps the rows padded,
as training does), with the share of tokens the two route to another expert set. The logprob
columns are what `behaviour_kl` and the importance ratios of a run see.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from reroll.models import routing
from reroll.models.loading import DTYPES, load_model, load_tokenizer
from reroll.models.logprobs import _packed_mask, picked_logprobs
from reroll.models.packing import pack_shared_prefixes, supports_packing

Index = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Diagnosis:
    engine_dtype: str
    batch_size: int
    layout: str
    first_parting: str
    """The first module (in the trainer's order) whose output parts, or `none`."""
    parting_rel_diff: float
    """Its largest difference over its largest value (0 when none parts)."""
    largest_growth: str
    """The module (after the first parting) whose difference is the largest multiple of any
    before it (`growth_factor`), or `none`: where the most new error enters."""
    growth_factor: float
    logprob_max_abs_diff: float
    logprob_mean_abs_diff: float
    ratio_outside: float
    """Share of response tokens whose ratio exp(engine - trainer) leaves [0.9, 1.1]."""
    routing_replay: str = "n/a"
    """`off` (the trainer routes afresh) or `on` (it replays the engine's routing) on a
    mixture-of-experts model; `n/a` on a dense one."""
    routing_mismatch: float | None = None
    """Share of the compared positions whose experts differ from the engine's in at least one
    layer (None on a dense model)."""


ROUTING_SKIPPED = "dense model: no experts to route"
"""What the table says of routing replay on a model without routers."""


def rows(path: str, group: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids [B, L] right-padded, attention_mask, prompt length): a chat prompt and `group`
    responses of random tokens of different lengths."""
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    lengths = [8 + 3 * i for i in range(group)]
    width = len(prompt) + max(lengths)
    ids = torch.full((group, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        row = prompt + torch.randint(3, len(tokenizer) - 1, (n,), generator=g).tolist()
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return ids, mask, len(prompt)


@contextlib.contextmanager
def recording(model: torch.nn.Module, out: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Every module's output (its first tensor) of each forward call, appended under its name
    (dicts keep the order the modules first ran)."""
    def hook(name):
        def record(module, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                out.setdefault(name, []).append(tensor.detach().float())
        return record
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _targets(mask: torch.Tensor, prompt: int) -> tuple[Index, Index]:
    """(rows, columns predicting a response token), (rows, the tokens' columns)."""
    scored = mask.bool().clone()
    scored[:, :prompt] = False
    r, c = scored.nonzero(as_tuple=True)
    return (r, c - 1), (r, c)


def _at(outputs: dict[str, list[torch.Tensor]], where: Index, rows_: int
        ) -> dict[str, torch.Tensor]:
    """Each module's outputs (batches concatenated) at `where`, for outputs laid out
    [rows, seq, ...]; other layouts are left out."""
    picked = {}
    for name, parts in outputs.items():
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            continue
        full = torch.cat(parts)
        if full.shape[0] == rows_ and full.dim() >= 3:
            picked[name] = full[where]
    return picked


def trainer_side(model, ids, mask, prompt: int, layout: str,
                 replay: torch.Tensor | None = None) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """(module outputs at the predicting positions, logprobs of the response tokens, the experts
    [positions, layers, k] routed there, None for a dense model); `replay`: the engine's routing
    [B, L, layers, k] forced (padded layout only, as training keeps replayed rows unpacked)."""
    (sr, sc), (tr, tc) = _targets(mask, prompt)
    outputs: dict[str, list[torch.Tensor]] = {}
    forced = contextlib.nullcontext() if replay is None else routing.replaying(model, replay)
    # replay's hook first: the routing record sees the experts it forced
    with torch.no_grad(), forced, routing.recording(model) as routed, recording(model, outputs):
        if layout == "packed":
            response = mask.clone()
            response[:, :prompt] = 0
            packed = pack_shared_prefixes(ids, mask, response)
            if packed is None:
                raise ValueError("the rows do not pack (no shared prompt)")
            logits = model(input_ids=packed.input_ids, attention_mask=_packed_mask(model, packed),
                           position_ids=packed.position_ids, use_cache=False).logits
            # the packing's predictions put in the padded one's order (row by row)
            order = torch.argsort(packed.target_row * ids.shape[1] + packed.target_col)
            where = packed.source_row[order], packed.source_col[order]
            shape = packed.input_ids.shape
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=False).logits
            where, shape = (sr, sc), ids.shape
        experts = routed.take()
    logprobs = picked_logprobs(logits[where].float(), ids[tr, tc])
    if experts is not None:
        experts = experts.view(*shape, *experts.shape[1:])[where]
    return _at(outputs, where, shape[0]), logprobs, experts


def engine_side(model, ids, mask, prompt: int, batch_size: int
                ) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """(module outputs at the predicting positions, logprobs of the response tokens, the
    engine's routing [B, L, layers, k] with -1 on padding, None for a dense model)."""
    (sr, sc), (tr, tc) = _targets(mask, prompt)
    outputs: dict[str, list[torch.Tensor]] = {}
    logits, experts = [], []
    with torch.no_grad(), routing.recording(model) as routed, recording(model, outputs):
        for start in range(0, ids.shape[0], batch_size):
            b_ids, b_mask = ids[start:start + batch_size], mask[start:start + batch_size]
            positions = (b_mask.cumsum(-1) - 1).clamp(min=0)
            logits.append(model(input_ids=b_ids, attention_mask=b_mask, position_ids=positions,
                                use_cache=False).logits.float())
            taken = routed.take()
            if taken is not None:
                taken = taken.view(*b_ids.shape, *taken.shape[1:])
                experts.append(taken.masked_fill(~b_mask.bool()[..., None, None],
                                                 routing.NO_RECORD))
    logprobs = picked_logprobs(torch.cat(logits)[sr, sc], ids[tr, tc])
    return _at(outputs, (sr, sc), ids.shape[0]), logprobs, torch.cat(experts) if experts else None


def compare(trainer: tuple, engine: tuple, tolerance: float
            ) -> tuple[str, float, str, float, torch.Tensor]:
    """(first parting module, its relative difference, the module that grows the difference
    most and by what factor, per-token logprob difference)."""
    first, rel, growth, factor, worst = "none", 0.0, "none", 1.0, 0.0
    for name, ours in trainer[0].items():
        theirs = engine[0].get(name)
        if theirs is None or theirs.shape != ours.shape:
            continue
        diff = float((ours - theirs).abs().max() / ours.abs().max().clamp(min=1e-12))
        if first == "none" and diff > tolerance:
            first, rel = name, diff
        elif first != "none" and diff / worst > factor:
            growth, factor = name, diff / worst
        worst = max(worst, diff)
    return first, rel, growth, factor, engine[1] - trainer[1]


def routing_mismatch(trainer: tuple, engine: tuple, mask: torch.Tensor, prompt: int
                     ) -> float | None:
    """Share of the predicting positions routed to another expert set than the engine's in at
    least one layer (None for a dense model)."""
    if engine[2] is None:
        return None
    (sr, sc), _ = _targets(mask, prompt)
    return 1 - routing.token_agreement(trainer[2], engine[2][sr, sc])


def diagnose(path: str, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
             batch_sizes: tuple[int, ...] = (1, 4), tolerance: float = 1e-3,
             attn_implementation: str = "auto") -> list[Diagnosis]:
    """The sweep's table: one row per engine dtype x engine batch size x trainer layout, and on
    a mixture-of-experts model one more per dtype x batch size with routing replay on."""
    ids, mask, prompt = rows(path, group=max(batch_sizes))
    trainer_model = load_model(path, "float32", attn_implementation).eval()
    layouts = ["padded"] + (["packed"] if supports_packing(trainer_model) else [])
    trainers = {layout: trainer_side(trainer_model, ids, mask, prompt, layout)
                for layout in layouts}
    moe = routing.is_moe(trainer_model)
    table = []
    for dtype in dtypes:
        engine_model = copy.deepcopy(trainer_model).to(DTYPES[dtype])
        for batch_size in batch_sizes:
            engine = engine_side(engine_model, ids, mask, prompt, batch_size)
            sides = [(layout, "off" if moe else "n/a", trainers[layout]) for layout in layouts]
            if moe:  # the engine's routing replayed in the trainer's (padded) forward
                sides.append(("padded", "on", trainer_side(trainer_model, ids, mask, prompt,
                                                           "padded", replay=engine[2])))
            for layout, replay, trainer in sides:
                first, rel, growth, factor, delta = compare(trainer, engine, tolerance)
                ratio = delta.exp()
                table.append(Diagnosis(
                    dtype, batch_size, layout, first, rel, growth, factor,
                    float(delta.abs().max()),
                    float(delta.abs().mean()),
                    float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
                    replay, routing_mismatch(trainer, engine, mask, prompt)))
    return table


def as_dicts(table: list[Diagnosis]) -> list[dict]:
    return [asdict(row) for row in table]

"""The transformers engine: batched sampling with a KV cache, in-process.

Requests that arrive together are decoded together (left-padded, grouped by sampling settings).
Each row samples with its own seeded generator (Gumbel-max over the filtered logits), so a
request's sample is reproducible whatever else is in its batch. Rows that finish leave the batch
(their KV cache rows are dropped), so a long-tailed batch does not pay for finished rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from reroll.engines.base import (
    Completion,
    EngineStats,
    LoadMeter,
    Request,
    SamplingParams,
    fingerprint,
)
from reroll.models.logprobs import load_weights

_DONE = object()


@dataclass
class _Row:
    request: Request
    generator: torch.Generator | None
    tokens: list[int]
    logprobs: list[float]
    finish: str | None = None


class HFEngine:
    """Engine over a transformers causal LM that it owns (its weights arrive via `load_weights`)."""

    def __init__(self, model: torch.nn.Module, max_batch_size: int = 256, pad_token_id: int = 0):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.version = 0
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._aborted: set[str] = set()
        self._worker: asyncio.Task | None = None
        self.generated_tokens = 0
        self.meter = LoadMeter()
        self._device_when_awake: torch.device | None = None

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self.meter.started()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        tokens = 0
        try:
            completion = await future
            tokens = len(completion.token_ids)
            return completion
        finally:
            self.meter.finished(tokens)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        load_weights(self.model, dict(named_tensors), "the weights sent to the engine")
        self.version = version

    def weights_fingerprint(self) -> str:
        return fingerprint(self.model.state_dict().items())

    # -- colocation, load, shutdown ---------------------------------------------------------------

    def sleep(self) -> None:
        """On an accelerator, move the weights to CPU memory and free the cache (the KV cache is
        per batch and already gone between batches). On CPU there is nothing to free."""
        device = next(self.model.parameters()).device
        if device.type != "cpu":
            self._device_when_awake = device
            self.model.to("cpu")
            torch.cuda.empty_cache() if device.type == "cuda" else None

    def wake(self) -> None:
        if self._device_when_awake is not None:
            self.model.to(self._device_when_awake)
            self._device_when_awake = None

    def stats(self) -> EngineStats:
        """`queued` counts requests waiting for a batch and those decoding."""
        return self.meter.stats()

    def close(self) -> None:
        """Nothing to release: the engine lives in this process."""

    shutdown = close

    # -- batching --------------------------------------------------------------------------------

    async def _serve(self) -> None:
        await asyncio.sleep(0)  # let every request submitted in this tick join the first batch
        while self._pending:
            oldest = self._pending[0][0]
            same = [(r, f) for r, f in self._pending
                    if _batch_key(r.params) == _batch_key(oldest.params)]
            batch = _similar_lengths(same, len(oldest.prompt_ids), self.max_batch_size)
            taken = {id(f) for _, f in batch}
            self._pending = [(r, f) for r, f in self._pending if id(f) not in taken]
            try:
                # Decode on this thread, one step at a time, handing the loop back between
                # steps (aborts, new requests, rewards). Not a worker thread: torch ops from a
                # second thread get their own OpenMP team, and alternating with the trainer's
                # team halved decoding speed here.
                for completions in self._batch_steps([r for r, _ in batch]):  # noqa: B007
                    await asyncio.sleep(0)
            except Exception as e:  # noqa: BLE001 - handed to every waiting caller
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), completion in zip(batch, completions, strict=True):
                if not future.done():
                    future.set_result(completion)

    def generate_batch(self, requests: list[Request]) -> list[Completion]:
        """Decode requests that share temperature/top-p/top-k; the synchronous core of the engine."""
        *_, completions = self._batch_steps(requests)
        return completions

    def _batch_steps(self, requests: list[Request]) -> Iterator[list[Completion] | None]:
        """Yields None after each decoding step, then the batch's completions. Inference mode is
        on only while a step runs, not while the caller has the thread."""
        steps = self._batch_steps_no_grad(requests)
        while True:
            with torch.inference_mode():
                item = next(steps, _DONE)
            if item is _DONE:
                return
            yield item

    def _batch_steps_no_grad(self, requests: list[Request]) -> Iterator[list[Completion] | None]:
        params = requests[0].params
        rows = [_Row(r, _generator(r, params), [], []) for r in requests]
        for row in rows:
            if row.request.request_id in self._aborted:
                row.finish = "abort"
        active = [i for i, row in enumerate(rows) if row.finish is None]
        if active:
            yield from self._decode(rows, active, params)
        for row in rows:
            self._aborted.discard(row.request.request_id)
        self.generated_tokens += sum(len(row.tokens) for row in rows)
        yield [Completion(row.request.request_id, row.request.prompt_ids, row.tokens, row.logprobs,
                          row.finish or "length", self.version) for row in rows]

    def _decode(self, rows: list[_Row], active: list[int], params: SamplingParams
                ) -> Iterator[None]:
        from transformers import DynamicCache

        prompts = [rows[i].request.prompt_ids for i in active]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):
            input_ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[j, width - len(p):] = 1
        device = next(self.model.parameters()).device
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
        next_position = positions[:, -1:] + 1
        while True:
            tokens, logprobs = _sample(logits.float(), params, [rows[i].generator for i in active])
            keep = []
            for j, i in enumerate(active):
                row = rows[i]
                row.tokens.append(int(tokens[j]))
                row.logprobs.append(float(logprobs[j]))
                row.finish = _finish_reason(row, self._aborted)
                if row.finish is None:
                    keep.append(j)
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                attention, next_position, tokens = attention[index], next_position[index], tokens[index]
                active = [active[j] for j in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=-1)
            logits = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=attention,
                                position_ids=next_position, past_key_values=cache,
                                use_cache=True).logits[:, -1]
            next_position = next_position + 1
            yield None


def _batch_key(params: SamplingParams) -> tuple:
    return (params.temperature, params.top_p, params.top_k)


def _similar_lengths(candidates: list, anchor: int, size: int) -> list:
    """Up to `size` requests whose prompt lengths are closest to the oldest request's (`anchor`),
    which is always included: less left padding, and no request waits forever."""
    if len(candidates) <= size:
        return candidates
    return sorted(candidates, key=lambda item: abs(len(item[0].prompt_ids) - anchor))[:size]


def _generator(request: Request, params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    generator = torch.Generator()
    generator.manual_seed(request.seed)
    return generator


def _finish_reason(row: _Row, aborted: set[str]) -> str | None:
    params = row.request.params
    if row.tokens[-1] in params.stop_token_ids:
        return "stop"
    if len(row.tokens) >= params.max_new_tokens:
        return "length"
    if row.request.request_id in aborted:
        return "abort"
    return None


def _sample(logits: torch.Tensor, params: SamplingParams,
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens [B], logprobs [B]) where the logprob is taken from
    the temperature-scaled distribution before top-k/top-p truncation."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    filtered = _top_k_top_p(scaled, params.top_k, params.top_p)
    # Per-row CPU generators keep each request's stream independent of its batch and device.
    uniform = torch.stack([torch.rand(scaled.shape[-1], generator=g) for g in generators])
    uniform = uniform.to(scaled.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20)))
    tokens = (filtered + gumbel).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, -1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits

"""The transformers engine: continuous batching over one KV cache, in-process.

Requests with the same sampling settings (temperature, top-p, top-k) decode together in one running
batch. Between decoding steps, pending requests join it, up to `max_batch_size` rows: they are
prefilled alone, then merged into the running KV cache (`reroll.engines.kv_cache`), right-aligned
to its width; each row keeps its own position ids, so the padding shifts nothing. A row leaves as soon as
it ends (stop token, max_new_tokens, abort) and its caller gets the completion at once; leading
cache columns that only departed rows needed are cropped. So on a long-tailed workload finished
requests are not held back by the tail, and new requests keep the tail's batch full.

GRPO sends `group_size` requests with one prompt: each distinct prompt is prefilled once and its KV
and logits are copied to its rows; the prefill computes logits for the last position only.

Each row samples with its own seeded generator (Gumbel-max over the filtered logits), drawn once per
token, so a request's sample does not depend on its batch neighbours or on when it joined.

Requests with other sampling settings wait until the running batch is empty. While one waits, only
requests older than it still join, so the batch drains and no request waits forever.

A request can be paused (`pause`, from any thread): between two decoding steps its row leaves the
running batch with its KV cache, its tokens and its next-token logits kept aside (a pending one is
just not admitted), and it does no work until `resume` merges it back, sampling on as if it had
never left (no prefill again). An abort ends a paused request at once with the tokens it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from reroll.engines.base import (
    AdapterSyncError,
    Completion,
    EngineStats,
    LoadMeter,
    Request,
    SamplingParams,
    fingerprint,
)
from reroll.engines.running_batch import (
    Batch,
    Row,
    crop_padding,
    gather_rows,
    left_padded,
    merge_batches,
    row_apart,
)
from reroll.models.attention import GQA_SDPA, decode_row_segments, share_kv_heads_in_sdpa
from reroll.models.lm_head import OutputHead
from reroll.models.logprobs import load_weights, placeholder_ids, without_placeholders
from reroll.models.lora import AdapterError, HeldBase
from reroll.models.routing import NO_RECORD, Recorder, is_moe, top_k

if TYPE_CHECKING:
    from transformers import DynamicCache


class HFEngine:
    """Engine over a transformers causal LM that it owns (its weights arrive via `load_weights`)."""

    def __init__(self, model: torch.nn.Module, max_batch_size: int = 256, pad_token_id: int = 0,
                 dtype: torch.dtype | None = None, record_routing: bool = False):
        """`dtype`: hold the weights in this dtype (None: as `model` has them). Weights loaded
        later are cast to it; `weights_fingerprint` is then of the weights as received (before
        the cast), so it still matches the trainer's, as vLLM's does.

        `record_routing`: on a mixture-of-experts model, each completion carries the experts its
        tokens were routed to (`Completion.routed_experts`, for routing replay); ignored on a
        dense model."""
        self.model = model.eval()
        self.model.requires_grad_(False)
        self._received_fingerprint: str | None = None
        self._held_base: HeldBase | None = None
        self._adapter_fingerprint: str | None = None
        self._loaded_in_full = False
        self._cast_to = dtype if dtype is not None and dtype != next(model.parameters()).dtype \
            else None
        if self._cast_to is not None:
            self._received_fingerprint = fingerprint(model.state_dict().items())
            self.model.to(self._cast_to)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.version = 0
        self._pending: list[Row] = []
        self._running: Batch | None = None
        self._aborted: set[str] = set()
        self._paused: set[str] = set()
        """Requests to hold (`pause`), until `resume`."""
        self._parked: dict[str, Batch] = {}
        """Paused rows set aside, each in a one-row batch with its KV cache and logits."""
        self._wakeup: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._worker: asyncio.Task | None = None
        self.generated_tokens = 0
        self.meter = LoadMeter()
        self._device_when_awake: torch.device | None = None
        self._has_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._head = OutputHead.of(model)
        """Backbone and head apart, for the architectures whose head is known (else None)."""
        share_kv_heads_in_sdpa(model)
        self._segmented_attention = (
            getattr(getattr(model, "config", None), "_attn_implementation", None) == GQA_SDPA)
        self._routing = Recorder(model) if record_routing and is_moe(model) else None
        self._top_k = top_k(model)

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(Row(request, _generator(request), future))
        self.meter.started()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        else:
            self._wake()
        tokens = 0
        try:
            completion = await future
            tokens = len(completion.token_ids)
            return completion
        finally:
            self.meter.finished(tokens)
            # An abort that came after the request ended (before its caller resumed) is moot.
            self._aborted.discard(request.request_id)
            self._paused.discard(request.request_id)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self._wake()

    def pause(self, request_id: str) -> None:
        """Hold the request from the next decoding step on, its KV cache and tokens kept (see the
        module doc). Any thread; a request that is not running or pending is not affected."""
        self._paused.add(request_id)

    def resume(self, request_id: str) -> None:
        """Let a paused request decode again from where it stopped. Any thread."""
        self._paused.discard(request_id)
        self._wake()

    def paused(self) -> int:
        """Requests set aside by `pause` now, with their KV cache."""
        return len(self._parked)

    in_flight_updates = True
    """`load_weights` may be called on the event loop's thread while requests run (between two
    decoding steps, since the steps run on that thread too): they go on under the new weights."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        state = dict(named_tensors)
        if self._cast_to is not None:  # load_state_dict casts into the engine's dtype
            self._received_fingerprint = fingerprint(state.items())
        load_weights(self.model, state, "the weights sent to the engine")
        self.version = version
        self._loaded_in_full, self._adapter_fingerprint = True, None

    takes_adapters = True
    """`load_adapter`: LoRA runs can send the adapter alone (`model.lora.sync`)."""

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A LoRA adapter (`LoRAAdapter.adapter_tensors`) merged into the engine's copy of the
        base weights (`HeldBase`, taken at the first adapter). An engine that got full weights
        before any adapter holds no base (AdapterSyncError); so does an adapter that does not fit
        (no weight changed then)."""
        tensors = dict(adapter)
        if self._held_base is None:
            if self._loaded_in_full:
                raise AdapterSyncError("the engine has loaded full weights since it started, so "
                                       "it holds no base model to merge an adapter into")
            self._held_base = HeldBase(self.model)
        try:
            self._held_base.apply(tensors)
        except AdapterError as e:
            raise AdapterSyncError(f"the engine refused adapter version {version}: {e}") from None
        self._adapter_fingerprint = fingerprint(tensors.items())
        self.version = version

    def weights_fingerprint(self) -> str:
        """Of the weights held; with a `dtype` cast, of the weights as last received; after an
        adapter, of the adapter it merged."""
        if self._adapter_fingerprint is not None:
            return self._adapter_fingerprint
        if self._received_fingerprint is not None:
            return self._received_fingerprint
        return fingerprint(self.model.state_dict().items())

    # -- colocation, load, shutdown ---------------------------------------------------------------

    def sleep(self) -> None:
        """On an accelerator, move the weights to CPU memory and free the cache (the KV cache exists
        only while a batch runs). On CPU there is nothing to free."""
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
        """`queued` counts requests waiting to join the batch and those decoding."""
        return self.meter.stats()

    def running_cache_length(self) -> int:
        """Columns in the running batch's KV cache (0 when none runs); its memory grows with this."""
        return 0 if self._running is None else self._running.attention.shape[1]

    def close(self) -> None:
        """Nothing to release: the engine lives in this process."""

    shutdown = close

    # -- serving ---------------------------------------------------------------------------------

    async def _serve(self) -> None:
        await asyncio.sleep(0)  # let every request submitted in this tick join the first batch
        self._running = None  # a batch left by a previous event loop has no one waiting for it
        self._parked = {}
        wakeup = asyncio.Event()
        self._wakeup = (asyncio.get_running_loop(), wakeup)
        while self._pending or self._running is not None or self._parked:
            # One decoding step per iteration on this thread, handing the loop back between steps
            # (aborts, new requests, rewards). Not a worker thread: torch ops from a second thread
            # get their own OpenMP team, and alternating with the trainer's team halved decoding
            # speed here.
            wakeup.clear()
            self._end_aborted_pending()
            with torch.inference_mode():
                self._park()
                self._unpark()
            newcomers = self._take_newcomers()
            if self._running is None and not newcomers:  # only paused requests: wait for a change
                await wakeup.wait()
                continue
            try:
                with torch.inference_mode():
                    self._admit(newcomers)
                    finished = self._step(self._running) if self._running is not None else []
            except Exception as e:  # noqa: BLE001 - handed to every request in the batch
                self._fail(newcomers + (self._running.rows if self._running else []), e)
                self._running = None
            else:
                if self._running is not None and not self._running.rows:
                    self._running = None
                for row in finished:
                    self._resolve(row)
            await asyncio.sleep(0)

    def _wake(self) -> None:
        """Wake the worker if it waits with only paused requests (any thread)."""
        if self._wakeup is not None:
            loop, event = self._wakeup
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(event.set)

    def _end_aborted_pending(self) -> None:
        """Requests aborted before they started end now, with no tokens; paused ones end with
        the tokens they have."""
        if not self._aborted:
            return
        for row in [row for row in self._pending if row.request.request_id in self._aborted]:
            self._pending.remove(row)
            row.finish = "abort"
            self._resolve(row)
        for request_id in [r for r in self._parked if r in self._aborted]:
            row = self._parked.pop(request_id).rows[0]
            row.finish = "abort"
            self._resolve(row)

    def _park(self) -> None:
        """Set the paused rows of the running batch aside, each with its own KV cache."""
        batch = self._running
        if batch is None or not self._paused:
            return
        leaving = [j for j, row in enumerate(batch.rows)
                   if row.finish is None and row.request.request_id in self._paused]
        if not leaving:
            return
        for j in leaving:
            self._parked[batch.rows[j].request.request_id] = row_apart(batch, j)
        keep = [j for j, row in enumerate(batch.rows) if row.finish is None and j not in leaving]
        if not keep:
            self._running = None
            return
        batch.rows = [batch.rows[j] for j in keep]
        gather_rows(batch, torch.tensor(keep, dtype=torch.long, device=batch.logits.device))
        crop_padding(batch)

    def _unpark(self) -> None:
        """Merge the resumed rows back into the running batch (or start one with them) while
        they share its sampling key and it has room."""
        for request_id in [r for r in self._parked if r not in self._paused]:
            running, parked = self._running, self._parked[request_id]
            if running is None:
                self._running = self._parked.pop(request_id)
            elif _batch_key(running.params) == _batch_key(parked.params) \
                    and len(running.rows) < self.max_batch_size:
                self._running = merge_batches(running, self._parked.pop(request_id))

    def _take_newcomers(self) -> list[Row]:
        """The pending requests that join the running batch now (or start one): those with its
        sampling key, up to `max_batch_size` rows in all, the oldest always among them.

        With no batch running, the oldest request's key is served next. While a request with
        another key waits, only requests older than it join, so the batch drains and it gets its
        turn."""
        running = self._running
        free = self.max_batch_size - (len(running.rows) if running is not None else 0)
        pending = [row for row in self._pending if row.request.request_id not in self._paused]
        if not pending or free <= 0:
            return []
        if running is None:
            key = _batch_key(pending[0].request.params)
            candidates = [row for row in pending if _batch_key(row.request.params) == key]
        else:
            key = _batch_key(running.params)
            candidates = list(itertools.takewhile(
                lambda row: _batch_key(row.request.params) == key, pending))
        if not candidates:
            return []
        chosen = _similar_lengths(candidates, len(candidates[0].request.prompt_ids), free)
        taken = {id(row) for row in chosen}
        self._pending = [row for row in self._pending if id(row) not in taken]
        return chosen

    def _admit(self, newcomers: list[Row]) -> None:
        """Prefill the newcomers alone, then merge them into the running batch."""
        if not newcomers:
            return
        try:
            joining = self._prefill(newcomers)
        except Exception as e:  # noqa: BLE001 - a prompt the model rejects fails its own requests
            self._fail(newcomers, e)
            return
        self._running = joining if self._running is None else merge_batches(self._running, joining)

    def _resolve(self, row: Row) -> None:
        completion = self._completion(row)
        if not row.future.done():
            row.future.set_result(completion)

    def _fail(self, rows: list[Row], error: Exception) -> None:
        for row in rows:
            self._aborted.discard(row.request.request_id)
            if not row.future.done():
                row.future.set_exception(error)

    def _completion(self, row: Row) -> Completion:
        """The row's result; its abort mark, if any, is used up."""
        self._aborted.discard(row.request.request_id)
        self.generated_tokens += len(row.tokens)
        mixed = len(set(row.versions)) > 1
        return Completion(row.request.request_id, row.request.prompt_ids, row.tokens, row.logprobs,
                          row.finish or "length", self.version, row.versions if mixed else None,
                          row.first_token_s, routed_record(row, self._routing))

    # -- decoding --------------------------------------------------------------------------------

    def generate_batch(self, requests: list[Request]) -> list[Completion]:
        """Decode requests that share temperature/top-p/top-k, all starting together, to their
        ends; completions in request order. The synchronous path (benchmarks, tests): no event
        loop, so nothing joins on the way."""
        if len({_batch_key(r.params) for r in requests}) > 1:
            raise ValueError("generate_batch needs requests with one temperature, top_p and top_k")
        rows = [Row(r, _generator(r)) for r in requests]
        for row in rows:
            if row.request.request_id in self._aborted:
                row.finish = "abort"
        starting = [row for row in rows if row.finish is None]
        with torch.inference_mode():
            batch = self._prefill(starting) if starting else None
            while batch is not None and batch.rows:
                self._step(batch)
        return [self._completion(row) for row in rows]

    def _prefill(self, rows: list[Row]) -> Batch:
        """A new batch of `rows`, their prompts run through the model (left-padded) in a new cache.

        A prompt shared by several rows (a GRPO group) is computed once; its KV, logits and
        positions are then copied to each of those rows."""
        from reroll.engines.kv_cache import growing_cache  # imports transformers: when used

        # A prompt is its ids and its model inputs (images): a group's requests share one dict.
        distinct: dict[tuple, int] = {}
        inputs = [id(row.request.model_inputs) if row.request.model_inputs else 0 for row in rows]
        prompt_of_row = [distinct.setdefault((tuple(row.request.prompt_ids), key), len(distinct))
                         for row, key in zip(rows, inputs, strict=True)]
        firsts = {index: row.request for row, index in zip(rows, prompt_of_row, strict=True)}
        device = next(self.model.parameters()).device
        input_ids, attention = left_padded([ids for ids, _ in distinct], self.pad_token_id,
                                            device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache()
        logits = self._next_logits(input_ids, attention, positions, cache,
                                   _prompt_inputs([firsts[i] for i in range(len(distinct))],
                                                  device))
        for row in rows:
            row.logits_version = self.version
        if self._routing is not None:
            routed = self._routing.take().view(*input_ids.shape, -1, self._top_k)
            for row, p in zip(rows, prompt_of_row, strict=True):
                row.routing = [routed[p, input_ids.shape[1] - len(row.request.prompt_ids):]]
        batch = Batch(rows[0].request.params, list(rows), cache, attention, positions[:, -1:] + 1,
                       logits)
        if len(distinct) < len(rows):
            gather_rows(batch, torch.tensor(prompt_of_row, dtype=torch.long, device=device))
        return batch

    def _step(self, batch: Batch) -> list[Row]:
        """Sample each row's next token; rows that end leave the batch and are returned, the
        others' tokens go through the model so that their next logits are ready."""
        tokens, logprobs = _sample(batch.logits.float(), batch.params,
                                   [row.generator for row in batch.rows])
        finished = []
        for row, token, logprob in zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True):
            if row.finish is not None:  # ended earlier, its cache row not compacted away yet
                continue
            if not row.tokens:
                row.first_token_s = time.perf_counter() - row.submitted_at
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(row.logits_version)
            row.finish = _finish_reason(row, self._aborted)
            if row.finish is not None:
                finished.append(row)
        keep = [j for j, row in enumerate(batch.rows) if row.finish is None]
        if not keep:
            batch.rows = []
            return finished
        # Compacting copies the whole cache, so ended rows stay (decoded, ignored) until a
        # quarter of the batch has ended.
        if len(keep) <= 3 * len(batch.rows) // 4:
            index = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            batch.rows = [batch.rows[j] for j in keep]
            gather_rows(batch, index)
            tokens = tokens[index]
            crop_padding(batch)
        rows = len(batch.rows)
        batch.attention = torch.cat([batch.attention, batch.attention.new_ones((rows, 1))], -1)
        batch.logits = self._next_logits(tokens[:, None], batch.attention, batch.next_position,
                                         batch.cache)
        for row in batch.rows:
            row.logits_version = self.version
        if self._routing is not None:
            routed = self._routing.take().view(rows, 1, -1, self._top_k)
            for j, row in enumerate(batch.rows):
                if row.finish is None:  # an ended row not compacted away is fed, ignored
                    row.routing.append(routed[j])
        batch.next_position = batch.next_position + 1
        return finished

    def _next_logits(self, input_ids: torch.Tensor, attention: torch.Tensor,
                     positions: torch.Tensor, cache: DynamicCache,
                     model_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """[B, V] logits of the token after each row's last input. With `logits_to_keep` the model
        computes them for that position only, not for every prompt position. `model_inputs`: the
        prompts' inputs beyond tokens at prefill (decoding steps read them from the cache)."""
        extra = dict(model_inputs or {})
        if self._routing is not None:
            self._routing.discard()  # what a failed forward left (its requests failed with it)
        if input_ids.shape[1] == 1 and self._segmented_attention:
            extra["row_segments"] = decode_row_segments(attention)
        if self._head is not None:
            # The head on a contiguous [B, hidden]: the model's own `lm_head(h[:, -1:])` on the
            # strided [B, 1, hidden] slice of a prefill goes through a batched matmul that
            # copies the head's weight once per row (3.6 GB for 32 rows of SmolLM2 in bf16,
            # most of a 2 s prefill).
            hidden = self._head.backbone(input_ids=input_ids, attention_mask=attention,
                                         position_ids=positions, past_key_values=cache,
                                         use_cache=True, **extra).last_hidden_state
            return self._head.logits(hidden[:, -1].contiguous())
        if self._has_logits_to_keep:
            extra["logits_to_keep"] = 1
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True, **extra).logits[:, -1]
        return without_placeholders(logits, placeholder_ids(self.model))  # as the trainer's


def _prompt_inputs(requests: list[Request], device: torch.device) -> dict[str, torch.Tensor]:
    """The requests' model inputs as one forward takes them: each input's tensors concatenated
    along the first dimension in row order (the rule of `reroll.data.batch.model_kwargs`)."""
    names = sorted({name for r in requests for name in r.model_inputs})
    return {name: torch.cat([r.model_inputs[name] for r in requests if name in r.model_inputs]
                            ).to(device) for name in names}


def routed_record(row: Row, recorder: Recorder | None) -> torch.Tensor | None:
    """[prompt + response tokens, layers, top_k] of the row: what the engine routed for each
    token it fed; the last token was sampled and never fed (-1, no record)."""
    if recorder is None or not row.routing:
        return None
    seen = torch.cat(row.routing)
    missing = len(row.request.prompt_ids) + len(row.tokens) - seen.shape[0]
    return torch.cat([seen, seen.new_full((missing, *seen.shape[1:]), NO_RECORD)])


def _batch_key(params: SamplingParams) -> tuple:
    return (params.temperature, params.top_p, params.top_k)


def _similar_lengths(candidates: list[Row], anchor: int, size: int) -> list[Row]:
    """Up to `size` requests whose prompt lengths are closest to the oldest request's (`anchor`),
    which is always included: less left padding, and no request waits forever."""
    if len(candidates) <= size:
        return candidates
    return sorted(candidates, key=lambda row: abs(len(row.request.prompt_ids) - anchor))[:size]


def _generator(request: Request) -> torch.Generator | None:
    if request.params.temperature == 0:
        return None
    generator = torch.Generator()
    generator.manual_seed(request.seed)
    return generator


def _finish_reason(row: Row, aborted: set[str]) -> str | None:
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

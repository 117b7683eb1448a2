"""ROSE: rollouts on the spare capacity of a serving endpoint, under the endpoint's latency objective.

A serving endpoint (reroll's own server, `reroll.engines.server`, whose weights the trainer can
push) answers its users' requests; its load comes in bursts, and between bursts it idles.
`ElasticEngine` generates rollouts on a dedicated engine and lends the serving endpoint part of
them while its own traffic stays within its objective:

- every `control_interval_s` a controller reads the endpoint's `/v1/load` (p99 time to first token
  and time per output token of its *serving* requests over the last `window_s`) and sets the
  lending cap, the most rollout requests the endpoint may hold (`next_cap`): none at once when a
  p99 passes `headroom` x its objective (the back-off takes one interval) or while a serving
  request runs, doubled (from 1) while both stay under it, up to `max_lent` (at once for an
  endpoint that yields, below). While users are being served the read waits for the last of
  them to end, so lending resumes then, not on the next tick;
- a rollout request goes to whichever side has room first: the dedicated engine up to
  `dedicated_max_in_flight`, the endpoint up to the cap; requests wait for room in order and
  are woken when it comes (a request ending, the cap rising), not by polling;
- new weights go to both, and the endpoint's fingerprint must equal the dedicated engine's (the
  trainer then compares that with its own): an endpoint left on other weights stops the run.
- users first: a server started with `--yield-to-serving` aborts the rollouts it runs as soon as
  one of its users' requests arrives, and turns away rollouts that arrive while users are being
  served. A rollout that comes back so (finish reason `abort`, not aborted by the caller) closes
  the lending until the controller sees the endpoint idle, and its rest (prompt + its tokens, the
  rest of its budget) goes ahead of the requests that have not started, to whichever side has
  room first; its tokens and logprobs are kept (the same weights sampled them). An endpoint
  that keeps K rollouts beside its users (`--rollouts-beside-serving K`) aborts only the others
  (it starts no new one while they are served: its prefill would stall their decoding). Those K are
  the first to go when the users' latency nears its objective: past the headroom the controller
  tells the endpoint to keep none (`next_beside`, `POST /v1/beside`), which gives them back at
  once if users are being served, and K again once the p99s are back under it. Without
  yielding, a rollout already on the endpoint when the cap drops runs to its end beside the
  users' requests.
- paused, not given back: an endpoint started with `--pause-rollouts P` pauses the rollouts it
  would abort for its users (up to P; KV cache and tokens kept, no work done) and resumes them
  when its users leave, so they pay no second prefill. While some are paused and the dedicated
  engine has room that no waiting request takes (the run's tail), the controller takes them back
  (`POST /v1/reclaim`): they come back as given-back rollouts and continue here, rather than
  wait for the users to leave.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from reroll.engines.base import (
    AdapterSyncError,
    Completion,
    Engine,
    Request,
    WeightSyncError,
)
from reroll.engines.delta import (
    DeltaCounters,
    DeltaPolicy,
    DeltaRefused,
    DeltaSender,
    body_bytes,
    in_dtype,
)
from reroll.engines.remote import RemoteEngine, RemoteOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingObjective:
    """The serving endpoint's latency objective and how the lending follows it."""

    ttft_p99_s: float
    """p99 time to first token of the endpoint's own requests."""
    tpot_p99_s: float
    """p99 time per output token of the endpoint's own requests."""
    headroom: float = 0.8
    """Lending stops when a p99 passes this fraction of its objective (before it is missed)."""
    control_interval_s: float = 0.5
    """How often the controller reads the endpoint's load and sets the cap."""
    window_s: float = 2.0
    """The past the p99s are taken over."""
    max_lent: int = 16
    """Most rollout requests the endpoint holds at once."""


def next_cap(cap: int, serving: dict, objective: ServingObjective, yields: bool = False) -> int:
    """The lending cap after one control interval, from the serving traffic's recent p99s
    (`serving`: `ttft_p99_s`, `tpot_p99_s`, None when no request finished in the window):
    0 when either passes `headroom` x its objective or a serving request is running, else doubled
    (at least 1), up to `max_lent`. An idle endpoint (no serving request in the window) lends the
    most, and so does one that `yields` (started with `--yield-to-serving`): its users never
    share more than one decoding step with rollouts (or with those it keeps beside them, see
    `next_beside`), so a gradual ramp would protect nothing while the p99s stay within the
    objective."""
    if threatened(serving, objective):
        return 0
    if serving.get("in_flight", 0) > 0:  # users are being served right now
        return 0
    if yields or serving.get("requests", 0) == 0:
        return objective.max_lent
    return min(objective.max_lent, max(1, 2 * cap))


def next_beside(serving: dict, objective: ServingObjective, most: int) -> int:
    """How many rollouts a yielding endpoint that may keep up to `most` beside its users should
    keep now: none while either recent p99 of its users (`serving`, as for `next_cap`) is past
    `headroom` x its objective, so that the users' batch is theirs alone until it is back under;
    else all `most`."""
    return 0 if threatened(serving, objective) else most


def threatened(serving: dict, objective: ServingObjective) -> bool:
    """Whether either recent p99 of the serving traffic is past `headroom` x its objective."""
    limits = {"ttft_p99_s": objective.ttft_p99_s, "tpot_p99_s": objective.tpot_p99_s}
    return any(serving.get(key) is not None and serving[key] > objective.headroom * limit
               for key, limit in limits.items())


@dataclass
class ElasticCounters(DeltaCounters):
    lent: int = 0
    """Rollout requests the serving endpoint answered."""
    dedicated: int = 0
    """Rollout requests the dedicated engine answered."""
    backoffs: int = 0
    """Control intervals that cut the cap to 0 from above it."""
    preempted: int = 0
    """Lent rollouts the endpoint aborted for its users, finished on the dedicated engine."""
    caps: list[int] = field(default_factory=list)
    """The cap of each control interval."""
    lent_tokens: int = 0
    """Tokens the serving endpoint generated, those of preempted rollouts included."""
    kept_tokens: int = 0
    """Of those, the tokens of preempted rollouts (kept, continued on the dedicated engine)."""
    lent_busy_s: float = 0.0
    """Time during which the endpoint held at least one rollout request."""
    unkept: int = 0
    """Times the controller told the endpoint to keep no rollouts beside its users."""
    reclaimed: int = 0
    """Paused rollouts taken back from the endpoint for room on the dedicated engine."""


class ElasticEngine:
    """A dedicated engine plus the spare capacity of a serving endpoint (see the module doc)."""

    def __init__(self, dedicated: Engine, serving_url: str, objective: ServingObjective,
                 dedicated_max_in_flight: int = 64, model: str | None = None,
                 delta: DeltaPolicy | None = None):
        import httpx

        self.dedicated, self.objective = dedicated, objective
        self.serving_url = serving_url.rstrip("/")
        self.serving = RemoteEngine([self.serving_url], RemoteOptions(
            model=model, max_in_flight=objective.max_lent, request_kind="rollout"))
        self.dedicated_max = dedicated_max_in_flight
        self.counters = ElasticCounters()
        self.delta = delta or DeltaPolicy(enabled=False)
        self.sender = DeltaSender(self.delta, self.counters)  # the endpoint's weights, its dtype
        self._endpoint_dtype: torch.dtype | bool | None = None  # asked once; False: unknown
        self.cap = 0
        self._in_flight = {"dedicated": 0, "serving": 0}
        self._lent_since = 0.0
        self._yields = 0  # rollouts the endpoint gave back for its users, so far
        self._reclaiming = 0  # paused rollouts taken back that have not come back yet
        self._where: dict[str, tuple[str, str]] = {}  # request -> (side, id of its part)
        self._aborted: set[str] = set()  # aborted by the caller, not preempted
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._http = httpx.Client(timeout=30)
        self._stop = threading.Event()
        self._controller = threading.Thread(target=self._control, name="reroll-elastic",
                                            daemon=True)
        self._controller.start()

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        out, part_request, preempted = None, request, False
        while True:
            side = await self._room(first=preempted)
            part = await self._generate_on(side, part_request, request.request_id)
            out = part if out is None else joined(out, part)
            yielded = side == "serving" and part.finish_reason == "abort" \
                and request.request_id not in self._aborted \
                and len(out.token_ids) < request.params.max_new_tokens
            with self._lock:
                if side == "serving":
                    self.counters.lent_tokens += len(part.token_ids)
                if yielded:  # the endpoint's users came first
                    self.counters.preempted += 1
                    self.counters.kept_tokens += len(part.token_ids)
            if not yielded:
                break
            part_request, preempted = continuation(request, out), True
        self._aborted.discard(request.request_id)
        with self._lock:
            if side == "serving":
                self.counters.lent += 1
            else:
                self.counters.dedicated += 1
        return replace(out, request_id=request.request_id)

    async def _generate_on(self, side: str, request: Request, original_id: str) -> Completion:
        self._where[original_id] = (side, request.request_id)
        part = None
        try:
            engine = self.serving if side == "serving" else self.dedicated
            part = await engine.generate(request)
            return part
        finally:
            with self._lock:
                self._in_flight[side] -= 1
                if side == "serving" and part is not None and part.finish_reason == "abort" \
                        and original_id not in self._aborted:
                    # it yielded: no more lending until the controller sees the users gone
                    self.cap = 0
                    self._yields += 1
                    self._reclaiming = max(0, self._reclaiming - 1)
                if side == "serving" and self._in_flight[side] == 0:
                    self.counters.lent_busy_s += time.perf_counter() - self._lent_since
                self._grant()
            self._where.pop(original_id, None)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        side, current_id = self._where.get(request_id, ("dedicated", request_id))
        (self.serving if side == "serving" else self.dedicated).abort(current_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Both sides; the endpoint gets the weights as one safetensors body, or, with
        `weight_sync: delta`, what changed since the version it holds (`_send_delta`)."""
        from safetensors.torch import save

        # cloned: tied weights share storage, which safetensors refuses
        tensors = {name: t.detach().cpu().clone() for name, t in named_tensors}
        self.dedicated.load_weights(tensors.items(), version)
        self.serving.version = version
        if not self.delta.enabled:
            self._post_full(save(tensors), version)
            self.counters.sync_bytes = self.counters.full_bytes = body_bytes(tensors)
            return
        wire = self._in_endpoint_dtype(tensors)
        self.sender.send(wire, version, self._send_delta,
                         lambda full: self._post_full(save(full), version),
                         f"serving endpoint {self.serving_url}")

    def _post_full(self, body: bytes, version: int) -> None:
        reply = self._http.post(f"{self.serving_url}/weights", content=body,
                                headers={"X-Reroll-Version": str(version)})
        if reply.status_code != 200:
            raise WeightSyncError(f"the serving endpoint {self.serving_url} refused weights "
                                  f"version {version}: HTTP {reply.status_code} {reply.text[:200]}")

    def _in_endpoint_dtype(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights as the endpoint will hold them (cast to its dtype: a delta is of the
        endpoint's bits, where a small update often changes nothing). The endpoint's dtype is
        asked once: it holds its weights in one dtype for its life."""
        if self._endpoint_dtype is None:
            reply = self._http.get(f"{self.serving_url}/weights_fingerprint")
            name = reply.json().get("dtype") if reply.status_code == 200 else None
            self._endpoint_dtype = getattr(torch, name, False) if name else False
        dtype = self._endpoint_dtype
        return in_dtype(tensors, dtype if isinstance(dtype, torch.dtype) else None)

    def _send_delta(self, body: dict[str, torch.Tensor], base: int, version: int) -> str:
        """POST the delta; the endpoint's fingerprint after it. A refusal (409: it holds another
        version, or takes no deltas; 400) is a DeltaRefused: the sender sends full weights."""
        from safetensors.torch import save

        reply = self._http.post(f"{self.serving_url}/weights_delta", content=save(body),
                                headers={"X-Reroll-Version": str(version),
                                         "X-Reroll-Base-Version": str(base)})
        if reply.status_code != 200:
            raise DeltaRefused(f"HTTP {reply.status_code}: {reply.text[:200]}")
        return reply.json().get("fingerprint")

    @property
    def takes_adapters(self) -> bool:
        return bool(getattr(self.dedicated, "takes_adapters", False))

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Both sides; the endpoint gets the adapter alone as a small safetensors body
        (`POST /v1/adapter`). An endpoint that refuses it raises AdapterSyncError: the sync
        then sends both sides merged weights."""
        from safetensors.torch import save

        tensors = {name: t.detach().cpu().contiguous() for name, t in adapter}
        self.dedicated.load_adapter(tensors.items(), version)
        self.serving.version = version
        reply = self._http.post(f"{self.serving_url}/adapter", content=save(tensors),
                                headers={"X-Reroll-Version": str(version)})
        if reply.status_code != 200:
            raise AdapterSyncError(f"the serving endpoint {self.serving_url} refused adapter "
                                   f"version {version}: HTTP {reply.status_code} "
                                   f"{reply.text[:200]}")

    def weights_fingerprint(self) -> str:
        """The dedicated engine's fingerprint when the endpoint holds the same weights, of the
        same version; otherwise a value that matches no trainer, naming both, so the sync check
        stops the run (or, after an adapter, falls back to merged weights)."""
        mine = self.dedicated.weights_fingerprint()
        version = getattr(self.dedicated, "version", None)
        reply = self._http.get(f"{self.serving_url}/weights_fingerprint",
                               params={} if version is None else {"version": version})
        if reply.status_code != 200:
            return f"dedicated {mine} != serving endpoint {self.serving_url}: {reply.text[:200]}"
        theirs = reply.json()["fingerprint"]
        # with deltas the endpoint holds the weights in its dtype: they are checked against
        # those bits, the dedicated engine's against the trainer's
        expected = self.sender.held_fingerprint if self.delta.enabled \
            and self.sender.held is not None else mine
        return mine if theirs == expected else \
            f"dedicated {mine} != serving endpoint {self.serving_url} {theirs}"

    def sleep(self) -> None:
        getattr(self.dedicated, "sleep", lambda: None)()

    def wake(self) -> None:
        getattr(self.dedicated, "wake", lambda: None)()

    def stats(self):
        return self.dedicated.stats()

    def metrics(self) -> dict[str, float]:
        c = self.counters
        total = max(c.lent + c.dedicated, 1)
        return {"elastic/lent_frac": c.lent / total, "elastic/backoffs": float(c.backoffs),
                "elastic/preempted": float(c.preempted), "elastic/unkept": float(c.unkept),
                "elastic/reclaimed": float(c.reclaimed),
                "elastic/sync_bytes": float(c.sync_bytes),
                "elastic/sync_bytes_frac": c.sync_bytes / max(c.full_bytes, 1),
                "elastic/delta_syncs": float(c.delta_syncs),
                "elastic/delta_fallbacks": float(c.delta_fallbacks),
                "elastic/cap_mean": sum(c.caps) / max(len(c.caps), 1)}

    def close(self) -> None:
        self._stop.set()
        self._controller.join(timeout=10)
        self._http.close()
        self.serving.close()
        getattr(self.dedicated, "close", lambda: None)()

    shutdown = close

    # -- internals -------------------------------------------------------------------------------

    async def _room(self, first: bool = False) -> str:
        """Wait for this request's turn and a side with room; take it. Room goes in arrival
        order, except that `first` (the rest of a rollout the endpoint gave back) goes ahead of
        requests that have not started."""
        waiter = _Waiter(asyncio.get_running_loop())
        with self._lock:
            if first:
                at = next((i for i, w in enumerate(self._waiting) if not w.first), None)
                waiter.first = True
                self._waiting.insert(len(self._waiting) if at is None else at, waiter)
            else:
                self._waiting.append(waiter)
            self._grant()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                elif waiter.side is not None:  # room came as it gave up: hand it on
                    self._in_flight[waiter.side] -= 1
                    self._grant()
            raise

    def _grant(self) -> None:
        """Give room to the waiting requests, in order, while a side has some (lock held): the
        dedicated engine first, then the endpoint up to the cap."""
        while self._waiting:
            side = "dedicated" if self._in_flight["dedicated"] < self.dedicated_max \
                else "serving" if self._in_flight["serving"] < self.cap else None
            if side is None:
                return
            waiter = self._waiting.popleft()
            self._in_flight[side] += 1
            if side == "serving" and self._in_flight[side] == 1:
                self._lent_since = time.perf_counter()
            waiter.side = side
            try:
                waiter.loop.call_soon_threadsafe(_settle, waiter.future, side)
            except RuntimeError:  # its event loop has closed: nobody waits for it
                self._in_flight[side] -= 1
                waiter.side = None

    def _control(self) -> None:
        """Every control interval, the cap from the endpoint's load. While its users' requests
        run, the read waits (up to an interval) for the last of them to end, so lending resumes
        as soon as they do rather than on the next tick."""
        o, users_busy = self.objective, False
        while users_busy or not self._stop.wait(o.control_interval_s):
            if self._stop.is_set():
                return
            params = {"window_s": o.window_s} | (
                {"wait_idle_s": o.control_interval_s} if users_busy else {})
            yields = self._yields
            try:
                load = self._http.get(f"{self.serving_url}/load", params=params).json()
                users_busy = load["serving"]["in_flight"] > 0
                self._keep_beside(load)
                self._reclaim(load)
                cap = next_cap(self.cap, load["serving"], o, load.get("yield_to_serving", False))
            except Exception:  # noqa: BLE001 - an endpoint that does not answer lends nothing
                cap, users_busy = 0, False
            with self._lock:
                if self._yields != yields:  # a rollout yielded since the read: users came
                    cap, users_busy = 0, True
                if cap == 0 and self.cap > 0:
                    self.counters.backoffs += 1
                self.cap = cap
                self.counters.caps.append(cap)
                self._grant()

    def _keep_beside(self, load: dict) -> None:
        """Tell the endpoint how many rollouts to keep beside its users now (`next_beside`)
        when that changed (an endpoint without `beside` in its load cannot be told)."""
        if "beside" not in load:
            return
        keep = next_beside(load["serving"], self.objective,
                           int(load.get("rollouts_beside_serving", 0)))
        if keep != load["beside"]:
            self._http.post(f"{self.serving_url}/beside", json={"keep": keep}).raise_for_status()
            if keep == 0:
                self.counters.unkept += 1


    def _reclaim(self, load: dict) -> None:
        """Take paused rollouts back from the endpoint while the dedicated engine has room that
        no waiting request (nor one taken back before, still on its way) will fill."""
        paused = int(load.get("paused", 0))
        if not paused:
            return
        with self._lock:
            room = self.dedicated_max - self._in_flight["dedicated"] - len(self._waiting) \
                - self._reclaiming
            n = min(room, paused)
            if n <= 0:
                return
            self._reclaiming += n
        reply = self._http.post(f"{self.serving_url}/reclaim", json={"n": n})
        reply.raise_for_status()
        given = int(reply.json()["reclaimed"])
        with self._lock:
            self._reclaiming -= n - given
            self.counters.reclaimed += given


@dataclass(eq=False)
class _Waiter:
    """A request waiting for room, on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = None  # type: ignore[assignment]
    side: str | None = None
    """The side granted (set under the engine's lock, before the future is settled)."""
    first: bool = False

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()


def _settle(future: asyncio.Future, side: str) -> None:
    if not future.done():
        future.set_result(side)


def continuation(request: Request, partial: Completion) -> Request:
    """The rest of `request` after the tokens of `partial`: its prompt plus them, the remaining
    token budget, the same seed, model inputs and images (a fresh id)."""
    left = request.params.max_new_tokens - len(partial.token_ids)
    return Request(list(request.prompt_ids) + list(partial.token_ids),
                   replace(request.params, max_new_tokens=max(left, 1)), request.seed,
                   model_inputs=request.model_inputs, images=request.images)


def joined(first: Completion, rest: Completion) -> Completion:
    """One completion of the original request from its two parts (per-token weight versions
    when the parts' differ)."""
    both = first.versions() + rest.versions()
    return Completion(first.request_id, first.prompt_ids, first.token_ids + rest.token_ids,
                      first.logprobs + rest.logprobs, rest.finish_reason, rest.policy_version,
                      both if len(set(both)) > 1 else None, first.first_token_s)

"""ROSE: rollouts on the spare capacity of a serving endpoint, under the endpoint's latency objective.

A serving endpoint (reroll's own server, `reroll.engines.server`, whose weights the trainer can
push) answers its users' requests; its load comes in bursts, and between bursts it idles.
`ElasticEngine` generates rollouts on a dedicated engine and lends the serving endpoint part of
them while its own traffic stays within its objective:

- every `control_interval_s` a controller reads the endpoint's `/v1/load` (p99 time to first token
  and time per output token of its *serving* requests over the last `window_s`) and sets the
  lending cap, the most rollout requests the endpoint may hold (`next_cap`): none at once when a
  p99 passes `headroom` x its objective (the back-off takes one interval), doubled (from 1) while
  both stay under it, up to `max_lent`;
- a rollout request goes to whichever side has room first: the dedicated engine up to
  `dedicated_max_in_flight`, the endpoint up to the cap; requests wait for room in order;
- new weights go to both, and the endpoint's fingerprint must equal the dedicated engine's (the
  trainer then compares that with its own): an endpoint left on other weights stops the run.
- users first: a server started with `--yield-to-serving` aborts the rollouts it runs as soon as
  one of its users' requests arrives; a rollout that comes back aborted this way is continued on
  the dedicated engine from where it stopped (prompt + its tokens, the rest of its budget), its
  tokens and logprobs kept (the same weights sampled them). Without it, a rollout already on the
  endpoint when the cap drops runs to its end beside the users' requests.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from reroll.engines.base import Completion, Engine, Request, WeightSyncError
from reroll.engines.remote import RemoteEngine, RemoteOptions


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


def next_cap(cap: int, serving: dict, objective: ServingObjective) -> int:
    """The lending cap after one control interval, from the serving traffic's recent p99s
    (`serving`: `ttft_p99_s`, `tpot_p99_s`, None when no request finished in the window):
    0 when either passes `headroom` x its objective or a serving request is running, else doubled
    (at least 1), up to `max_lent`. An idle endpoint (no serving request in the window) lends the
    most."""
    limits = {"ttft_p99_s": objective.ttft_p99_s, "tpot_p99_s": objective.tpot_p99_s}
    for key, limit in limits.items():
        value = serving.get(key)
        if value is not None and value > objective.headroom * limit:
            return 0
    if serving.get("in_flight", 0) > 0:  # users are being served right now
        return 0
    if serving.get("requests", 0) == 0:
        return objective.max_lent
    return min(objective.max_lent, max(1, 2 * cap))


@dataclass
class ElasticCounters:
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


class ElasticEngine:
    """A dedicated engine plus the spare capacity of a serving endpoint (see the module doc)."""

    def __init__(self, dedicated: Engine, serving_url: str, objective: ServingObjective,
                 dedicated_max_in_flight: int = 64, model: str | None = None):
        import httpx

        self.dedicated, self.objective = dedicated, objective
        self.serving_url = serving_url.rstrip("/")
        self.serving = RemoteEngine([self.serving_url], RemoteOptions(
            model=model, max_in_flight=objective.max_lent, request_kind="rollout"))
        self.dedicated_max = dedicated_max_in_flight
        self.counters = ElasticCounters()
        self.cap = 0
        self._in_flight = {"dedicated": 0, "serving": 0}
        self._where: dict[str, str] = {}
        self._aborted: set[str] = set()  # aborted by the caller, not preempted
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._waiting: collections.deque[int] = collections.deque()  # room goes in arrival order
        self._http = httpx.Client(timeout=30)
        self._stop = threading.Event()
        self._controller = threading.Thread(target=self._control, name="reroll-elastic",
                                            daemon=True)
        self._controller.start()

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        side = await self._room(next(self._tickets))
        out = await self._generate_on(side, request)
        if side == "serving" and out.finish_reason == "abort" \
                and request.request_id not in self._aborted \
                and len(out.token_ids) < request.params.max_new_tokens:  # yielded to its users
            with self._lock:
                self.counters.preempted += 1
            rest = await self._generate_on(await self._room(next(self._tickets), "dedicated"),
                                           continuation(request, out))
            out = joined(out, rest)
        self._aborted.discard(request.request_id)
        with self._lock:
            if side == "serving":
                self.counters.lent += 1
            else:
                self.counters.dedicated += 1
        return out

    async def _generate_on(self, side: str, request: Request) -> Completion:
        self._where[request.request_id] = side
        try:
            engine = self.serving if side == "serving" else self.dedicated
            return await engine.generate(request)
        finally:
            with self._lock:
                self._in_flight[side] -= 1
            self._where.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        side = self._where.get(request_id)
        (self.serving if side == "serving" else self.dedicated).abort(request_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Both sides; the endpoint gets the weights as one safetensors body."""
        from safetensors.torch import save

        # cloned: tied weights share storage, which safetensors refuses
        tensors = {name: t.detach().cpu().clone() for name, t in named_tensors}
        self.dedicated.load_weights(tensors.items(), version)
        self.serving.version = version
        reply = self._http.post(f"{self.serving_url}/weights", content=save(tensors),
                                headers={"X-Reroll-Version": str(version)})
        if reply.status_code != 200:
            raise WeightSyncError(f"the serving endpoint {self.serving_url} refused weights "
                                  f"version {version}: HTTP {reply.status_code} {reply.text[:200]}")

    def weights_fingerprint(self) -> str:
        """The dedicated engine's fingerprint when the endpoint holds the same weights; otherwise
        a value that matches no trainer, naming both, so the sync check stops the run."""
        mine = self.dedicated.weights_fingerprint()
        theirs = self._http.get(f"{self.serving_url}/weights_fingerprint").json()["fingerprint"]
        return mine if theirs == mine else \
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
                "elastic/preempted": float(c.preempted),
                "elastic/cap_mean": sum(c.caps) / max(len(c.caps), 1)}

    def close(self) -> None:
        self._stop.set()
        self._controller.join(timeout=10)
        self._http.close()
        self.serving.close()
        getattr(self.dedicated, "close", lambda: None)()

    shutdown = close

    # -- internals -------------------------------------------------------------------------------

    async def _room(self, ticket: int, only: str | None = None) -> str:
        """Wait for this request's turn and a side with room (`only` that side); take it."""
        with self._lock:
            self._waiting.append(ticket)
        try:
            while True:
                with self._lock:
                    if self._waiting[0] == ticket:
                        side = "dedicated" if self._in_flight["dedicated"] < self.dedicated_max \
                            else "serving" if self._in_flight["serving"] < self.cap \
                            and only != "dedicated" else None
                        if side is not None:
                            self._in_flight[side] += 1
                            self._waiting.popleft()
                            return side
                await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            with self._lock:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
            raise

    def _control(self) -> None:
        o = self.objective
        while not self._stop.wait(o.control_interval_s):
            try:
                load = self._http.get(f"{self.serving_url}/load",
                                      params={"window_s": o.window_s}).json()
                cap = next_cap(self.cap, load["serving"], o)
            except Exception:  # noqa: BLE001 - an endpoint that does not answer lends nothing
                cap = 0
            with self._lock:
                if cap == 0 and self.cap > 0:
                    self.counters.backoffs += 1
                self.cap = cap
                self.counters.caps.append(cap)


def continuation(request: Request, partial: Completion) -> Request:
    """The rest of `request` after the tokens of `partial`: its prompt plus them, the remaining
    token budget, the same seed (a fresh id)."""
    left = request.params.max_new_tokens - len(partial.token_ids)
    return Request(list(request.prompt_ids) + list(partial.token_ids),
                   replace(request.params, max_new_tokens=max(left, 1)), request.seed)


def joined(first: Completion, rest: Completion) -> Completion:
    """One completion of the original request from its two parts."""
    return Completion(first.request_id, first.prompt_ids, first.token_ids + rest.token_ids,
                      first.logprobs + rest.logprobs, rest.finish_reason, rest.policy_version,
                      None, first.first_token_s)

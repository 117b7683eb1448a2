"""A scripted engine for scheduler tests: it implements the Engine protocol, decodes one token per
event-loop tick, and its response length is a function of the prompt and the seed. A request may
also hold (stop decoding after its first token) until the weights have moved on a given number
of versions: a long turn measured in weight updates, not in wall time, so staleness tests do not
depend on the machine's load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from reroll.engines.base import Completion, Request
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.runner import RewardRunner


class ScriptedEngine:
    def __init__(self, length: Callable[[list[int], int], int], token: int = 5,
                 tick: float = 0.0, hold: Callable[[int], int] | None = None):
        """`hold(seed)`: how many weight updates a request with that sampling seed waits for
        after its first token (0: none). One seed holds at a time, so the other requests can
        fill the batches whose updates it waits for; a seed holds once (after it, a
        restarted episode's turn with the same seed runs through)."""
        self.length, self.token, self.tick, self.hold = length, token, tick, hold
        self.held: tuple[int, int] | None = None
        """(the seed holding, the version that releases it)."""
        self.released: set[int] = set()
        self.version = 0
        self.aborted: set[str] = set()
        self.running = 0
        self.max_running = 0
        self.requests: list[Request] = []
        self.loads = 0

    async def generate(self, request: Request) -> Completion:
        self.requests.append(request)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        tokens: list[int] = []
        logprobs: list[float] = []
        # A resumed request carries its partial response (a run of `token`) after the prompt.
        prompt = list(request.prompt_ids)
        while prompt and prompt[-1] == self.token:
            prompt.pop()
        target = self.length(prompt, request.seed) - (len(request.prompt_ids) - len(prompt))
        finish = "length"
        try:
            while len(tokens) < min(target, request.params.max_new_tokens):
                await asyncio.sleep(self.tick)
                if request.request_id in self.aborted:
                    finish = "abort"
                    break
                if (tokens or len(prompt) < len(request.prompt_ids)) and self._holds(request.seed):
                    continue
                tokens.append(self.token)
                logprobs.append(-0.5 - self.version)
            else:
                finish = "stop" if len(tokens) >= target else "length"
        finally:
            self.running -= 1
        return Completion(request.request_id, request.prompt_ids, tokens, logprobs, finish,
                          self.version)

    def _holds(self, seed: int) -> bool:
        if self.hold is None or not self.hold(seed) or seed in self.released:
            return False
        if self.held is None or (self.held[0] != seed and self.version >= self.held[1]):
            if self.held is not None:
                self.released.add(self.held[0])
            self.held = (seed, self.version + self.hold(seed))
        if self.held[0] != seed:
            return False
        if self.version >= self.held[1]:
            self.released.add(seed)
            return False
        return True

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def load_weights(self, named_tensors, version: int) -> None:
        self.version = version
        self.loads += 1

    def weights_fingerprint(self) -> str:
        return f"v{self.version}"


class TableReward:
    """Reward from the row's metadata: `flat` rows always score 1.0 (no signal), other rows score
    the response length (their samples differ)."""

    name = "table"

    async def __call__(self, sample: RewardSample) -> RewardResult:
        if sample.metadata.get("flat"):
            return RewardResult(1.0)
        return RewardResult(float(len(sample.response)))


def runner() -> RewardRunner:
    return RewardRunner(TableReward(), timeout_s=5.0)

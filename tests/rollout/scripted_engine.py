"""A scripted engine for scheduler tests: it implements the Engine protocol, decodes one token per
event-loop tick, and its response length is a function of the prompt and the seed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from reroll.engines.base import Completion, Request
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.runner import RewardRunner


class ScriptedEngine:
    def __init__(self, length: Callable[[list[int], int], int], token: int = 5,
                 tick: float = 0.0):
        self.length, self.token, self.tick = length, token, tick
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
                tokens.append(self.token)
                logprobs.append(-0.5 - self.version)
            else:
                finish = "stop" if len(tokens) >= target else "length"
        finally:
            self.running -= 1
        return Completion(request.request_id, request.prompt_ids, tokens, logprobs, finish,
                          self.version)

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

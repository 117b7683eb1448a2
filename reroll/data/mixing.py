"""How several domains share each step's prompts: fixed weights, or weights that follow how much
each domain still has to learn (its moving mean reward).

`DomainMixer.counts` apportions `n` prompts by largest remainder on the share plus the credit
carried from earlier steps, so each domain's cumulative count stays within one prompt of its
weighted share even when a step's share is fractional (weights 1:2 over 4 prompts per step give
the first domain 1, 2, 1, 1, 2, 1, ... and the second 3, 2, 3, 3, 2, 3, ...: exactly 1/3 and
2/3 every three steps).
Its state (credits, moving rewards) goes into checkpoints: a resumed run gets the same counts.
"""

from __future__ import annotations


def apportion(quotas: list[float], n: int) -> list[int]:
    """Integer counts summing to `n`, each the floor of its quota plus one for the largest
    remainders (ties to the earlier domain). `quotas` sum to `n`."""
    counts = [max(0, int(q)) for q in quotas]
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    while sum(counts) > n:  # float noise: take back from the smallest remainder
        i = max((j for j in range(len(counts)) if counts[j] > 0),
                key=lambda j: (counts[j] - quotas[j], j))
        counts[i] -= 1
    return counts


class DomainMixer:
    def __init__(self, weights: list[float], mode: str = "fixed", floor: float = 0.1,
                 momentum: float = 0.8):
        self.weights, self.mode, self.floor, self.momentum = list(weights), mode, floor, momentum
        self.credit = [0.0] * len(weights)
        self.mean_reward: list[float | None] = [None] * len(weights)

    def shares(self) -> list[float]:
        """Each domain's share of the next step (sums to 1)."""
        if self.mode == "fixed":
            effective = self.weights
        else:
            effective = [w * max(self.floor, 1.0 - (r if r is not None else 0.0))
                         for w, r in zip(self.weights, self.mean_reward, strict=True)]
        total = sum(effective)
        return [e / total for e in effective]

    def counts(self, n: int) -> list[int]:
        """The next step's prompts per domain (sum `n`); carries the rounding over."""
        quotas = [c + s * n for c, s in zip(self.credit, self.shares(), strict=True)]
        counts = apportion(quotas, n)
        self.credit = [q - k for q, k in zip(quotas, counts, strict=True)]
        return counts

    def observe(self, index: int, mean_reward: float) -> None:
        """A domain's mean train reward of the step (for `mean_reward` weighting)."""
        old = self.mean_reward[index]
        self.mean_reward[index] = mean_reward if old is None else \
            self.momentum * old + (1 - self.momentum) * mean_reward

    def state_dict(self) -> dict:
        return {"credit": list(self.credit), "mean_reward": list(self.mean_reward)}

    def load_state_dict(self, state: dict) -> None:
        self.credit = list(state["credit"])
        self.mean_reward = list(state["mean_reward"])

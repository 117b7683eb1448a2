"""Which curves the report draws: metric names grouped into charts, one chart per group.

A group is drawn only when at least one of its metrics is in the run, so an SFT run gets its NLL
chart and an RL run its reward chart from the same list. Metrics that no group claims are drawn
one small chart each under "More metrics", so nothing the trainer logged is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GroupSpec:
    """A chart: its metrics (exact names, or every name under `prefix`), and an optional band
    drawn as mean ± std around `band[0]` using `band[1]`."""

    id: str
    title: str
    keys: tuple[str, ...] = ()
    prefix: str | tuple[str, ...] | None = None
    band: tuple[str, str] | None = None
    band_range: tuple[str, str] | None = None
    """Per-step lowest and highest value: the band is clipped to them (a reward's mean ± std
    would otherwise reach below its smallest reward or above its largest)."""
    note: str = ""


GROUPS: tuple[GroupSpec, ...] = (
    GroupSpec("reward", "Reward", ("train/reward_mean", "eval/reward_mean"),
              band=("train/reward_mean", "train/reward_std"),
              band_range=("train/reward_min", "train/reward_max"),
              note="train: mean over the step's rollouts (band: ± std, within the step's lowest "
                   "and highest reward); eval: held-out prompts"),
    GroupSpec("reward-functions", "Reward by function", prefix="train/rewards/",
              note="mean score of each summed reward function (before its weight) over the "
                   "step's rollouts"),
    GroupSpec("nll", "Negative log-likelihood", ("sft/nll", "eval/nll")),
    GroupSpec("preference", "Preference accuracy", ("pref/accuracy", "eval/accuracy"),
              note="share of pairs whose chosen response gets the higher reward (DPO: implicit "
                   "reward; reward model: score); a tie counts half"),
    GroupSpec("margin", "Reward margin (chosen - rejected)",
              ("pref/reward_margin", "eval/reward_margin")),
    GroupSpec("kl", "KL", ("actor/kl_ref", "actor/approx_kl", "actor/approx_kl_k3",
                           "actor/behaviour_kl_k3")),
    GroupSpec("entropy", "Entropy", ("actor/entropy",)),
    GroupSpec("length", "Response length (tokens)",
              ("train/response_len_mean", "train/response_len_max")),
    GroupSpec("clip", "Clip fraction", ("actor/clip_frac",)),
    GroupSpec("truncation", "Truncated responses / all-equal groups",
              ("train/truncated_frac", "env/truncated_replies_frac", "train/groups_all_equal"),
              note="agentic runs: truncated_frac is episodes ended at the context limit, "
                   "truncated_replies_frac the turns whose reply hit its token budget"),
    GroupSpec("staleness", "Staleness (policy versions)", prefix=("async/staleness", "staleness/"),
              note="how many policy versions behind the trainer the trained samples were"),
    GroupSpec("time", "Time per step (s)", ("time/step_s", "time/rollout_s", "time/train_s",
                                            "time/weight_sync_s"), prefix="time/"),
    GroupSpec("loss", "Loss", ("train/loss",)),
    GroupSpec("grad", "Gradient norm", ("train/grad_norm",)),
    GroupSpec("lr", "Learning rate", ("train/lr",)),
    GroupSpec("reward-errors", "Reward errors / timeouts", ("reward/errors", "reward/timeouts")),
)


@dataclass
class Chart:
    """One chart as the page's script draws it (see `as_json`)."""

    id: str
    title: str
    keys: list[str]
    band: tuple[str, str] | None = None
    note: str = ""
    extra: bool = False
    band_range: tuple[str, str] | None = None
    non_finite: dict[str, list[int]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "keys": self.keys,
                "band": list(self.band) if self.band else None, "note": self.note,
                "bandRange": list(self.band_range) if self.band_range else None,
                "extra": self.extra, "nonFinite": self.non_finite}


def plan_charts(keys: list[str], non_finite: dict[str, list[int]] | None = None,
                groups: tuple[GroupSpec, ...] = GROUPS) -> list[Chart]:
    """Charts for the metric names in `keys` (in the order of `groups`, then the unclaimed ones)."""
    non_finite = non_finite or {}
    groups = with_domains(groups, keys)
    present, claimed, charts = set(keys), set(), []
    for spec in groups:
        chosen = [k for k in spec.keys if k in present]
        if spec.prefix:
            chosen += [k for k in keys if k.startswith(spec.prefix) and k not in chosen]
        chosen = [k for k in chosen if k not in claimed]
        if not chosen:
            continue
        claimed.update(chosen)
        band = spec.band if spec.band and set(spec.band) <= present else None
        if band:
            claimed.add(band[1])
        band_range = spec.band_range if band and spec.band_range \
            and set(spec.band_range) <= present else None
        if band_range:
            claimed.update(band_range)
        charts.append(Chart(spec.id, spec.title, chosen, band, spec.note,
                            non_finite=_only(non_finite, chosen), band_range=band_range))
    for key in keys:
        if key not in claimed:
            charts.append(Chart("metric-" + _slug(key), key, [key], extra=True,
                                non_finite=_only(non_finite, [key])))
    return charts


DOMAIN_CHARTS = (("reward", "Reward by domain", ("train/{}/reward_mean", "eval/{}/reward_mean")),
                 ("pass", "Pass rate by domain", ("train/{}/pass_rate", "eval/{}/pass_rate")),
                 ("length", "Response length by domain (tokens)", ("train/{}/response_len_mean",)),
                 ("truncation", "Truncated responses by domain", ("train/{}/truncated_frac",)),
                 ("share", "Share of the step's prompts by domain", ("train/{}/share",)),
                 ("filtered", "Filtered groups by domain", ("train/{}/groups_filtered",)),
                 ("errors", "Reward errors by domain (cumulative)", ("train/{}/reward_errors",)))
"""Charts of a multi-domain run (`data.domains`), one curve per domain and split."""


ENV_CHARTS = (("reward", "Return by environment", ("train/{}/reward_mean", "eval/{}/reward_mean")),
              ("success", "Success rate by environment",
               ("train/{}/success_rate", "eval/{}/success_rate")),
              ("turns", "Turns per episode by environment", ("train/{}/turns_mean",
                                                             "eval/{}/turns_mean")),
              ("share", "Share of the step's groups by environment", ("train/{}/share",)),
              ("failures", "Infrastructure failures by environment",
               ("train/{}/infra_failure_frac", "eval/{}/infra_failure_frac")))
"""Charts of a multi-environment agentic run (`envs:`), one curve per environment and split."""


def with_domains(groups: tuple[GroupSpec, ...], keys: list[str]) -> tuple[GroupSpec, ...]:
    """`groups` with the per-domain (or per-environment) charts after the first (the overall
    reward), when the run has domains (metrics `train/<domain>/reward_mean`) or environments
    (`train/<env>/success_rate` as well)."""
    domains = [k.split("/")[1] for k in keys
               if k.startswith("train/") and k.endswith("/reward_mean") and k.count("/") == 2]
    if not domains:
        return groups
    envs = all(f"train/{d}/success_rate" in keys for d in domains)
    kind, charts = ("env", ENV_CHARTS) if envs else ("domain", DOMAIN_CHARTS)
    extra = tuple(GroupSpec(f"{kind}-{id_}", title,
                            tuple(p.format(d) for p in patterns for d in domains))
                  for id_, title, patterns in charts)
    return groups[:1] + extra + groups[1:]


def _only(non_finite: dict[str, list[int]], keys: list[str]) -> dict[str, list[int]]:
    return {k: non_finite[k] for k in keys if k in non_finite}


def _slug(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key).strip("-").lower()

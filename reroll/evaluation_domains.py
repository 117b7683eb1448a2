"""`reroll eval` of a multi-domain run's model: which of the run's domains are evaluated (those
with a held-out set, or those `--domain` names), and each domain's held-out prompts and reward,
as training's evaluation uses them. `reroll.evaluation` samples, scores and summarizes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError


def domain_settings(config, run: Path, given: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """A multi-domain run: every domain with a held-out set, each scored by its own reward, the
    first `eval.max_prompts` of each (as training's evaluation); `--task` needs `--reward`."""
    data, names = config.data, ", ".join(d.name for d in config.data.domains)
    shared = {"system_prompt": (data.system_prompt, "data.system_prompt"),
              "max_prompt_tokens": (data.max_prompt_tokens, "data.max_prompt_tokens")}
    if "task" in given:
        if "reward" not in given:
            raise ConfigError(f"--task: the model's run has several domains ({names}), each with "
                              f"its own reward; pass --reward for the file (or drop --task to "
                              f"evaluate every domain on its held-out set)")
        return shared
    if "reward" in given or "reward_function" in given:
        raise ConfigError(f"--reward: the model's run evaluates each of its domains ({names}) with "
                          f"its own reward (data.domains[k].reward); to score one file with "
                          f"another reward, pass --task too")
    domains = []
    for k, d in enumerate(data.domains):
        if d.eval is None and (d.reasoning_gym is None or not d.reasoning_gym.eval_size):
            continue
        if d.eval is not None and not Path(d.eval).is_file():
            raise ConfigError(f"data.domains[{k}] ({d.name}).eval of {run / 'config.yaml'}: "
                              f"{d.eval} does not exist from here; pass --task and --reward (or "
                              f"run from where the run was started)")
        if d.reward is None and d.reasoning_gym is None:
            d = d.model_copy(update={"reward": config.reward})
        domains.append(d)
    if not domains:
        raise ConfigError(f"none of the domains of {run / 'config.yaml'} ({names}) has a held-out "
                          f"set (eval, or reasoning_gym.eval_size); pass --task and --reward")
    return shared | {"domains": (domains, "data.domains"),
                     "max_prompts": (config.eval.max_prompts, "eval.max_prompts")}


def pick_domains(flag: str, domains: list[Any] | None) -> list[Any]:
    """The domains `--domain a,b` names, in the run's order."""
    if domains is None:
        raise ConfigError("--domain: only for a model of a multi-domain run (data.domains), "
                          "evaluated on its domains' held-out sets (without --task)")
    wanted = [name.strip() for name in flag.split(",") if name.strip()]
    known = [d.name for d in domains]
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ConfigError(f"--domain {flag!r}: the run's domains with a held-out set are "
                          f"{', '.join(known)}")
    return [d for d in domains if d.name in wanted]


def held_out(domain, system_prompt: str | None, max_prompts: int | None) -> tuple[list, Any]:
    """(prompt rows, reward runner) of a domain's held-out set: its eval file or generated
    reasoning-gym set, the first `max_prompts`, checked as training checks them; the caller
    closes the runner."""
    from reroll.config.rewards import MathReward
    from reroll.pipelines.domains import domain_reward, read_rows
    from reroll.pipelines.validation import check_answers, check_rules

    where = f"data.domains ({domain.name})"
    rows = read_rows(domain, where, domain.system_prompt or system_prompt)[1]
    rows = rows[:max_prompts] if max_prompts else rows
    if domain.reward is not None:
        check_answers(domain.reward.type, f"{where}.eval", rows)
        check_rules(domain.reward, rows, f"{where}.reward")
    # A file domain's reward was resolved from the run; MathReward() gives reasoning-gym's scorer
    # only its failure bounds, which an evaluation does not enforce (failures are counted).
    return rows, domain_reward(domain, MathReward())

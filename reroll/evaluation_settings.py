"""`reroll eval`'s settings: the flags, checked, and what the model's run fixes that no flag
gives (its task, reward, limits and sampling; a multi-domain run's domains), as an `EvalSpec`
for `reroll.evaluation.evaluate`."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from reroll import settings
from reroll.config.errors import ConfigError
from reroll.config.pipelines import kind_of
from reroll.evaluation import EvalSpec


def default_threads(flag: int | None) -> tuple[int | None, str | None]:
    """`--threads`; without it, as a run without `train.num_threads`: torch's default (None) on
    a quiet machine, the cores left idle on one already busy (`settings.contention`), with the
    line that says so."""
    if flag is not None:
        return flag, None
    chosen = settings.contention()
    return (chosen.threads, chosen.line("--threads N")) if chosen else (None, None)


def spec_from_args(args: argparse.Namespace) -> EvalSpec:
    """The flags, checked; a setting no flag gives comes from the model's run (when it is in
    one and `--ignore-run-config` is not set), else from EvalSpec's defaults."""
    given = {"task": args.task, "env": args.env, "episodes": args.episodes,
             "env_kwargs": _json_flag(args.env_kwargs), "max_turns": args.max_turns,
             "reward": args.reward, "reward_function": args.reward_function,
             "temperature": args.temperature, "top_p": args.top_p,
             "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
             "system_prompt": args.system_prompt, "max_prompts": args.max_prompts}
    given = {k: v for k, v in given.items() if v is not None}
    check_generates(args.model)
    run, taken = (None, {}) if args.ignore_run_config else run_settings(args.model, given, args.n)
    if not {"task", "env"} & set(given) and not {"task", "env", "domains", "envs"} & set(taken):
        raise ConfigError("--task or --env: say what to evaluate on (only a model inside a run "
                          "directory whose config has data.eval or env.id needs neither)")
    chosen = {k: v for k, (v, _) in taken.items()} | given
    if args.domain is not None:
        chosen["domains"] = pick_domains(args.domain, chosen.get("domains"))
    for flag, value, low in (("--n", args.n, 1), ("--max-new-tokens", chosen.get("max_new_tokens", 1), 1),
                             ("--max-prompt-tokens", chosen.get("max_prompt_tokens", 8), 8),
                             ("--batch-size", args.batch_size, 1),
                             ("--episodes", chosen.get("episodes", 1), 1),
                             ("--max-turns", chosen.get("max_turns", 1), 1),
                             ("--threads", 1 if args.threads is None else args.threads, 1)):
        if value < low:
            raise ConfigError(f"{flag} {value}: must be at least {low}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ConfigError(f"--max-prompts {args.max_prompts}: must be at least 1")
    if chosen.get("temperature") is not None and chosen["temperature"] < 0:
        raise ConfigError(f"--temperature {chosen['temperature']}: must be >= 0")
    if not re.fullmatch(r"(\d+(,\d+)*)?", args.k.replace(" ", "")):
        raise ConfigError(f"--k {args.k!r}: expected comma-separated integers, e.g. 2,4")
    ks = tuple(int(k) for k in args.k.replace(" ", "").split(",") if k)
    return EvalSpec(model=args.model, n=args.n, ks=ks, engine=args.engine,
                    threshold=args.threshold, seed=args.seed,
                    batch_size=args.batch_size, threads=default_threads(args.threads)[0],
                    **chosen,
                    run_config=str(run / "config.yaml") if run else None,
                    taken={k: source for k, (_, source) in taken.items()})


def _json_flag(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--env-kwargs {raw!r}: not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--env-kwargs {raw!r}: expected a JSON object")
    return value


# -- the settings of the model's run ---------------------------------------------------------------


def find_run(model: str) -> Path | None:
    """The run directory a model folder belongs to (`RUN/checkpoints/step_N`, `RUN/final`),
    when it has a config.yaml; else None."""
    path = Path(model)
    for run in (path.parent.parent if path.parent.name == "checkpoints" else None,
                path.parent if path.name == "final" else None):
        if run is not None and (run / "config.yaml").is_file():
            return run
    return None


def run_settings(model: str, given: dict[str, Any], n: int = 1
                 ) -> tuple[Path | None, dict[str, tuple[Any, str]]]:
    """(run directory, {spec field: (value, config key)}) for the settings the model's run
    fixes and no flag in `given` sets: its task (eval set or environment), reward, turn and
    token limits, system prompt and sampling. Evaluating a checkpoint under other settings than
    it was trained with (256 new tokens for a run that trained on 16, another env size) measures
    something else."""
    run = find_run(model)
    if run is None:
        return None, {}
    from reroll.config import load_config

    try:
        config = load_config(run / "config.yaml")
    except ConfigError as e:
        raise ConfigError(f"--model {model}: its run's config cannot be read to take its settings "
                          f"({e}); pass --ignore-run-config and the flags you need") from None
    kind = kind_of(config.pipeline)
    if kind.env and config.envs:
        taken = envs_settings(config, given)
    elif kind.env and config.env is None:  # an agent program's run
        taken = {}
    elif kind.env:
        other = "task" in given or given.get("env", config.env.id) != config.env.id
        taken = {} if other else _env_settings(config.env, model)
    elif "env" in given:
        taken = {}
    elif kind.rollouts and config.data.domains:  # an RL run on prompts (RLConfig)
        taken = domain_settings(config, run, given)
    else:
        taken = _prompt_settings(config, run)
    if kind.rollouts:
        taken |= {"max_new_tokens": (config.rollout.max_new_tokens, "rollout.max_new_tokens"),
                  "top_p": (config.rollout.top_p, "rollout.top_p"),
                  "temperature": (config.eval.temperature, "eval.temperature") if n == 1 else
                  (config.rollout.temperature, "rollout.temperature")}
    return run, {k: v for k, v in taken.items() if v[0] is not None and k not in given}


def _env_settings(env, model: str) -> dict[str, tuple[Any, str]]:
    """An agentic run's env settings; its context limit unset is the model's own, as in
    training, and its context policy other than `end` comes along."""
    from reroll.models.files import model_context

    context = env.max_context_tokens or model_context(model)
    return {"env": (env.id, "env.id"), "env_kwargs": (env.kwargs, "env.kwargs"),
            "max_turns": (env.max_turns, "env.max_turns"),
            "episodes": (env.eval_episodes or None, "env.eval_episodes"),
            "max_prompt_tokens": (context, "env.max_context_tokens"),
            "context": (env.context if env.context.policy != "end" else None, "env.context"),
            "system_prompt": (env.system_prompt, "env.system_prompt"),
            "history_thinking": (env.history_thinking, "env.history_thinking")}


def _prompt_settings(config, run: Path) -> dict[str, tuple[Any, str]]:
    """The held-out prompts of a run trained on a dataset (RL's prompts, SFT's or distillation's
    examples, a DPO run's pairs), with the run's reward when it has one."""
    data = config.data
    if data.eval is not None and not Path(data.eval).is_file():
        raise ConfigError(f"data.eval of {run / 'config.yaml'}: {data.eval} does not exist from "
                          f"here; pass --task (or run from where the run was started)")
    taken = {"task": (data.eval, "data.eval"), "system_prompt": (data.system_prompt,
                                                                 "data.system_prompt")}
    if not kind_of(config.pipeline).rollouts:
        # Trained without sampling (SFT, distillation, DPO): the rows' `answer` is scored by the
        # default math reward, and the whole-sequence limit bounds the prompt.
        _check_answers(data.eval, run)
        return taken | {"max_prompt_tokens": (data.max_tokens, "data.max_tokens")}
    taken["max_prompt_tokens"] = (data.max_prompt_tokens, "data.max_prompt_tokens")
    # The run's held-out reward: `eval.reward` when set (a run trained on a learned reward is
    # measured by its verifier), else `reward`; types --reward cannot name leave the default.
    reward, key = ((config.eval.reward, "eval.reward") if config.eval.reward is not None
                   else (config.reward, "reward"))
    if reward.type not in ("math", "code", "custom"):
        return taken
    return taken | {"reward": (reward.type, f"{key}.type"),
                    "reward_function": (getattr(reward, "function", None), f"{key}.function")}


def _check_answers(path: str | None, run: Path) -> None:
    """The held-out rows of a run without a reward can be scored: each has an `answer`."""
    from reroll.data.datasets import load_prompts

    if path is None:
        return
    missing = [row.source for row in load_prompts(path) if row.answer is None]
    if missing:
        raise ConfigError(f"data.eval of {run / 'config.yaml'}: {path} has no `answer` in "
                          f"{len(missing)} rows (first {missing[0]}) to score samples against; "
                          f"pass --task FILE (prompts with answers) or --env, with --reward")


def check_generates(model: str) -> None:
    """A reward model (`reroll rm`'s, a sequence classifier) scores responses and writes none."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # an adapter, or no model: the loaders name the problem
    if any(str(a).endswith("ForSequenceClassification")
           for a in config.get("architectures") or []):
        raise ConfigError(f"--model {model}: a reward model (a sequence classifier, as `reroll "
                          f"rm` trains) scores responses and does not generate; its held-out "
                          f"accuracy is its run's eval/accuracy (metrics.jsonl, `reroll view`); "
                          f"use it in a run as `reward: {{type: model, path: {model}}}`")



# -- a multi-domain run's domains ------------------------------------------------------------------


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


# -- a multi-environment run's environments --------------------------------------------------------


def envs_settings(config, given: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """A multi-environment agentic run (`envs:`): every env with held-out episodes
    (`eval_episodes`), each played with its own settings as training plays it (`--episodes`
    replaces each one's `eval_episodes`); `--env` or `--task` (something else) takes none."""
    if "env" in given or "task" in given:
        return {}
    envs = [e.model_copy(update={"eval_episodes": given["episodes"]}) if "episodes" in given
            else e for e in config.envs]
    envs = [e for e in envs if e.eval_episodes]
    if not envs:
        names = ", ".join(e.name for e in config.envs)
        raise ConfigError(f"none of the run's envs ({names}) has eval_episodes; pass --env "
                          f"and --episodes")
    return {"envs": (envs, "envs")}

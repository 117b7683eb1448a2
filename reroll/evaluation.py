"""`reroll eval`: pass@1, pass@k and mean@k of a model over a prompt dataset or a suite of
environments (multi-turn episodes), written as JSON and shown as a table.

Each prompt gets `n` samples; a sample counts as correct when its reward reaches `threshold`.
pass@k uses the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) averaged over
prompts, so pass@1 is the mean share of correct samples and pass@n is "any sample right";
mean@k is the mean reward of the samples (for rewards that are not 0/1).
A multi-domain run's model is evaluated on each of its domains' held-out sets, with each
domain's reward (`reroll.evaluation_domains`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reroll import settings
from reroll.config.errors import ConfigError
from reroll.config.pipelines import kind_of

BUILTIN_TASKS = ("arithmetic",)


# -- the metrics (pure functions) -----------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n samples, c of
    them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(scores: list[list[float]], ks: list[int], threshold: float) -> dict[str, float]:
    """`scores[i]` holds the n rewards of prompt i. Returns pass@k for each k in `ks` and mean@n."""
    n = len(scores[0])
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(s >= threshold for s in row), k)
                               for row in scores) / len(scores)
    out[f"mean@{n}"] = sum(sum(row) for row in scores) / (n * len(scores))
    return out


# -- running it -----------------------------------------------------------------------------------


@dataclass
class EvalSpec:
    """What `reroll eval` was asked to do (the CLI's flags, checked)."""

    model: str
    task: str | None = None
    env: str | None = None
    """Comma-separated environment ids (a suite); each is played for `episodes` seeds."""
    episodes: int = 32
    env_kwargs: dict[str, Any] | None = None
    max_turns: int = 8
    n: int = 1
    ks: tuple[int, ...] = ()
    reward: str = "math"
    reward_function: str | None = None
    engine: str = "hf"
    temperature: float | None = None
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_prompts: int | None = None
    max_prompt_tokens: int = 1024
    system_prompt: str | None = None
    context: Any = None
    """Episodes: the `env.context` section of the model's run (None: `end`, the episode ends
    at `max_prompt_tokens`)."""
    threshold: float = 1.0
    seed: int = 0
    batch_size: int = 256
    threads: int | None = None
    """torch threads of this process (None: torch's default, every core; `reroll eval` without
    `--threads` gives fewer on a machine already busy: `default_threads`)."""
    domains: list[Any] | None = None
    """A multi-domain run's `data.domains` (DomainConfig, a file domain's reward resolved):
    each domain is evaluated on its held-out set with its own reward."""
    envs: list[Any] | None = None
    """A multi-environment agentic run's `envs` (NamedEnvConfig): each environment is played
    on its held-out seeds with its own settings (`reroll.evaluation_envs`)."""
    run_config: str | None = None
    """The config.yaml of the run the model belongs to, when settings were taken from it."""
    taken: dict[str, str] = field(default_factory=dict)
    """Settings taken from `run_config`: spec field -> the config key it came from."""

    def sampling_temperature(self) -> float:
        """Greedy for a single sample (pass@1 of the deterministic answer); 1.0 for n > 1."""
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.n == 1 else 1.0

    def k_values(self) -> list[int]:
        ks = sorted(set(self.ks) | {1, self.n})
        bad = [k for k in ks if not 1 <= k <= self.n]
        if bad:
            raise ConfigError(f"--k {','.join(map(str, bad))}: each k must be between 1 and --n {self.n}")
        return ks


def evaluate(spec: EvalSpec) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the evaluation; returns (results, one row per sample)."""
    import torch

    from reroll.data.batch import trajectory_row
    from reroll.engines.base import SamplingParams
    from reroll.models.loading import load_tokenizer

    ks = spec.k_values()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    tokenizer = load_tokenizer(spec.model)
    scratch = tempfile.TemporaryDirectory(prefix="reroll-eval-")
    engine = _engine(spec, tokenizer, Path(scratch.name))
    params = SamplingParams(spec.max_new_tokens, spec.sampling_temperature(), spec.top_p, 0,
                            (tokenizer.eos_token_id,))
    start = time.perf_counter()
    try:
        if spec.env:
            parts = {env_id: _play_env(spec, env_id, engine, tokenizer, params)
                     for env_id in spec.env.split(",")}
        elif spec.domains:
            parts = {d.name: _sample_domain(spec, d, engine, tokenizer, params)
                     for d in spec.domains}
        elif spec.envs:
            from reroll.evaluation_envs import play_entry

            parts = {e.name: play_entry(spec, e, engine, tokenizer, params, _env_processes)
                     for e in spec.envs}
        else:
            parts = {spec.task: _sample_task(spec, engine, tokenizer, params)}
    finally:
        # vLLM's engine core is a process of its own: left to the interpreter's exit it dies
        # first and the client prints EngineDeadError.
        engine.close()
        scratch.cleanup()
    seconds = time.perf_counter() - start
    results: dict[str, Any] = {"model": spec.model, "task": spec.task, "env": spec.env,
                               "engine": spec.engine, "n": spec.n,
                               "temperature": spec.sampling_temperature(),
                               "max_new_tokens": spec.max_new_tokens,
                               "threshold": spec.threshold}
    if spec.run_config:
        results |= {"run_config": spec.run_config, "taken_from_run": dict(spec.taken)}
    per_part, samples, tokens, count = {}, [], 0, 0
    for name, (trajectories, extra) in parts.items():
        groups = len(trajectories) // spec.n
        scores = [[t.reward for t in trajectories[i * spec.n:(i + 1) * spec.n]]
                  for i in range(groups)]
        per_part[name] = {"prompts": groups, **summarize(scores, ks, spec.threshold), **extra,
                          "truncated_frac": sum(t.finish_reason == "length" for t in trajectories)
                          / len(trajectories)}
        tokens += sum(len(t.response_ids) for t in trajectories)
        count += len(trajectories)
        samples += [{"source": name, "prompt_index": i // spec.n} | trajectory_row(t)
                    for i, t in enumerate(trajectories)]
    # A suite's headline figures weigh every environment equally; a multi-domain run's weigh
    # every prompt equally, as training's `eval/reward_mean` does.
    weights = {name: part["prompts"] if spec.domains or spec.envs else 1
               for name, part in per_part.items()}
    for key in per_part[next(iter(per_part))]:
        values = [(part[key], weights[name]) for name, part in per_part.items()]
        results[key] = sum(v for v, _ in values) if key == "prompts" else \
            sum(v * w for v, w in values) / sum(w for _, w in values)
    if spec.env:
        results["envs"] = per_part
    if spec.envs:  # a multi-environment run's: training's per-environment eval metrics' names
        results["envs"] = per_part
        results["eval/reward_mean"] = results[f"mean@{spec.n}"]
        results["eval/success_rate"] = results["success_rate"]
        for name, part in per_part.items():
            results[f"eval/{name}/reward_mean"] = part[f"mean@{spec.n}"]
            results[f"eval/{name}/success_rate"] = part["success_rate"]
    if spec.domains:
        results["domains"] = per_part
        results["eval/reward_mean"] = results[f"mean@{spec.n}"]
        for name, part in per_part.items():  # the names of training's per-domain eval metrics
            results[f"eval/{name}/reward_mean"] = part[f"mean@{spec.n}"]
            results[f"eval/{name}/pass_rate"] = part["pass@1"]
    results |= {"response_len_mean": tokens / count, "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
    return results, samples


def _sample_task(spec: EvalSpec, engine, tokenizer, params) -> tuple[list, dict[str, float]]:
    from reroll.rewards import build_runner

    rows = load_task(spec)
    return _score(spec, rows, build_runner(_reward_config(spec)), engine, tokenizer, params)


def _sample_domain(spec: EvalSpec, domain, engine, tokenizer, params
                   ) -> tuple[list, dict[str, float]]:
    """A domain's held-out prompts scored by the domain's reward, as training's evaluation does."""
    from reroll.evaluation_domains import held_out

    rows, rewards = held_out(domain, spec.system_prompt, spec.max_prompts)
    return _score(spec, rows, rewards, engine, tokenizer, params)


def _score(spec: EvalSpec, rows: list, rewards, engine, tokenizer, params
           ) -> tuple[list, dict[str, float]]:
    """`spec.n` samples of each row, each scored by `rewards` (a RewardRunner, closed here)."""
    from reroll.rollout.sampling import RolloutJob, rollout

    try:
        trajectories = rollout(RolloutJob(engine, rewards, tokenizer, params,
                                          spec.max_prompt_tokens), rows, spec.n, spec.seed, step=0)
    finally:
        rewards.close()
    # A failed call (crash, time-out, NaN/inf score) scores 0 and is counted here.
    return trajectories, {"reward_errors": float(rewards.counters.errors),
                          "reward_timeouts": float(rewards.counters.timeouts),
                          "reward_nonfinite": float(rewards.counters.nonfinite)}


def _play_env(spec: EvalSpec, env_id: str, engine, tokenizer, params) -> tuple[list, dict]:
    """`n` episodes for each of `episodes` env seeds; an episode's reward is its return."""
    from reroll.envs.registry import env_arguments, make_env
    from reroll.rollout.agent_loop import AgentJob, run_episodes
    from reroll.rollout.context import from_config

    if "max_turns" in (spec.env_kwargs or {}):
        raise ConfigError("--env-kwargs: max_turns is set with --max-turns (the one turn limit, "
                          "as env.max_turns in configs)")
    kwargs = env_arguments(env_id, dict(spec.env_kwargs or {}), spec.max_turns)
    factory = functools.partial(make_env, env_id, **kwargs)
    factory()  # unknown ids and bad arguments fail here, as ConfigErrors
    hosts = _env_processes(env_id, factory)
    job = AgentJob(engine, tokenizer, hosts.make if hosts else factory, params,
                   max_turns=spec.max_turns, max_context_tokens=spec.max_prompt_tokens,
                   system_prompt=spec.system_prompt, context=from_config(spec.context))
    # Seeds far from training's (which count up from 0), so the episodes are held out.
    seeds = [1_000_000 + spec.seed * 10_000 + i for i in range(spec.episodes)]
    try:
        trajectories, stats = run_episodes(job, seeds, spec.n, spec.seed, step=0)
    finally:
        if hosts is not None:
            hosts.close()
    return trajectories, {k: v for k, v in stats.metrics().items() if k != "env/episodes"}


def _env_processes(env_id: str, factory):
    """A user's environment (`module:Class`) in an env process of its own, as training's
    `env.isolation: auto` runs it: one that ends its process fails only its episodes."""
    from reroll.envs.base import EnvError
    from reroll.envs.gem_adapter import PREFIX as GEM_PREFIX
    from reroll.envs.process import EnvProcesses
    from reroll.envs.user import is_user_id

    if not is_user_id(env_id) or env_id.startswith(GEM_PREFIX):
        return None
    try:
        return EnvProcesses(factory, env_id)
    except EnvError as e:
        raise ConfigError(f"--env: {e}") from None


def load_task(spec: EvalSpec) -> list:
    """The prompts of `--task`: a .jsonl/.parquet file, or a built-in task's eval split."""
    import tempfile

    from reroll.data.datasets import load_prompts

    if spec.task in BUILTIN_TASKS:
        from reroll.data.tasks import write_arithmetic

        with tempfile.TemporaryDirectory() as tmp:  # the split `reroll make-data` writes by default
            rows = load_prompts(write_arithmetic(tmp, 4000, 200, 0)["eval"], spec.system_prompt)
    elif Path(spec.task).is_file():
        rows = load_prompts(spec.task, spec.system_prompt)
    else:
        raise ConfigError(f"--task {spec.task}: not a file, nor a built-in task "
                          f"({', '.join(BUILTIN_TASKS)})")
    rows = rows[: spec.max_prompts] if spec.max_prompts else rows
    if not rows:
        raise ConfigError(f"--task {spec.task}: holds no prompts")
    return rows


def _reward_config(spec: EvalSpec):
    from pydantic import ValidationError

    from reroll.config.schema import CodeReward, CustomReward, MathReward

    try:
        if spec.reward == "math":
            return MathReward()
        if spec.reward == "code":
            return CodeReward()
        if not spec.reward_function:
            raise ConfigError("--reward custom needs --reward-function package.module:function")
        return CustomReward(function=spec.reward_function)
    except ValidationError as e:
        raise ConfigError(f"--reward-function {spec.reward_function!r}: "
                          f"{e.errors()[0]['msg']}") from None


def _engine(spec: EvalSpec, tokenizer, model_dir: Path):
    """The engine named by --engine, built as training builds its rollout engine (its other
    settings, e.g. vLLM's, at their defaults); `model_dir`: scratch space (`_servable`)."""
    from pydantic import ValidationError

    from reroll.config.engines import ENGINE_TYPES
    from reroll.config.schema import RolloutConfig
    from reroll.engines import build_engine
    from reroll.models.devices import machine_devices, resolve_device

    try:
        rollout = RolloutConfig(engine=spec.engine, max_batch_size=spec.batch_size)
    except ValidationError:
        raise ConfigError(f"--engine {spec.engine}: choose one of {', '.join(ENGINE_TYPES)}") \
            from None
    # The HF engine on the GPU when there is one (`distributed.device: auto`, as training does).
    device = resolve_device("auto", machine_devices()[0])
    return build_engine(rollout, _servable(spec, model_dir), pad_token_id=tokenizer.pad_token_id,
                        seed=spec.seed, device=device)


def _servable(spec: EvalSpec, scratch: Path) -> str:
    """The model folder the engine loads: a LoRA checkpoint (adapter only) is merged into
    `scratch` first for engines that read folders themselves (vLLM); the hf engine merges on
    load."""
    from reroll.export import export
    from reroll.models.lora import is_adapter_dir

    if spec.engine == "hf" or not is_adapter_dir(spec.model):
        return spec.model
    export(spec.model, str(scratch / "merged"), merge=True)
    return str(scratch / "merged")


# -- command line ---------------------------------------------------------------------------------


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    text = "evaluate a model: pass@1, pass@k and mean@k over a dataset or environments"
    p = subparsers.add_parser("eval", help=text, description=text + ". Writes JSON, shows a table. "
                              "A model inside a run directory (runs/X/checkpoints/step_N, "
                              "runs/X/final) is evaluated on the run's task with its settings "
                              "(eval set or environment, reward, turns, token limits, system "
                              "prompt, eval temperature) unless a flag says otherwise; the "
                              "settings taken are printed. A multi-domain run's model is "
                              "evaluated on each domain's held-out set with its own reward "
                              "(eval/<domain>/reward_mean and pass_rate, as in training).")
    p.add_argument("--model", required=True, help="model folder (Hugging Face format) or checkpoint")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--task", help="prompts: a .jsonl/.parquet file with prompt and answer, or "
                                      f"a built-in task ({', '.join(BUILTIN_TASKS)}); default: "
                                      "the run's data.eval")
    where.add_argument("--env", help="environment ids, comma-separated (a suite), played as "
                                     "multi-turn episodes; `reroll envs` lists them; default: "
                                     "the run's env.id")
    p.add_argument("--ignore-run-config", action="store_true",
                   help="use the built-in defaults below, not the settings of the model's run")
    p.add_argument("--episodes", type=int, help="env seeds per environment (default 32, or the "
                                                "run's env.eval_episodes)")
    p.add_argument("--env-kwargs", help="JSON keyword arguments of the environments (default {}, "
                                        "or the run's env.kwargs)")
    p.add_argument("--max-turns", type=int, help="turn cap per episode (default 8, or the run's "
                                                 "env.max_turns)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--k", default="", help="extra k values for pass@k, e.g. 2,4 (1 and n always)")
    p.add_argument("--reward", choices=["math", "code", "custom"],
                   help="default math, or the run's reward.type")
    p.add_argument("--reward-function", help="for --reward custom: package.module:function")
    p.add_argument("--engine", default="hf", help="inference engine (default hf)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature (default: the run's eval.temperature; else 0, "
                        "greedy, for --n 1 and 1.0 for more)")
    p.add_argument("--top-p", type=float, help="default 1.0, or the run's rollout.top_p")
    p.add_argument("--max-new-tokens", type=int,
                   help="default 256, or the run's rollout.max_new_tokens (per turn for envs)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="longest prompt (for envs: the whole episode's context); default 1024, "
                        "or the run's data.max_prompt_tokens / env.max_context_tokens")
    p.add_argument("--max-prompts", type=int, help="evaluate the first N prompts only (of each "
                                                   "domain; default: a multi-domain run's "
                                                   "eval.max_prompts)")
    p.add_argument("--domain", help="a multi-domain run's model: evaluate only these domains "
                                    "(comma-separated names; default: every domain with a "
                                    "held-out set)")
    p.add_argument("--system-prompt", help="default none, or the run's system prompt")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="a sample is correct when its reward is at least this (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256, help="most sequences decoded together")
    p.add_argument("--threads", type=int, help="torch threads (default: every core, or the cores "
                                               "left idle when the machine is already busy)")
    p.add_argument("--out", help="results JSON (default runs/eval/<model>-<task>.json); the "
                                 "samples go next to it as .samples.jsonl")
    p.set_defaults(fn=cmd_eval)
    return p


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
                          "directory whose config has data.eval, env.id or envs needs neither)")
    chosen = {k: v for k, (v, _) in taken.items()} | given
    if args.domain is not None:
        from reroll.evaluation_domains import pick_domains

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
        from reroll.evaluation_envs import envs_settings

        taken = envs_settings(config, model, given)
    elif kind.env and config.env is None:  # an agent program's run
        taken = {}
    elif kind.env:
        other = "task" in given or given.get("env", config.env.id) != config.env.id
        taken = {} if other else _env_settings(config.env, model)
    elif "env" in given:
        taken = {}
    elif getattr(config.data, "domains", None):
        from reroll.evaluation_domains import domain_settings

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
            "system_prompt": (env.system_prompt, "env.system_prompt")}


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


def check_out(out: Path) -> None:
    """The results file can be written: checked before the evaluation, which would otherwise
    run to the end and be lost."""
    import tempfile

    if out.is_dir():
        raise ConfigError(f"--out {out}: is a directory (give a .json file name)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(f"--out {out}: its folder {out.parent} cannot be created or written "
                          f"({e.strerror or e})") from None


def _shown(spec: EvalSpec, key: str) -> Any:
    """A setting as printed: the domains by name."""
    value = getattr(spec, key)
    return [d.name for d in value] if key == "domains" else value


def cmd_eval(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from reroll.tracking.jsonsafe import dumps

    spec = spec_from_args(args)
    if spec.taken:
        Console(stderr=True).print(
            f"settings from {spec.run_config} (a flag overrides each; --ignore-run-config drops "
            f"them): " + ", ".join(f"{k}={_shown(spec, k)!r} ({key})"
                                   for k, key in spec.taken.items()), highlight=False)
    threads_line = default_threads(args.threads)[1]
    if threads_line:
        Console(stderr=True).print(threads_line, highlight=False)
    what = spec.task or spec.env or "domains"
    out = Path(args.out) if args.out else Path("runs") / "eval" / (
        f"{Path(spec.model).name or 'model'}-{Path(what).stem}.json")
    check_out(out)
    results, samples = evaluate(spec)
    out.write_text(dumps(results, indent=2) + "\n")
    samples_path = out.with_suffix(".samples.jsonl")
    samples_path.write_text("".join(dumps(s) + "\n" for s in samples))
    if spec.domains:
        what = "domains " + ", ".join(d.name for d in spec.domains)
    table = Table(title=f"{spec.model} on {what} ({results['prompts']} "
                        f"{'episodes' if spec.env else 'prompts'}, n={spec.n})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results.items():
        if key.startswith(("pass@", "mean@", "env/", "eval/")) or key in (
                "truncated_frac", "response_len_mean", "tokens_per_s", "seconds"):
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    console.print(f"results: {out}  samples: {samples_path}")
    print(dumps(results | {"out": str(out)}))

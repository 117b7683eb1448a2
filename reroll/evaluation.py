"""`reroll eval`: pass@1, pass@k and mean@k of a model over a prompt dataset or a suite of
environments (multi-turn episodes), written as JSON and shown as a table.

Each prompt gets `n` samples; a sample counts as correct when its reward reaches `threshold`.
pass@k uses the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) averaged over
prompts, so pass@1 is the mean share of correct samples and pass@n is "any sample right";
mean@k is the mean reward of the samples (for rewards that are not 0/1).
The samples come from the task training evaluates on, built by the same factories (the prompt
task, a multi-domain run's domains, an environment) and its `evaluate`, which keeps them grouped
per prompt or env seed (`Task.eval_sets`); only the pass@k on top is computed here. The flags and
the settings of the model's run are `reroll.evaluation_settings`'s, the command line
`reroll.evaluation_command`'s.
"""

from __future__ import annotations

import functools
import math
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError

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
    history_thinking: str | None = None
    """Episodes: the run's `env.history_thinking` (None: `keep`, as training's agent loop)."""
    domains: list[Any] | None = None
    """A multi-domain run's `data.domains` (DomainConfig, a file domain's reward resolved):
    each domain is evaluated on its held-out set with its own reward."""
    envs: list[Any] | None = None
    """A multi-environment agentic run's `envs` (NamedEnvConfig): each environment is played
    on its held-out seeds with its own settings, as training's evaluation plays them."""
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
    from reroll.models.loading import load_tokenizer

    ks = spec.k_values()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    tokenizer = load_tokenizer(spec.model)
    scratch = tempfile.TemporaryDirectory(prefix="reroll-eval-")
    tasks: list = []
    try:
        # The tasks first: a bad env id, prompt file or reward fails before the model loads.
        for build in _task_builders(spec, tokenizer, Path(scratch.name)):
            tasks.append(build())
        sets, seconds = _sample(spec, tasks, tokenizer, Path(scratch.name))
    finally:
        for task in tasks:
            task.close()
        scratch.cleanup()
    results: dict[str, Any] = {"model": spec.model, "task": spec.task, "env": spec.env,
                               "engine": spec.engine, "n": spec.n,
                               "temperature": spec.sampling_temperature(),
                               "max_new_tokens": spec.max_new_tokens,
                               "threshold": spec.threshold}
    if spec.run_config:
        results |= {"run_config": spec.run_config, "taken_from_run": dict(spec.taken)}
    per_part, samples, tokens, count = {}, [], 0, 0
    for s in sets:
        trajectories = s.trajectories()
        scores = [[t.reward for t in group] for group in s.groups]
        per_part[s.name] = {"prompts": len(s.groups), **summarize(scores, ks, spec.threshold),
                            **s.counters,
                            "truncated_frac": sum(t.finish_reason == "length"
                                                  for t in trajectories) / len(trajectories)}
        tokens += sum(len(t.response_ids) for t in trajectories)
        count += len(trajectories)
        samples += [{"source": s.name, "prompt_index": i} | trajectory_row(t)
                    for i, group in enumerate(s.groups) for t in group]
    results |= _headline(spec, per_part)
    results |= {"response_len_mean": tokens / count, "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
    return results, samples


def _sample(spec: EvalSpec, tasks: list, tokenizer, scratch: Path) -> tuple[list, float]:
    """Each task's held-out sets (`Task.eval_sets`), sampled by its `evaluate` on the engine
    `--engine` names; (sets, seconds)."""
    from reroll.engines.base import SamplingParams

    _refuse_images(spec, tasks)
    engine = _engine(spec, tokenizer, scratch)
    params = SamplingParams(spec.max_new_tokens, spec.sampling_temperature(), spec.top_p, 0,
                      (tokenizer.eos_token_id,))
    start = time.perf_counter()
    sets = []
    try:
        for task in tasks:
            task.start(engine)
            task.evaluate(params)
            sets += task.eval_sets
    finally:
        # vLLM's engine core is a process of its own: left to the interpreter's exit it dies
        # first and the client prints EngineDeadError.
        engine.close()
    if spec.task and not spec.domains:  # the set is named as the flag (or the run) named it
        sets = [replace(s, name=spec.task) for s in sets]
    return sets, time.perf_counter() - start


def _refuse_images(spec: EvalSpec, tasks: list) -> None:
    """`--engine vllm` on held-out prompts with images of a model whose image prompts vLLM is
    not given (docs/vlm.md): refused before the engine starts, not an error mid-evaluation."""
    from reroll.pipelines.validation import vllm_image_refusal

    if spec.engine != "vllm":
        return
    parts = [part for task in tasks for part in [task, *getattr(task, "domains", [])]]
    row = next((row for part in parts for row in getattr(part, "eval_rows", [])
                if row.has_images), None)
    why = vllm_image_refusal(spec.model) if row is not None else ""
    if why:
        raise ConfigError(f"--engine vllm: vLLM does not take these image prompts yet (the "
                          f"held-out prompts hold images, e.g. {row.source}; {why}); use "
                          f"--engine hf")


def _headline(spec: EvalSpec, per_part: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The figures over every set: a suite's weigh every environment equally; a multi-domain
    run's weigh every prompt equally, as training's `eval/reward_mean` does."""
    out: dict[str, Any] = {}
    weights = {name: part["prompts"] if spec.domains or spec.envs else 1
               for name, part in per_part.items()}
    for key in per_part[next(iter(per_part))]:
        values = [(part[key], weights[name]) for name, part in per_part.items()]
        out[key] = sum(v for v, _ in values) if key == "prompts" else \
            sum(v * w for v, w in values) / sum(w for _, w in values)
    if spec.env:
        out["envs"] = per_part
    if spec.envs:  # the names of training's per-environment eval metrics
        out["envs"] = per_part
        out["eval/reward_mean"] = out[f"mean@{spec.n}"]
        out["eval/success_rate"] = out["success_rate"]
        for name, part in per_part.items():
            out[f"eval/{name}/reward_mean"] = part[f"mean@{spec.n}"]
            out[f"eval/{name}/success_rate"] = part["success_rate"]
    if spec.domains:
        out["domains"] = per_part
        out["eval/reward_mean"] = out[f"mean@{spec.n}"]
        for name, part in per_part.items():  # the names of training's per-domain eval metrics
            out[f"eval/{name}/reward_mean"] = part[f"mean@{spec.n}"]
            out[f"eval/{name}/pass_rate"] = part["pass@1"]
    return out


# -- the tasks, built as training builds them -----------------------------------------------------


def _task_builders(spec: EvalSpec, tokenizer, scratch: Path) -> list[Callable[[], Any]]:
    """The training tasks the evaluation samples from, unbuilt: an `EnvTask` per environment of
    the suite, else the prompt task of `prompt_task` (a multi-domain run's `DomainTask`)."""
    from reroll.pipelines.agentic import EnvTask
    from reroll.pipelines.rlvr import prompt_task

    if spec.env:
        if "max_turns" in (spec.env_kwargs or {}):
            raise ConfigError("--env-kwargs: max_turns is set with --max-turns (the one turn "
                              "limit, as env.max_turns in configs)")
        return [functools.partial(EnvTask, _env_config(spec, env_id), tokenizer)
                for env_id in spec.env.split(",")]
    if spec.envs:  # a multi-environment run's: the mix of environments training evaluates
        from reroll.config.agentic import AgenticConfig
        from reroll.pipelines.agentic import EnvTask
        from reroll.pipelines.envmix import EnvMixTask

        config = _config(AgenticConfig, _common(spec) | {
            "envs": [e.model_dump() for e in spec.envs]})
        return [functools.partial(EnvMixTask, config, tokenizer, env_task=EnvTask)]
    config = _prompt_config(spec, scratch)
    if spec.domains:  # the domains' errors name them as the run's config does
        return [functools.partial(prompt_task, config, tokenizer)]

    def build():
        try:
            return prompt_task(config, tokenizer)
        except ConfigError as e:  # the file is named by the flag (`data.train` here is --task's)
            raise ConfigError(re.sub(r"^data\.(train|eval)\b", f"--task {spec.task}",
                                     str(e))) from None
    return [build]


def _common(spec: EvalSpec) -> dict[str, Any]:
    """What an RL config of the evaluation has besides its task: the model, the seed, the
    samples per prompt and the response budget (the engine and its sampling are `reroll
    eval`'s own, so the rest keeps its defaults)."""
    return {"model": {"path": spec.model}, "steps": 1, "seed": spec.seed,
            "rollout": {"max_new_tokens": spec.max_new_tokens},
            "eval": {"samples_per_prompt": spec.n, "max_prompts": spec.max_prompts}}


def _prompt_config(spec: EvalSpec, scratch: Path):
    """An RLVR config whose held-out set is `--task`'s prompts (the file trains nothing), or a
    multi-domain run's domains."""
    from reroll.config.schema import RLConfig

    data: dict[str, Any] = {"system_prompt": spec.system_prompt,
                            "max_prompt_tokens": spec.max_prompt_tokens}
    if spec.domains:
        data["domains"] = spec.domains
    else:
        path = task_file(spec, scratch)
        data |= {"train": path, "eval": path}
    return _config(RLConfig, _common(spec) | {"data": data, "reward": _reward_config(spec)})


def _env_config(spec: EvalSpec, env_id: str):
    """An agentic config of one environment of the suite; its held-out seeds are training's."""
    from reroll.config.agentic import AgenticConfig

    env: dict[str, Any] = {"id": env_id, "kwargs": dict(spec.env_kwargs or {}),
                           "max_turns": spec.max_turns, "eval_episodes": spec.episodes,
                           "max_context_tokens": spec.max_prompt_tokens,
                           "system_prompt": spec.system_prompt,
                           "history_thinking": spec.history_thinking or "keep"}
    if spec.context is not None:
        env["context"] = spec.context
    return _config(AgenticConfig, _common(spec) | {"env": env})


def _config(cls, values: dict[str, Any]):
    from pydantic import ValidationError

    try:
        return cls.model_validate(values)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise ConfigError(f"reroll eval: {where}: {error['msg']}") from None


def task_file(spec: EvalSpec, scratch: Path) -> str:
    """The prompts file of `--task`: the file, or a built-in task's eval split written to
    `scratch`."""
    from reroll.data.datasets import load_prompts

    if spec.task in BUILTIN_TASKS:
        from reroll.data.tasks import write_arithmetic

        # the split `reroll make-data` writes by default
        path = str(write_arithmetic(str(scratch / "task"), 4000, 200, 0)["eval"])
    elif Path(spec.task).is_file():
        path = spec.task
    else:
        raise ConfigError(f"--task {spec.task}: not a file, nor a built-in task "
                          f"({', '.join(BUILTIN_TASKS)})")
    if not load_prompts(path, spec.system_prompt):
        raise ConfigError(f"--task {spec.task}: holds no prompts")
    return path


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

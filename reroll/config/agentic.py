"""Config of the agentic pipeline (`pipeline: agentic`): multi-turn episodes in an environment
instead of prompts and a reward function. The other sections are RLVR's."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from reroll.config.base import Section, choice
from reroll.config.rewards import JudgeReward, ModelReward
from reroll.config.scheduling import agentic_scheduling_errors
from reroll.config.schema import RLRunConfig


class ContextEnd(Section):
    """The episode ends cleanly (finish reason `length`, `env/context_limit_frac`) when its
    history leaves no room for a reply: every episode stays one append-only sample."""

    policy: Literal["end"] = "end"
    """Which policy: `end`, `drop_oldest`, `truncate` or `hook`."""


class ContextDropOldest(Section):
    """The oldest exchanges (a model turn and the observation or tool results that answered
    it) are dropped from the history, always keeping the system prompt, the first user message
    (the task) and the latest exchange."""

    policy: Literal["drop_oldest"] = "drop_oldest"
    """Which policy: `end`, `drop_oldest`, `truncate` or `hook`."""
    target_fraction: float = Field(0.5, gt=0, le=1)
    """Exchanges are dropped until the history plus one reply (`rollout.max_new_tokens`) fits in
    this fraction of `env.max_context_tokens`: below 1, several turns append before the next
    edit, so the trained chain (the last) holds more turns. Where nothing more can be dropped
    and no reply fits, the episode ends (`length`)."""


class ContextTruncate(Section):
    """Every observation (user messages after the first, and tool results) is cut to its first
    `observation_tokens` tokens when the history outgrows the context; later observations come
    in whole until it outgrows it again."""

    policy: Literal["truncate"] = "truncate"
    """Which policy: `end`, `drop_oldest`, `truncate` or `hook`."""
    observation_tokens: int = Field(128, ge=1)
    """Most tokens each observation keeps (its content, as the tokenizer encodes it). Where the
    cut history still leaves no room for a reply, the episode ends (`length`)."""


class ContextHook(Section):
    """Your own function edits the history when it outgrows the context."""

    policy: Literal["hook"] = "hook"
    """Which policy: `end`, `drop_oldest`, `truncate` or `hook`."""
    function: str = Field(..., min_length=1)
    """`module:function(messages) -> messages`, importable from the working directory,
    checked at start: it gets a copy of the conversation (chat messages, `role` and `content`)
    and returns the one the model sees next (summarised, filtered, ...). A hook that raises or
    returns something else fails its episode (`env/errors`, masked from the loss); one whose
    result leaves no room for a reply ends it (`length`)."""


ContextPolicyConfig = choice("policy", "end", ContextEnd, ContextDropOldest, ContextTruncate,
                             ContextHook)


class EnvConfig(Section):
    """The environment episodes run in, and the limits of an episode."""

    id: str = Field(..., min_length=1)
    """A built-in environment (`reroll envs` lists them), `gem:<id>` for a gem-llm one, or your
    own: `module:Class` (or a factory function) importable from the working directory or an
    installed package, or `path/to/file.py:Class`; checked at start against the Env protocol
    (docs/agentic.md, "Write your own environment")."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor (e.g. `high: 8` for guess_number),
    except the turn limit, which is `max_turns`; `reroll envs --describe ID` lists them with
    their defaults and docs."""
    max_turns: int = Field(8, ge=1, le=1000)
    """Most model turns per episode, the one turn limit: the agent loop stops there, and an env
    that takes a `max_turns` argument (every built-in one; gem ones through a wrapper) gets this
    value (the env may still end an episode earlier, e.g. when solved). `kwargs.max_turns` is
    refused."""
    max_context_tokens: int | None = Field(None, ge=16)
    """First prompt plus every turn's tokens (one engine request's prompt and reply). None: the
    model's own context (`max_position_embeddings` in its config.json: 8192 for
    SmolLM2-135M-Instruct, 40960 for Qwen3); a number past the model's context is refused at
    start. What happens when the history outgrows it is `context`."""
    context: ContextPolicyConfig = Field(default_factory=lambda: ContextEnd())
    """What happens when an episode's history outgrows `max_context_tokens` (docs/agentic.md,
    "Context management"): `end` (the episode ends, finish reason `length`), `drop_oldest`,
    `truncate` or `hook` (your `module:function(messages) -> messages`). The three edits
    rewrite history, so the episode's later turns are a new token chain; the last chain
    trains (`env/chains_dropped` counts the others)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Limit of one env reset or step; past it the episode fails (`env/errors`), the run goes on.
    A call past it is abandoned where it runs (a thread cannot be stopped; with `isolation:
    process` its host process is killed when the run ends)."""
    isolation: Literal["auto", "thread", "process"] = "auto"
    """Where the environments' `reset`/`step` run. `thread`: in threads of the trainer's process
    (the cheapest; a step past `step_timeout_s` is abandoned, but an env that exits or crashes
    its process ends the run). `process`: in env host processes of their own
    (`num_processes`): an env that exits, crashes or hangs fails only its episodes
    (`env/errors`, with the exit code), the run goes on and the process is started again;
    about 0.3 ms more per step and a second or two to start. The environment must be importable
    by a new process (an `env.id`; an object given to the Python API must be a class or
    function of an importable module). `auto`: `process` for your own environment
    (`module:Class`, `path/to/file.py:Class`), `thread` for built-in and gem ones and for
    objects given to the Python API. With `distributed.env` the env actors are processes
    already and this is not used."""
    num_processes: int = Field(1, ge=1, le=64)
    """Env host processes with `isolation: process`; each new episode goes to the one with the
    fewest live environments (several let CPU-heavy envs step in parallel)."""
    system_prompt: str | None = None
    """Prepended as a system message to every episode."""
    history_thinking: Literal["keep", "strip"] | None = None
    """How the model's earlier turns appear in later turns' contexts when the chat template
    rewrites history (Qwen3's drops earlier turns' `<think>` blocks). Unset: checked at start,
    and a template that rewrites history is an error asking to choose. `keep`: train on the
    tokens as generated, earlier reasoning included (exact token in/token out, one sample per
    episode; contexts differ from what a template-based server shows the model). `strip`: every
    turn's context rendered by the template; the turns form token chains (a dropped think
    block starts a new one) and each episode trains its last chain, exactly the engine's tokens
    (`env/chains_dropped` counts the others; docs/agentic.md)."""
    tool_parser: Literal["hermes", "llama3_json"] = "hermes"
    """How tool calls are read from the model's text, for an environment that declares
    `tools`: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Hermes,
    Qwen2.5, Qwen3) or `llama3_json` (the reply is `{"name": ..., "parameters": {...}}`, Llama
    3.1). A template without tool support gets the tools in a system block asking for this form
    (docs/agentic.md, "Tools")."""
    tool_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Limit of one tool call; past it the call's result is an error message to the model
    (`env/tool_errors`), the episode goes on."""
    train_seeds: int = Field(100_000, ge=1)
    """Training episodes reset the env with seeds drawn from [0, train_seeds)."""
    eval_episodes: int = Field(32, ge=0)
    """Held-out episodes per evaluation, with seeds from 10^9 upwards (never used in training)."""
    reset_retries: int = Field(2, ge=0, le=10)
    """More tries of a reset that failed (raised, timed out, returned the wrong shape), each on a
    fresh environment after a backoff (`reset_backoff_s`, doubled each time), before the episode
    counts as an infrastructure failure (`env/reset_retries`, `env/errors`)."""
    reset_backoff_s: float = Field(0.5, ge=0, le=60)
    """Wait before the first reset retry; each next retry waits twice as long."""
    max_failure_rate_step: float = Field(1.0, gt=0, le=1)
    """Stop the run (exit 1, the env and its last error named) when this share of one step's
    episodes ended in an infrastructure failure (`env_error`: a reset or step that raised,
    timed out or returned the wrong shape or a non-finite reward; the evaluation before it
    included). 1.0: a step where every episode failed."""
    max_failure_rate_run: float = Field(0.5, gt=0, le=1)
    """Stop the run (exit 1) when this share of all episodes since the start ended in an
    infrastructure failure (`env/infra_failure_frac` is each step's share)."""
    redundancy: int = Field(0, ge=0)
    """Extra episodes started per group; the first `rollout.group_size` to finish are kept and
    the rest aborted (ROLL's redundant environments)."""

    @model_validator(mode="after")
    def _one_turn_limit(self) -> EnvConfig:
        if "max_turns" in self.kwargs:
            raise ValueError(
                f"env.kwargs.max_turns ({self.kwargs['max_turns']}): the turn limit is set in one "
                f"place, env.max_turns (it ends the agent loop and is passed to the environment); "
                f"move the value there and remove it from env.kwargs")
        return self


class NamedEnvConfig(EnvConfig):
    """One environment of a multi-environment run (`envs:`): an `env:` section plus its name
    and its share of each step's groups."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]+$")
    """Names the environment's metrics (`train/<name>/success_rate`, `eval/<name>/...`) and its
    errors; unique among `envs`."""
    weight: float = Field(1.0, gt=0)
    """The environment's share of each step's `rollout.prompts_per_step` groups is weight / (sum
    of the weights), or, with `env_mix.reweight: success_rate`, follows its success rate."""


class EnvMixConfig(Section):
    """How the environments of `envs:` share each step's groups (as RLVR's `data.reweight`)."""

    reweight: Literal["fixed", "success_rate"] = "fixed"
    """`fixed`: in proportion to each env's `weight` (shares that do not divide evenly are
    carried over, so over steps each env's count stays within one group of its share);
    `success_rate`: in proportion to `weight * max(reweight_floor, 1 - s)` where s is the env's
    moving train success rate: environments with more left to learn get more groups."""
    reweight_floor: float = Field(0.1, gt=0, le=1)
    """`success_rate`: the smallest factor a solved environment's weight is multiplied by."""
    reweight_momentum: float = Field(0.8, ge=0, lt=1)
    """`success_rate`: s <- momentum * s + (1 - momentum) * the step's success rate."""


class AgentConfig(Section):
    """An agent program that drives itself through reroll's OpenAI-compatible gateway, instead
    of an environment driven by the built-in loop (docs/agentic.md, "Train your own harness").
    Each episode gets a task row, a base URL and an API key of its own session; every call is
    recorded token for token and trained on."""

    entrypoint: str | None = None
    """`module:function`, importable from the working directory: `async def function(task,
    base_url, api_key) -> float | None` (a plain function works too), returning the episode's
    reward or None. Exactly one of `entrypoint` and `command`."""
    command: list[str] | None = None
    """A program to run per episode, e.g. `[python, my_agent.py]`: it gets `OPENAI_BASE_URL`,
    `OPENAI_API_KEY` and `REROLL_TASK` (the task row as JSON) in its environment and the task
    row on stdin; a last stdout line that is a number (or `{"reward": x}`) is its reward; a
    non-zero exit status is a crash."""
    tasks: str = Field(..., min_length=1)
    """A JSONL file of task rows (any JSON objects: `prompt`, `answer`, ...), each given to
    the agent as `task`. Steps draw `rollout.prompts_per_step` rows, `rollout.group_size`
    episodes each."""
    eval_tasks: str | None = None
    """Held-out task rows for evaluation (`eval/reward_mean`, `eval/success_rate`); None: no
    evaluation."""
    verifier: str | None = None
    """`module:function(task, messages) -> float`: scores an episode from its final
    conversation when the agent returned no reward and posted none to `<base_url>/reward`."""
    time_limit_s: float = Field(300.0, gt=0)
    """Wall-clock limit of one episode's agent; past it the agent is killed (a command) or
    abandoned (an entrypoint), its session is closed (later calls get 409) and the episode
    counts as `gateway/timeout`, masked from the loss."""
    max_context_tokens: int | None = Field(None, ge=16)
    """Prompt plus completion of one call; a call whose prompt leaves no room is refused with
    `context_length_exceeded` (the harness sees an OpenAI error), a completion stops there.
    None: the model's own context (`max_position_embeddings`, as `env.max_context_tokens`); a
    number past it is refused at start."""
    tool_parser: Literal["hermes", "llama3_json"] = "hermes"
    """The tool-call format the model writes (as `env.tool_parser`): the calls it writes come
    back to the agent as `tool_calls` when its request offered `tools`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of a `command` agent."""
    host: str = "127.0.0.1"
    """Where the gateway listens (`0.0.0.0` for harnesses on other machines)."""
    port: int = Field(0, ge=0, le=65535)
    """The gateway's port; 0: any free port (the URL is given to each agent)."""

    @model_validator(mode="after")
    def _one_program(self) -> AgentConfig:
        if (self.entrypoint is None) == (self.command is None):
            raise ValueError("give exactly one of agent.entrypoint (module:function) and "
                             "agent.command (a program and its arguments)")
        if self.command is not None and not self.command:
            raise ValueError("agent.command is empty: name the program to run")
        return self


class EpisodeScore(Section):
    """How a learned reward of whole episodes enters their return."""

    weight: float = Field(1.0, ge=0)
    """The learned reward's score times this is added to the episode's last turn (so turn-level
    credit, `rebn`, `gigpo` and `ipa_chunk`, sees it where the episode ended)."""
    env_weight: float = Field(1.0, ge=0)
    """The environment's own rewards are multiplied by this: 0 trains on the learned reward
    alone (the env's return and success rate are still reported, `train/env_return_mean`,
    `eval/env_return_mean`, `eval/success_rate`: the true measure of a learned reward)."""


class EpisodeModelReward(ModelReward, EpisodeScore):
    """A reward model (`reroll rm`) scores each finished episode: the first observation as the
    prompt, the rest of the episode as the response (the policy's replies and the
    environment's observations in the chat template's tokens, as the policy saw them, ending
    with the environment's last observation, the outcome; the `response` of the episode's row
    in `reroll eval --env`'s samples and the run's rollouts)."""


class EpisodeJudgeReward(JudgeReward, EpisodeScore):
    """An LLM judge scores each finished episode: `{question}` is the first observation,
    `{response}` the rest of the episode (the policy's replies and the environment's
    observations in the chat template's tokens, ending with the environment's last
    observation, the outcome); `{reference}` is empty."""


class AgenticConfig(RLRunConfig):
    """`reroll train CONFIG.yaml` with `pipeline: agentic`: RL on multi-turn environment episodes."""

    pipeline: Literal["agentic"] = "agentic"
    """Which pipeline this config is for."""
    name: str = Field("agentic", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    env: EnvConfig | None = None
    """The environment the built-in agent loop runs (exactly one of `env`, `envs` and `agent`)."""
    envs: list[NamedEnvConfig] | None = None
    """Several environments trained in one run (docs/agentic.md, "Several environments"), each
    an `env:` section with a `name` and a `weight`: each step's groups are drawn across them by
    weight (`env_mix`); metrics per environment under `train/<name>/` and `eval/<name>/` (its
    `eval_episodes`). Exactly one of `env`, `envs` and `agent`."""
    env_mix: EnvMixConfig = Field(default_factory=EnvMixConfig)
    """How the `envs` share each step's groups (fixed weights, or by success rate)."""
    agent: AgentConfig | None = None
    """An agent program trained through the gateway instead of an environment."""
    reward: choice("type", "model", EpisodeModelReward, EpisodeJudgeReward) | None = None
    """A learned reward of each finished episode besides the environment's own: `type: model`
    (a reward model, e.g. trained by `reroll rm` on episodes paired by their outcome) or `type:
    judge` (an LLM judge), with the keys of RLVR's `reward:` of that type, plus `weight` and
    `env_weight`. It runs beside the episodes (a judge's or reward model's batches gather the
    episodes that end together), or in reward actors with `distributed.reward`, under the
    same time limit and failure counting as every reward (`reward/*`). None: the environment's
    rewards alone."""

    @model_validator(mode="after")
    def _check_batch(self) -> AgenticConfig:
        problems = self.batch_errors() + agentic_scheduling_errors(self)
        given = [k for k in ("env", "envs", "agent") if getattr(self, k) is not None]
        if len(given) != 1:
            problems.append("an agentic run needs exactly one of `env:` (an environment for "
                            "the built-in loop), `envs:` (a list of them) and `agent:` (your own "
                            "agent program)" + (f"; this config gives {' and '.join(given)}"
                                                if given else ""))
        problems += self._envs_errors()
        if self.agent is not None and self.reward is not None:
            problems.append("`reward:` scores environment episodes; an agent's reward comes "
                            "from its return value, a POST to its session or agent.verifier")
        if self.agent is not None and self.distributed.env is not None:
            problems.append("distributed.env places environments; an `agent:` run has none")
        if self.distributed.reward is not None and self.reward is None:
            problems.append("distributed.reward places a learned reward (`reward:`), which this "
                            "agentic run has none of (its episodes are scored by their "
                            "environments): remove it, or add a `reward:` section")
        distill = self.algorithm.distill
        if distill is not None and distill.teachers:
            problems.append("algorithm.distill.teachers routes dataset rows by their `tag`; "
                            "agentic episodes have no rows: give one `teacher`")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _envs_errors(self) -> list[str]:
        if self.envs is None:
            return []
        if not self.envs:
            return ["envs is empty: list at least one environment (or use `env:`)"]
        problems = []
        names = [e.name for e in self.envs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"envs: the names {', '.join(twice)} are used more than once; each "
                            f"environment's `name` names its metrics and must be unique")
        if len(self.envs) > 1:
            if self.reward is not None:
                problems.append("`reward:` (a learned reward of episodes) is not available with "
                                "several `envs` yet: each environment's own return is its reward")
            if self.distributed.env is not None:
                problems.append("distributed.env places one environment's actors; with several "
                                "`envs` the environments step in this process (remove it)")
        return problems

    def env_list(self) -> list[tuple[str, EnvConfig]]:
        """(name, section) of each environment: `envs`, or `env` alone (named by its id's
        last part, though a single env's metrics keep their names without it); empty for an
        `agent:` run."""
        if self.envs is not None:
            return [(e.name, e) for e in self.envs]
        if self.env is None:
            return []
        return [(re.sub(r"[^A-Za-z0-9_-]", "_", self.env.id.rsplit(":", 1)[-1]) or "env",
                 self.env)]

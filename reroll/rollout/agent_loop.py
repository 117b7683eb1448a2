"""Multi-turn episodes, token in and token out: the engine and an Env take turns.

An episode's tokens are built once and never re-encoded: the first prompt (the chat-templated
first observation), then for every turn the engine's generated tokens (policy tokens: response
mask 1, with their behaviour logprobs) followed by the observation's template tokens (env tokens:
mask 0, logprob 0). Each engine request is exactly the episode's tokens so far, so the trainer
sees token for token what the engine consumed and produced.

Many episodes run concurrently on one event loop; the engine batches their requests, and env
steps run in worker threads (or the env's own async `astep`), so a slow env overlaps generation
(environment-level asynchrony, as in ROLL Flash). An env that raises or exceeds
`step_timeout_s` fails only its episode (finish reason `env_error`, no policy tokens in the loss;
the trainer also leaves it out of its group's statistics: an infrastructure failure); a reset
that fails is first tried again on a fresh env (`reset_retries`, with backoff).
`redundancy` extra episodes per group start with the group; the first `group_size` to finish are
kept and the rest aborted, so a slow env instance does not hold up the step.

A learned reward of whole episodes (`EpisodeReward`: a reward model or a judge) scores each
episode as soon as it ends, on the same event loop, so the episodes that end together fill one
batch of the reward model while the others still generate.

History and thinking (`AgentJob.history_thinking`). A chat template may rewrite history: Qwen3's
drops the `<think>` block of every assistant turn before the last user message, so a
template-based server shows the model contexts without its earlier reasoning. `keep` (above)
trains on the tokens as generated, reasoning included: exact token in/token out, one sample per
episode, but not the contexts such a server shows. `strip` asks the template for every turn's
context (the engine then sees what a template-based server shows) and returns one sample per
turn: its prompt is exactly that turn's request and its response the turn's tokens, each
scored with the episode's return. Per-turn samples are the only exact form: no single sequence
holds turn 1 both with (when it was generated) and without (in turn 2's context) its reasoning.

Context management (`AgentJob.context`, `reroll.rollout.context`). When the history would leave
no room for a reply, `end` ends the episode; an edit (drop the oldest exchanges, truncate the
observations, a user hook) rewrites the conversation, and the next request is the template's
rendering of it. The turns then form token chains (the gateway's `assembly.chains`: a turn
whose request extends the previous request and completion continues its chain). The episode's
sample is its last chain, exactly the engine's tokens from that chain's first request on, with
the episode's return and turn rewards (turns of earlier chains hold no tokens); the earlier
chains are counted (`env/chains_dropped`): the RL step's group advantages take one sample per
episode.

Routing replay (docs/moe.md). When the engine records a mixture-of-experts model's routing,
every sample carries one record of its tokens (`Trajectory.routed_experts`), joined from the
calls that built it (its chain's, or its one turn's): each position as the first call that fed
it routed it (`reroll.models.routing.joined_record`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reroll.data.batch import Trajectory
from reroll.engines.base import Engine, Request, SamplingParams
from reroll.envs.base import EnvError, reset_async, step_async
from reroll.envs.wrappers import ChatFormat
from reroll.models.routing import joined_record
from reroll.rewards.base import RewardSample
from reroll.rewards.runner import RewardRunner
from reroll.rollout.context import ContextPolicy, HookError
from reroll.rollout.gateway.assembly import chains
from reroll.rollout.gateway.session import Call
from reroll.rollout.groups import request_seed
from reroll.tools.execute import run_calls
from reroll.tools.parsers import PARSERS, parse_tool_calls
from reroll.tools.schema import Tool, as_tools


@dataclass
class EpisodeReward:
    """A learned reward of whole episodes besides the environment's own (agentic `reward:`):
    the return becomes `env_weight * env rewards + weight * score`, the score added to the last
    turn's reward (where the episode ended, for turn-level credit)."""

    runner: RewardRunner
    """The reward behind its runner: time limit, failures counted (a failed call scores 0)."""
    weight: float = 1.0
    env_weight: float = 1.0

    async def score(self, t: Trajectory) -> None:
        """Score episode `t` in place: the first observation as the prompt, the rest of the
        episode (`response_text`: the turns as the policy saw them, then the environment's
        last observation, the outcome) as the response. An episode whose env failed is not
        scored (it trains nothing)."""
        env_return = t.reward
        turn_rewards = [self.env_weight * r for r in t.turn_rewards]
        learned: dict[str, Any] = {}
        if t.finish_reason != "env_error":
            result = await self.runner.reward(RewardSample(
                prompt=t.prompt_text, response=t.response_text, finish_reason=t.finish_reason))
            turn_rewards[-1] += self.weight * result.score
            learned = {"score": result.score} | result.info
        t.turn_rewards, t.reward = turn_rewards, float(sum(turn_rewards))
        t.reward_info |= {"env_return": env_return, "learned_reward": learned}


@dataclass
class AgentJob:
    """What episodes need: the engine, the tokens' format, how to build an env, the limits."""

    engine: Engine
    tokenizer: Any
    make_env: Callable[[], Any]
    params: SamplingParams
    max_turns: int = 8
    """Safety cap on turns per episode (envs usually end earlier)."""
    max_context_tokens: int = 1024
    """One request's prompt + reply; what happens when the history outgrows it is `context`."""
    context: ContextPolicy = field(default_factory=ContextPolicy)
    """`end`: the episode ends with finish reason `length`; an edit policy rewrites the history
    and the episode goes on (its last token chain trains; see the module doc)."""
    step_timeout_s: float | None = 30.0
    system_prompt: str | None = None
    format: ChatFormat | None = None
    history_thinking: str = "keep"
    """`keep`: one sample per episode, the tokens as generated; `strip`: every turn's context
    rendered by the chat template (which may drop earlier reasoning), one sample per turn."""
    one_sample: bool = False
    """One sample per episode even with `strip` (the RL step's group advantages): the last
    token chain, as for an edited history (earlier chains counted, `env/chains_dropped`)."""
    episode_reward: EpisodeReward | None = None
    """A learned reward of each finished episode, added to the environment's (None: none)."""
    tool_parser: str = "hermes"
    """How the model's tool calls are read, for an env with `tools` (`reroll.tools.parsers`)."""
    tool_timeout_s: float = 10.0
    """Limit of one tool call (a tool's own `timeout_s` wins)."""
    reset_retries: int = 0
    """More tries of a reset that failed (raised, timed out, returned the wrong shape), each on
    a fresh env, before the episode is an infrastructure failure (`env.reset_retries`)."""
    reset_backoff_s: float = 0.5
    """Wait before the first retry, doubled before each next one."""

    def __post_init__(self) -> None:
        if self.format is None:
            self.format = ChatFormat(self.tokenizer, self.system_prompt)
        if self.tool_parser not in PARSERS:
            raise ValueError(f"tool_parser must be one of {sorted(PARSERS)}, not "
                             f"{self.tool_parser!r}")
        if self.history_thinking not in ("keep", "strip"):
            raise ValueError(f"history_thinking must be keep or strip, not {self.history_thinking!r}")


@dataclass
class AgentStats:
    """Counters over the episodes of one call (reported as `env/*` metrics)."""

    episodes: int = 0
    env_errors: int = 0
    """Episodes that ended in an infrastructure failure (`env_error`)."""
    reset_retries: int = 0
    """Resets tried again after one failed (`AgentJob.reset_retries`)."""
    context_limit: int = 0
    aborted: int = 0
    turns: int = 0
    replies: int = 0
    truncated_replies: int = 0
    """Replies cut at the token budget (`rollout.max_new_tokens`, or the context's room) before
    their stop token: the env got an unfinished reply. Episodes that end at the context limit
    are `context_limit` (the trajectory's finish reason `length`, `train/truncated_frac`)."""
    env_seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that failed: an unknown tool, bad arguments, a tool that raised or timed out."""
    tool_parse_errors: int = 0
    """Tool calls in the model's text that could not be read (invalid JSON, no name, ...)."""
    context_edits: int = 0
    """Histories rewritten by the context policy."""
    chains_dropped: int = 0
    """Earlier token chains of edited episodes, not trained (the last chain is)."""
    errors: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {"env/episodes": float(self.episodes), "env/errors": float(self.env_errors),
                "env/infra_failure_frac": self.env_errors / n,
                "env/reset_retries": float(self.reset_retries),
                "env/context_limit_frac": self.context_limit / n,
                "env/truncated_replies_frac": self.truncated_replies / max(self.replies, 1),
                "env/aborted": float(self.aborted), "env/turns_mean": self.turns / n,
                "env/step_s_mean": self.env_seconds / max(self.turns, 1),
                "env/tool_calls": float(self.tool_calls),
                "env/tool_errors": float(self.tool_errors),
                "env/tool_parse_errors": float(self.tool_parse_errors),
                "env/context_edits": float(self.context_edits),
                "env/chains_dropped": float(self.chains_dropped)}


def state_id(obs: str) -> int:
    """A stable integer id of an observation (GiGPO's anchor states: equal text, equal id)."""
    return int.from_bytes(hashlib.blake2b(obs.encode(), digest_size=7).digest(), "big")


class _Episode:
    """The growing token record of one episode."""

    def __init__(self, prompt_ids: list[int], first_obs: str):
        self.prompt_ids = prompt_ids
        self.first_obs = first_obs
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.policy: list[int] = []
        self.versions: list[int] = []  # per token: the version that sampled it, -1 for the env's
        self.turn_ids: list[int] = []
        self.rewards: list[float] = []
        self.states: list[int] = [state_id(first_obs)]
        self.segments: list[dict[str, Any]] = []
        self.messages: list[dict[str, str]] = []  # the conversation (`strip`, rollout rows)
        self.tools: list[dict[str, Any]] = []  # the env's tool schemas
        self.outcome = ""
        """The environment's last observation, which no turn acted on ("Correct!"), as the
        template presents it: in the episode's text, not in its tokens."""
        self.turns: list[tuple[list[int], Any]] = []  # (request tokens, completion) per turn

    def add(self, ids: list[int], logprobs: list[float] | None, turn: int, text: str,
            versions: list[int] | None = None) -> None:
        policy = logprobs is not None
        self.versions += versions if policy else [-1] * len(ids)
        self.ids += ids
        self.logprobs += logprobs if policy else [0.0] * len(ids)
        self.policy += [int(policy)] * len(ids)
        self.turn_ids += [turn if policy else -1] * len(ids)
        self.segments.append({"text": text, "policy": policy, "turn": turn})

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids


async def run_episode(job: AgentJob, env_seed: int, sample_seed: int, group_id: int,
                      stats: AgentStats, on_request: Callable[[str], None] | None = None
                      ) -> list[Trajectory]:
    """One episode of a fresh env reset with `env_seed`; turn k samples with a seed derived
    from `sample_seed`. Failures of the env are recorded in the trajectory, never raised.
    One trajectory (its last token chain after a context edit), or with `strip` one per turn
    (`one_sample`: its last chain)."""
    tok = job.tokenizer
    finish, info = "truncated", {}
    env, tools, fmt, episode, error = await _start(job, env_seed, stats)
    view = list(episode.messages)  # the conversation the model sees: edited by `job.context`
    strip = job.history_thinking == "strip"
    following = episode.context()  # the next request's tokens
    for turn in range(job.max_turns if error is None else 0):
        context = following
        room = job.max_context_tokens - len(context)
        if room < 1:
            finish = "length"
            break
        params = dataclasses.replace(job.params, max_new_tokens=min(job.params.max_new_tokens, room))
        request = Request(context, params, seed=(sample_seed + 7_919 * turn) % 2**63)
        if on_request is not None:
            on_request(request.request_id)
        completion = await job.engine.generate(request)
        stats.replies += completion.finish_reason != "abort"
        stats.truncated_replies += completion.finish_reason == "length"
        action = tok.decode(completion.token_ids, skip_special_tokens=True)
        episode.add(completion.token_ids, completion.logprobs, turn,
                    tok.decode(completion.token_ids), completion.versions())
        episode.turns.append((context, completion))
        if completion.finish_reason == "abort":
            finish = "abort"
            break
        last = completion.token_ids[-1] if completion.token_ids else None
        stopped = tok.decode([last]) if completion.finish_reason == "stop" else None
        content = completion.token_ids[:-1] if stopped else completion.token_ids
        episode.messages.append({"role": "assistant", "content": tok.decode(content)})
        view.append(episode.messages[-1])
        try:
            obs, reward, terminated, truncated, step_info, results = await _answer(
                job, env, tools, action, stats)
        except EnvError as e:
            error = str(e)
            break
        info = step_info if step_info is not None else info  # a tool turn keeps the last
        episode.rewards.append(reward)
        reply = results or [{"role": "user", "content": obs}]
        obs_ids = fmt.reply_ids(reply, stopped)
        if terminated or truncated:
            finish = "stop" if terminated else "truncated"
            episode.outcome = tok.decode(obs_ids)
            break
        episode.messages += reply
        view += reply
        grown = fmt.messages_ids(view) if strip else \
            context + list(completion.token_ids) + obs_ids
        try:
            view, grown = _fit(job, fmt, view, grown, stats)
        except HookError as e:
            error = str(e)
            break
        if len(grown) >= job.max_context_tokens:
            finish = "length"
            episode.outcome = tok.decode(obs_ids)
            break
        episode.add(obs_ids, None, turn, tok.decode(obs_ids))
        episode.states.append(state_id(obs))
        following = grown
    trajectory = _trajectory(job, episode, env_seed, group_id, finish, info, error, stats)
    if job.episode_reward is not None:
        await job.episode_reward.score(trajectory)
    return _samples(job, episode, trajectory, stats)


async def _start(job: AgentJob, env_seed: int, stats: AgentStats):
    """(env, its tools, the chat format with them, the episode's first record, error or None):
    a fresh reset; a broken `tools` fails only its episode."""
    fmt = job.format
    env, obs, error = await _reset(job, env_seed, stats)
    try:
        tools = as_tools(getattr(env, "tools", None)) if error is None else []
    except (ValueError, TypeError) as e:
        error, tools = str(e), []
    if tools:
        fmt = fmt.with_tools([t.schema for t in tools], job.tool_parser)
    episode = _Episode(fmt.prompt_ids(obs), obs)
    episode.messages, episode.tools = fmt.first_messages(obs), fmt.tools
    return env, tools, fmt, episode, error


def _samples(job: AgentJob, episode: _Episode, trajectory: Trajectory,
             stats: AgentStats) -> list[Trajectory]:
    """The episode's training samples: one per turn (`strip`, unless `one_sample`), else its
    one chain (append-only) or its last chain after a context edit."""
    strip = job.history_thinking == "strip"
    if strip and not job.one_sample:
        return _turn_samples(job, episode, trajectory)
    if not strip and not job.context.edits:  # append-only: the episode is one chain
        return [_with_routing(trajectory, episode.turns)]
    return [_last_chain(job, episode, trajectory, stats)]


async def _answer(job: AgentJob, env: Any, tools: list[Tool], action: str, stats: AgentStats
                  ) -> tuple[str, float, bool, bool, dict | None, list[dict] | None]:
    """The answer to the model's turn: the results of its tool calls (the observation, reward
    0), or else `env.step`'s. (observation, reward, terminated, truncated, env.step's info or
    None, the tool messages or None). An env that raises or times out, or a non-finite reward,
    is an EnvError: it fails its episode only."""
    t0 = time.perf_counter()
    results = await _tool_turn(job, tools, action, stats) if tools else None
    try:
        if results is not None:  # the calls' results are this turn's observation
            return "\n".join(m["content"] for m in results), 0.0, False, False, None, results
        obs, reward, terminated, truncated, info = await step_async(env, action,
                                                                    job.step_timeout_s)
    finally:
        stats.env_seconds += time.perf_counter() - t0
        stats.turns += 1
    if not finite_number(reward):  # it would make the loss, then every weight, NaN
        raise EnvError(f"env.step returned a non-finite reward ({reward!r})")
    return obs, reward, terminated, truncated, info, None


def _fit(job: AgentJob, fmt: ChatFormat, view: list[dict], grown: list[int],
         stats: AgentStats) -> tuple[list[dict], list[int]]:
    """The next turn's conversation and request: as they are while a reply fits after them
    (or the policy is `end`), else after the context policy's edit (unless it changed
    nothing). A failing hook raises HookError."""
    if not job.context.edits or len(grown) + job.params.max_new_tokens <= job.max_context_tokens:
        return view, grown
    budget = int(job.context.target_fraction * job.max_context_tokens) - job.params.max_new_tokens
    edited = job.context.edit(view, lambda m: len(fmt.messages_ids(m)), job.tokenizer, budget)
    if edited == view:
        return view, grown
    stats.context_edits += 1
    return edited, fmt.messages_ids(edited)


def _last_chain(job: AgentJob, episode: _Episode, whole: Trajectory,
                stats: AgentStats) -> Trajectory:
    """The episode's sample: `whole` (its tokens as generated, one chain) when no edit broke
    the chain of requests; else its last chain, exactly the engine's tokens from that chain's
    first request on (its texts those tokens decoded), with `whole`'s return, turn rewards and
    conversation (scored by a learned reward before). Earlier chains counted."""
    calls = [Call(k, list(context), list(c.token_ids), list(c.logprobs), c.finish_reason,
                  c.policy_version) for k, (context, c) in enumerate(episode.turns)]
    found = chains(calls)
    if len(found) < 2:
        return _with_routing(whole, episode.turns)
    stats.chains_dropped += len(found) - 1
    train = whole.finish_reason != "env_error"
    first = found[-1].calls[0]
    ids, logprobs, policy, turn_ids, segments, versions = [], [], [], [], [], []
    position = len(first.prompt_ids)
    for call in found[-1].calls:
        between = call.prompt_ids[position:]  # the observation since the last completion
        if between:
            ids += between
            versions += [-1] * len(between)
            logprobs += [0.0] * len(between)
            policy += [0] * len(between)
            turn_ids += [-1] * len(between)
            segments.append({"text": job.tokenizer.decode(between), "policy": False,
                             "turn": call.index - 1})
        n = len(call.completion_ids)
        versions += episode.turns[call.index][1].versions()
        ids += call.completion_ids
        logprobs += call.logprobs
        policy += [int(train)] * n
        turn_ids += [call.index if train else -1] * n
        segments.append({"text": job.tokenizer.decode(call.completion_ids), "policy": True,
                         "turn": call.index})
        position = len(call.prompt_ids) + n
    chain = {"calls": [c.index for c in found[-1].calls], "chains": len(found)}
    return _with_routing(dataclasses.replace(
        whole, prompt_ids=list(first.prompt_ids), response_ids=ids, behaviour_logprobs=logprobs,
        policy_mask=policy, turn_ids=turn_ids, segments=segments, token_versions=versions,
        prompt_text=job.tokenizer.decode(first.prompt_ids),
        response_text="".join(s["text"] for s in segments),
        reward_info=whole.reward_info | {"chain": chain}),
        [episode.turns[c.index] for c in found[-1].calls])


async def _reset(job: AgentJob, env_seed: int, stats: AgentStats) -> tuple[Any, str, str | None]:
    """(env, first observation, error or None): a fresh env reset with `env_seed`, tried again
    on a fresh env up to `job.reset_retries` times, with backoff, when the reset fails (a
    flaky sandbox or env server often recovers)."""
    for attempt in range(job.reset_retries + 1):
        if attempt:
            stats.reset_retries += 1
            await asyncio.sleep(job.reset_backoff_s * 2 ** (attempt - 1))
        env = None
        try:
            env = job.make_env()
            obs, _ = await reset_async(env, env_seed, job.step_timeout_s)
            return env, obs, None
        except EnvError as e:
            error = str(e) + (f" (after {attempt} {'retry' if attempt == 1 else 'retries'})"
                              if attempt else "")
    return env, "", error


async def _tool_turn(job: AgentJob, tools: list[Tool], action: str, stats: AgentStats
                     ) -> list[dict[str, str]] | None:
    """The `tool` messages answering the calls in `action` (None when it makes none: the
    action goes to the env). Unreadable calls and failed ones are answered with an error
    message and counted, never raised."""
    parsed = parse_tool_calls(action, job.tool_parser)
    if not parsed.calls and not parsed.errors:
        return None
    results = await run_calls(parsed.calls, tools, job.tool_timeout_s)
    stats.tool_calls += len(parsed.calls)
    stats.tool_errors += sum(r.error for r in results)
    stats.tool_parse_errors += len(parsed.errors)
    return [r.message() for r in results] + [
        {"role": "tool", "tool_call_id": "invalid", "content": f"error: {e}"}
        for e in parsed.errors]


def _turn_samples(job: AgentJob, episode: _Episode, whole: Trajectory) -> list[Trajectory]:
    """`strip`: one sample per turn, exactly that turn's request and completion, scored with
    the episode's return; the episode's outcome (`reward_info`, finish) on every sample."""
    samples = []
    for k, (context, completion) in enumerate(episode.turns):
        n = len(completion.token_ids)
        policy = int(whole.finish_reason != "env_error")
        samples.append(Trajectory(
            prompt_ids=list(context), response_ids=list(completion.token_ids),
            behaviour_logprobs=list(completion.logprobs), finish_reason=whole.finish_reason,
            group_id=whole.group_id, prompt_text=job.tokenizer.decode(context),
            response_text=job.tokenizer.decode(completion.token_ids), reward=whole.reward,
            reward_info=whole.reward_info | {"turn": k}, policy_version=whole.policy_version,
            policy_mask=[policy] * n, turn_ids=[k if policy else -1] * n,
            token_versions=completion.versions(),
            turn_rewards=[whole.reward], turn_states=whole.turn_states[k : k + 1],
            segments=[{"text": job.tokenizer.decode(completion.token_ids), "policy": True,
                       "turn": k}],
            routed_experts=_routing(list(context) + list(completion.token_ids),
                                    [(context, completion)])))
    return samples or [whole]


def _routing(ids: list[int], turns: list[tuple[list[int], Any]]):
    """The engine's routing record of `ids`, built by these turns' calls (request tokens,
    completion) in order: each position as the first call that fed it routed it (a later
    prefill of the history is not used; `joined_record`). None without a record, at once (a
    dense model's episodes copy no context for it)."""
    if all(c.routed_experts is None for _, c in turns):
        return None
    return joined_record(ids, [(list(context) + list(c.token_ids), c.routed_experts)
                               for context, c in turns])


def _with_routing(t: Trajectory, turns: list[tuple[list[int], Any]]) -> Trajectory:
    """`t` with the routing record of its tokens, which `turns` (one chain) built (`t` itself
    when they recorded none)."""
    record = _routing(t.prompt_ids + t.response_ids, turns)
    return t if record is None else dataclasses.replace(t, routed_experts=record)


def finite_number(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _trajectory(job: AgentJob, episode: _Episode, env_seed: int, group_id: int, finish: str,
                info: dict, error: str | None, stats: AgentStats) -> Trajectory:
    """The episode as one trajectory. Its `prompt_text` is the first observation, as an RLVR
    sample's is its prompt (the templated prompt is `prompt_ids`); its `response_text` (and
    `segments`) the rest of the episode as the policy saw it, the chat template's tokens
    included, and then the environment's last observation, the outcome no turn acted on (so
    not in the tokens): what a learned reward of the episode reads."""
    stats.episodes += 1
    if error is not None:
        finish = "env_error"
        stats.env_errors += 1
        stats.errors.append(error)
        episode.policy = [0] * len(episode.ids)  # a broken episode teaches nothing
        episode.turn_ids = [-1] * len(episode.ids)
    stats.context_limit += finish == "length"
    stats.aborted += finish == "abort"
    turns = max(len(episode.rewards), 1 if episode.ids else 0)
    rewards = episode.rewards + [0.0] * (turns - len(episode.rewards))
    segments = episode.segments + ([{"text": episode.outcome, "policy": False,
                                     "turn": turns - 1}] if episode.outcome else [])
    summary = info.get("episode", {})
    reward_info = {"success": bool(info.get("success", summary.get("success", False))),
                   "turns": turns, "env_seed": env_seed}
    if error is not None:
        reward_info["env_error"] = error
    return Trajectory(
        prompt_ids=episode.prompt_ids, response_ids=episode.ids,
        behaviour_logprobs=episode.logprobs, finish_reason=finish, group_id=group_id,
        prompt_text=episode.first_obs, response_text="".join(s["text"] for s in segments),
        reward=float(sum(rewards)),
        reward_info=reward_info, policy_version=getattr(job.engine, "version", 0),
        policy_mask=episode.policy, turn_ids=episode.turn_ids, turn_rewards=rewards or [0.0],
        token_versions=episode.versions,
        turn_states=episode.states[: max(turns, 1)], segments=segments,
        conversation={"messages": episode.messages}
        | ({"tools": episode.tools} if episode.tools else {}))


async def run_group(job: AgentJob, env_seed: int, group_size: int, group_id: int, seed_base: int,
                    stats: AgentStats, redundancy: int = 0,
                    episode: Callable[[int, Callable[[str], None]], Awaitable[list[Trajectory]]]
                    | None = None) -> list[Trajectory]:
    """`group_size` episodes on the same env seed. With `redundancy` > 0, that many extra
    episodes start too; the first `group_size` to finish are kept, the rest are aborted.
    `episode(k, on_request)`: runs episode k instead of `run_episode` (an async source's,
    whose episodes restart when they grow too stale)."""
    in_flight: dict[int, str] = {}

    def tracker(k: int) -> Callable[[str], None]:
        return lambda request_id: in_flight.__setitem__(k, request_id)

    def one(k: int) -> Awaitable[list[Trajectory]]:
        if episode is not None:
            return episode(k, tracker(k))
        return run_episode(job, env_seed, seed_base + k, group_id, stats, tracker(k))

    tasks = {asyncio.create_task(one(k)): k for k in range(group_size + redundancy)}
    kept: list[tuple[int, list[Trajectory]]] = []
    pending = set(tasks)
    while len(kept) < group_size:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        kept += [(tasks[t], t.result()) for t in done]
    for task in pending:  # the slowest redundant episodes
        job.engine.abort(in_flight.get(tasks[task], ""))
        task.cancel()
        stats.aborted += 1
    await asyncio.gather(*pending, return_exceptions=True)
    kept.sort(key=lambda item: item[0])
    return [trajectory for _, episode in kept[:group_size] for trajectory in episode]


def run_episodes(job: AgentJob, env_seeds: list[int], group_size: int, run_seed: int, step: int,
                 redundancy: int = 0) -> tuple[list[Trajectory], AgentStats]:
    """`group_size` episodes per env seed, all concurrently; groups are contiguous (with
    `strip`, an episode's turn samples are contiguous inside its group)."""
    stats = AgentStats()

    async def run() -> list[list[Trajectory]]:
        return await asyncio.gather(*(
            run_group(job, seed, group_size, g, request_seed(run_seed, step, g * 1_000), stats,
                      redundancy)
            for g, seed in enumerate(env_seeds)))

    groups = asyncio.run(run())
    return [t for group in groups for t in group], stats

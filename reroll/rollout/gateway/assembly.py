"""A session's calls into training samples, from the tokens the engine saw.

Calls form chains: a call whose prompt begins with an earlier call's prompt and completion
(token for token: append-only) continues that call's chain. A chain is one trajectory: the
first call's prompt, then each completion (the policy's tokens: in the loss, with their
logprobs) and between two completions the tokens the harness added (tool results, the
template's markup: masked out of the loss). A call that extends no earlier one (history
rewritten: reasoning dropped, context summarised, a sub-agent) starts a new chain; every
chain of an episode is a sample carrying its lineage (`reward_info["lineage"]`: episode, the
calls it holds, the parent call it branched from) and the episode's reward. Each policy token
carries the weight version that sampled it (`Trajectory.token_versions`; -1 on the harness's
tokens), as an environment episode's does, and, when the engine records a mixture-of-experts
model's routing, the record of its tokens joined from its calls' (as the agent loop's).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from reroll.data.batch import Trajectory
from reroll.models.routing import joined_record
from reroll.rollout.gateway.session import Call, Session


@dataclass
class Chain:
    calls: list[Call]
    parent: int | None
    """The call this chain's first call was derived from (the latest call before it)."""

    @property
    def tokens(self) -> list[int]:
        last = self.calls[-1]
        return last.prompt_ids + last.completion_ids


def chains(calls: list[Call]) -> list[Chain]:
    """Calls grouped into append-only chains (in call order)."""
    out: list[Chain] = []
    for call in calls:
        home = None
        for chain in reversed(out):
            tokens = chain.tokens
            if call.prompt_ids[:len(tokens)] == tokens:
                home = chain
                break
        if home is not None:
            home.calls.append(call)
        else:
            out.append(Chain([call], call.index - 1 if call.index > 0 else None))
    return out


def trajectory(chain: Chain, session: Session, group_id: int, reward: float,
               info: dict, tokenizer, train: bool = True) -> Trajectory:
    """One chain as a trajectory; `train=False` masks every token (an infrastructure failure
    teaches nothing)."""
    first = chain.calls[0]
    ids: list[int] = []
    logprobs: list[float] = []
    policy: list[int] = []
    turns: list[int] = []
    versions: list[int] = []
    segments = []
    position = len(first.prompt_ids)
    for k, call in enumerate(chain.calls):
        between = call.prompt_ids[position:]  # what the harness added since the last completion
        if between:
            ids += between
            logprobs += [0.0] * len(between)
            policy += [0] * len(between)
            turns += [-1] * len(between)
            versions += [-1] * len(between)
            segments.append({"text": tokenizer.decode(between), "policy": False, "turn": k - 1})
        ids += call.completion_ids
        logprobs += call.logprobs
        policy += [int(train)] * len(call.completion_ids)
        turns += [k if train else -1] * len(call.completion_ids)
        versions += call.token_versions or [call.policy_version] * len(call.completion_ids)
        segments.append({"text": tokenizer.decode(call.completion_ids), "policy": True,
                         "turn": k})
        position = len(call.prompt_ids) + len(call.completion_ids)
    n_turns = len(chain.calls)
    lineage = {"episode": session.id, "calls": [c.index for c in chain.calls],
               "parent": chain.parent}
    finish = chain.calls[-1].finish_reason
    return Trajectory(
        prompt_ids=list(first.prompt_ids), response_ids=ids, behaviour_logprobs=logprobs,
        finish_reason=finish if finish in ("stop", "length", "abort") else "stop",
        group_id=group_id, prompt_text=tokenizer.decode(first.prompt_ids),
        response_text="".join(s["text"] for s in segments), reward=reward,
        reward_info=info | {"lineage": lineage, "turns": n_turns},
        policy_version=min(c.policy_version for c in chain.calls), policy_mask=policy,
        turn_ids=turns, token_versions=versions, turn_rewards=[0.0] * (n_turns - 1) + [reward],
        turn_states=[_state(c) for c in chain.calls], segments=segments,
        routed_experts=joined_record(list(first.prompt_ids) + ids,
                                     [(c.prompt_ids + c.completion_ids, c.routed_experts)
                                      for c in chain.calls]))


def _state(call: Call) -> int:
    """An id of what the call acted on (GiGPO's anchor states: equal prompts, equal id)."""
    digest = hashlib.blake2b(str(call.prompt_ids).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def faithful(t: Trajectory, calls: list[Call]) -> int:
    """How many of `calls` the trajectory reproduces exactly: the call's prompt is the
    trajectory's tokens up to it, and its completion and logprobs follow, in the loss."""
    tokens = t.prompt_ids + t.response_ids
    p = len(t.prompt_ids)
    good = 0
    for call in calls:
        start, end = len(call.prompt_ids), len(call.prompt_ids) + len(call.completion_ids)
        ok = (tokens[:start] == call.prompt_ids and tokens[start:end] == call.completion_ids
              and t.behaviour_logprobs[start - p:end - p] == call.logprobs)
        good += ok
    return good

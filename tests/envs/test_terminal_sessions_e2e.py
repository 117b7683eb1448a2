"""Kill the sandbox service mid-run (issue 45, part 3): the tiny model's terminal-task episodes,
driven by the agent loop, in sessions of a real `reroll sandbox serve`. The episodes whose
service died end as infrastructure failures naming the cause (finish reason `env_error`, no
policy token in the loss), never a reward of 0; the run goes on, and once the service is back
new episodes use it."""

from __future__ import annotations

import functools
import signal

import pytest

from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.envs import make_env
from reroll.models.loading import load_model, load_tokenizer
from reroll.rollout.agent_loop import AgentJob, run_episodes
from tests.envs.test_terminal_sessions import start_service
from tests.envs.test_terminal_tasks import hand_written

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


class KillsTheService:
    """The env, with the service killed (SIGKILL) before its first step's command runs."""

    def __init__(self, env, service):
        self.env, self.service = env, service

    async def areset(self, seed=None):
        return await self.env.areset(seed)

    async def astep(self, action):
        if self.service.poll() is None:
            self.service.send_signal(signal.SIGKILL)
            self.service.wait(timeout=10)
        return await self.env.astep(action)


def test_episodes_of_a_killed_service_are_env_errors_and_a_restart_heals(tmp_path, tiny_model):
    tok = load_tokenizer(tiny_model)
    engine = HFEngine(load_model(tiny_model), 64, tok.pad_token_id)
    params = SamplingParams(6, 1.0, 1.0, 0, (tok.eos_token_id,))
    proc, url = start_service()
    try:
        factory = functools.partial(
            make_env, "terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=2,
            sessions={"mode": "remote", "url": url, "request_timeout_s": 5})

        def job(make):
            return AgentJob(engine, tok, make, params, max_turns=2, max_context_tokens=256,
                            step_timeout_s=30, reset_retries=0)

        healthy, stats = run_episodes(job(factory), [0], 2, run_seed=0, step=0)
        assert stats.env_errors == 0 and all(t.finish_reason != "env_error" for t in healthy)

        killed, stats = run_episodes(job(lambda: KillsTheService(factory(), proc)), [0], 2,
                                     run_seed=0, step=1)
        assert [t.finish_reason for t in killed] == ["env_error"] * 2 and stats.env_errors == 2
        for t in killed:  # named, masked from the loss, not scored as the policy's failure
            assert "was lost" in t.reward_info["env_error"]
            assert "unreachable" in t.reward_info["env_error"]
            assert sum(t.policy_mask) == 0

        proc, _ = start_service(int(url.rsplit(":", 1)[1]))  # the service is back
        healed, stats = run_episodes(job(factory), [0, 1], 2, run_seed=0, step=2)
        assert stats.env_errors == 0 and len(healed) == 4
        assert all(t.finish_reason != "env_error" and "env_error" not in t.reward_info
                   for t in healed)
        assert all(sum(t.policy_mask) > 0 for t in healed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

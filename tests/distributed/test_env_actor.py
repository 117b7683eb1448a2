"""Environment host actors (`distributed.env`) survive their process dying: Ray restarts the
host, the episodes it held end as infrastructure failures, and new episodes run on it."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from reroll.distributed.env_actor import start_env_hosts
from reroll.envs.base import EnvError, reset_async, step_async

pytestmark = pytest.mark.ray


class CrashingEnv:
    """The action `crash` kills the host process, as a segfaulting env would."""

    def reset(self, seed=None):
        return f"seed {seed}", {}

    def step(self, action):
        if action == "crash":
            os._exit(1)
        return "ok", 1.0, True, False, {}


async def restarted(actor, limit_s: float = 120.0) -> None:
    """Until the actor answers again (calls meanwhile fail: ActorUnavailableError, which a
    reset retries past, `env.reset_retries`)."""
    import ray

    for _ in range(int(limit_s / 0.5)):
        try:
            await actor.info.remote()
            return
        except ray.exceptions.RayActorError:
            await asyncio.sleep(0.5)
    raise AssertionError(f"the env host did not come back in {limit_s} s")


def test_a_dead_env_host_is_restarted_and_its_episodes_fail_as_infra_failures(ray_session):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the host rebuilds it
    hosts = start_env_hosts(CrashingEnv, [{"num_cpus": 0}])
    try:
        async def run():
            held, crasher = hosts.make(), hosts.make()
            assert (await reset_async(held, 1, 30))[0] == "seed 1"
            await reset_async(crasher, 2, 30)
            with pytest.raises(EnvError, match="raised"):  # in flight when the host died
                await step_async(crasher, "crash", 30)
            await restarted(hosts.actors[0])
            # The episode whose environment lived in the dead process fails too, saying why.
            with pytest.raises(EnvError, match="environment was lost"):
                await step_async(held, "go", 30)
            fresh = hosts.make()  # a new episode runs on the restarted host
            assert (await reset_async(fresh, 3, 60))[0] == "seed 3"
            assert (await step_async(fresh, "go", 30))[1] == 1.0

        asyncio.run(run())
    finally:
        hosts.close()

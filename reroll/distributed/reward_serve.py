"""The reward role as a Ray Serve deployment (`distributed.reward.serve`): RollArt's serverless
rewards. Stateless rewards (a verifier, a judge, a reward model, a code sandbox) are pure
functions of the sample, so any replica can take any call, and Serve's autoscaler adds replicas
while calls queue up (a burst of finished rollouts) and removes them when they are idle.

`start_reward_service(factory, ...)` deploys one application (no HTTP proxy: calls go through a
deployment handle) whose replicas each build `factory()` in a `RewardHost`, and returns a
`ServedRewardFn`, a `RewardFn` like any other: the driver's `RewardRunner` bounds every call with
its time limit and counts failures. A replica that dies mid-run takes the calls it had in flight
with it: they raise, the runner counts them (`reward/errors`) and scores them as failures, and
`reward/lost_calls` counts them once more by cause; Serve starts a replacement replica and the
other calls go on. `reward/replicas` is the number of running replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reroll.config.distributed import RewardServe
from reroll.config.errors import ConfigError
from reroll.distributed.reward_actor import RewardHost
from reroll.rewards.base import RewardFn, RewardResult, RewardSample

DEPLOYMENT = "RewardHost"
"""The name of the one deployment of a reward application."""


def _serve():
    """`ray.serve`, or a ConfigError saying how to install it."""
    try:
        from ray import serve  # deferred: heavy, and only served rewards need it
    except ImportError as e:
        raise ConfigError(f"distributed.reward.serve needs Ray Serve ({e}); install it with "
                          f"pip install -e '.[serve]' (`make test` installs it)") from None
    return serve


class ServedRewardFn:
    """Client side of the reward deployment; implements `reroll.rewards.base.RewardFn`. It does
    not claim `times_itself`: the runner's limit covers the queue and the trip to a replica."""

    def __init__(self, handle: Any, app: str, name: str):
        self.app, self.name = app, name
        self.handle = handle.reward  # one handle (and one router) for every call
        self.lost_calls = 0

    async def __call__(self, sample: RewardSample) -> RewardResult:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        try:
            return await self.handle.remote(sample)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self.lost_calls += 1  # its replica died with the call in flight
            raise

    def replicas(self) -> dict[str, int]:
        """Replicas of the deployment by state (`RUNNING`, `STARTING`, ...)."""
        status = _serve().status().applications.get(self.app)
        if status is None:
            return {}
        return {str(k): int(v) for k, v in
                status.deployments[DEPLOYMENT].replica_states.items()}

    def replica_names(self) -> list[str]:
        """The Ray actor names of the live replicas (namespace `serve`)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        prefix = f"SERVE_REPLICA::{self.app}#{DEPLOYMENT}#"
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == "serve" and a["name"].startswith(prefix))

    def queue_metrics(self) -> dict[str, float]:
        return {"reward/replicas": float(self.replicas().get("RUNNING", 0)),
                "reward/lost_calls": float(self.lost_calls)}

    def close(self) -> None:
        """Stop the handle's router (its metrics thread would otherwise outlive Ray) and delete
        the application (its replicas stop); Serve itself stays up for other runs."""
        self.handle.shutdown()
        _serve().delete(self.app)


HEALTH_CHECK_PERIOD_S = 2.0
"""How often Serve checks each reward replica (and starts a replacement for a dead one)."""


def start_reward_service(factory: Callable[[], RewardFn], config: RewardServe,
                         actor_options: dict[str, Any], *, num_threads: int = 1,
                         app: str = "reroll-reward") -> ServedRewardFn:
    """Deploy `factory`'s reward as application `app` with autoscaling between
    `config.min_replicas` and `config.max_replicas`, each replica with `actor_options` (CPUs,
    resources, label selector); blocks until the first replicas run (a failure to build the
    reward raises here)."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    serve = _serve()
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        RewardHost, name=DEPLOYMENT, ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests,
        # a run makes thousands of reward calls: Serve's INFO line per call would flood the
        # driver's terminal and cost CPU in every process that ships and prints it
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
        # Serve finds a dead replica (a lost node, a killed actor) by its health check: every
        # 10 s by default, so a replacement came too late for a run's burst of rewards
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        autoscaling_config={
            "min_replicas": config.min_replicas, "max_replicas": config.max_replicas,
            "initial_replicas": config.min_replicas,
            "target_ongoing_requests": config.target_ongoing_requests,
            "upscale_delay_s": config.upscale_delay_s,
            "downscale_delay_s": config.downscale_delay_s,
            "metrics_interval_s": 0.5, "look_back_period_s": 2.0})
    try:
        handle = serve.run(deployment.bind(factory, num_threads), name=app, route_prefix=None)
    except (RuntimeError, ray.exceptions.RayError) as e:
        raise RuntimeError(f"distributed.reward.serve: the reward deployment {app!r} did not "
                           f"start: {e}") from e
    info_handle = handle.info
    info = info_handle.remote().result()
    info_handle.shutdown()
    return ServedRewardFn(handle, app, info["name"])

"""One Ray instance for every ray-tier test of the session (starting Ray costs seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from reroll.distributed.ray_runtime import ensure_ray

    ensure_ray(num_cpus=4)
    yield
    ray.shutdown()

"""What the Ray tests share: one local Ray instance per module (2 CPUs, no dashboard), and
finding a Serve replica's actor (to kill it)."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance for the module; Serve and Ray are shut down after it."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.monotonic() - began:.1f} s")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_actor(app: str, replica: str):
    """The actor of replica `replica` of Loom's deployment in Serve application `app`."""
    import ray

    from loom.distributed.launch import DEPLOYMENT

    return ray.get_actor(f"SERVE_REPLICA::{app}#{DEPLOYMENT}#{replica}", namespace="serve")

"""Engine replicas on Ray Serve: `start_replicas` deploys N engines behind Loom's
session-aware request router and returns a `RayEngineClient` (the engine-client protocol of
`loom/engine/client.py` over their deployment handle). Importing this package needs no Ray;
its modules that use Ray import it when called (`pip install 'loom-llm[ray]'`).

    routing.py     the pure routing decision (pins, prefix match, load threshold)
    directory.py   where pins live: a named detached Ray actor, and each client's cache
    router.py      Ray Serve's RequestRouter subclass over `routing`
    replica.py     the deployment class: one AsyncLLMEngine, drained on shutdown
    ray_client.py  the engine-client protocol over the deployment handle
    launch.py      start_replicas: Ray, Serve, the deployment, teardown
"""

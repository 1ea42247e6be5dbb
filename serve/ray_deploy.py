"""The Ray Serve deployment: the same FastAPI app (``serve.ingress``, built at replica start), one runtime per
replica. Imported only for ``serve --ray`` (it imports ray).

Ray's proxy sends each /metrics scrape to one replica, so each replica labels its samples with its own Ray replica
id (``replica``): a scrape that lands elsewhere reads other series, and no series ever goes backwards. A replica
that Ray stops (scale down, redeploy, ``serve.shutdown``) gets ``graceful_shutdown_timeout_s`` = the drain to
finish its requests; one that dies (a crash, SIGKILL) cannot answer for itself, see docs/serve.md for what a
client should retry.
"""

from __future__ import annotations

import dataclasses

from ray import serve

from eagle_export.manifest import load_manifest
from eagle_export.serve.engine import ServeEngine, ServeOptions


@serve.ingress()
class EagleReplica:
    """One replica: opens its own runtime; Ray Serve asks it for the ASGI app after the constructor."""

    def __init__(self, options: ServeOptions):
        if options.replica_label is None:
            options = dataclasses.replace(options, replica_label=serve.get_replica_context().replica_id.unique_id)
        self.options = options
        self.engine = ServeEngine.open(options)

    def __serve_build_asgi_app__(self):
        from eagle_export.serve.app import build_app

        return build_app(self.engine, self.options.api_key)


def ray_app(opts: ServeOptions, replicas: int, replica_cpus: float = 1.0):
    """The bound application: ``replicas`` copies, each taking up to its slots plus its queue at once (Ray Serve's
    default of 5 ongoing requests per replica would starve the batch)."""
    max_batch = opts.max_batch if opts.max_batch is not None else load_manifest(opts.artifact).max_batch
    dep = serve.deployment(EagleReplica, name="eagle", num_replicas=replicas,
                           ray_actor_options={"num_cpus": replica_cpus},
                           max_ongoing_requests=max_batch + max(opts.max_queue, 0) + 1,
                           graceful_shutdown_timeout_s=opts.drain_s)
    return dep.bind(opts)

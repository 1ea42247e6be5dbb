"""Running the app: one process under uvicorn, or N Ray Serve replicas of it (one runtime each)."""

from __future__ import annotations

import logging
import signal
import sys
import time

from eagle_export.errors import EagleExportError

from .engine import ServeEngine, ServeOptions
from .extras import RAY, SERVE, require

log = logging.getLogger(__name__)


def serve_uvicorn(opts: ServeOptions, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Open the runtime, then serve until SIGTERM / SIGINT; then drain the accepted requests (up to
    ``opts.drain_s``) before closing the runtime."""
    require("serve", *SERVE)
    from .server import make_server

    engine = ServeEngine.open(opts)
    try:
        make_server(engine, host, port, log_level).run()
    finally:
        engine.close()


def serve_ray(opts: ServeOptions, replicas: int, host: str = "127.0.0.1", port: int = 8000,
              replica_cpus: float = 1.0, num_cpus: int | None = None, block: bool = True) -> None:
    """Deploy on the Ray cluster named by RAY_ADDRESS, or on a local Ray instance started here."""
    require("ray", *RAY)
    require("serve", *SERVE)
    import ray
    from ray import serve

    if replicas < 1:
        raise EagleExportError(f"--replicas must be >= 1, got {replicas}")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    from .ray_deploy import ray_app

    serve.run(ray_app(opts, replicas, replica_cpus), name="eagle", route_prefix="/")
    if not block:
        return
    print(f"eagle-export serve: {replicas} Ray Serve replica(s) on http://{host}:{port} (Ctrl-C stops)",
          file=sys.stderr)

    def stop(signum, frame):  # ray.init installed its own SIGTERM handler (it aborts the driver): stop as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        if started:  # the local Ray instance started here goes with it (its agents included)
            ray.shutdown()

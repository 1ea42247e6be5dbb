"""`eagle-export serve`: an OpenAI-compatible HTTP server over the batched runtime (FastAPI + uvicorn), and the same
app as Ray Serve replicas (``--ray --replicas N``). Needs the ``serve`` extra (and ``ray`` for Ray Serve)."""

from __future__ import annotations

from .engine import ServeEngine, ServeOptions

__all__ = ["ServeEngine", "ServeOptions", "build_app"]


def build_app(engine: ServeEngine, api_key: str | None = None):
    from .app import build_app as _build

    return _build(engine, api_key)

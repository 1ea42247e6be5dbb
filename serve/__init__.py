"""`eagle-export serve`: an OpenAI-compatible HTTP server over the batched runtime (FastAPI + uvicorn), and the same
app as Ray Serve replicas (``--ray --replicas N``). Needs the ``serve`` extra (and ``ray`` for Ray Serve).

Nothing is imported here: the names below load their modules on first use, so ``eagle_export.serve.extras`` can
check the extras (one line naming what to install) before anything imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import ServeEngine, ServeOptions

__all__ = ["ServeEngine", "ServeOptions", "build_app"]


def __getattr__(name: str):
    if name in ("ServeEngine", "ServeOptions"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_app(engine: ServeEngine, api_key: str | None = None):
    from .app import build_app as _build

    return _build(engine, api_key)

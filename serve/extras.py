"""The optional extras the server needs, checked before anything imports them (one clear line, not a traceback)."""

from __future__ import annotations

import importlib

from eagle_export.errors import EagleExportError

SERVE = ("fastapi", "uvicorn", "prometheus_client")
RAY = ("ray.serve",)


def require(extra: str, *modules: str) -> None:
    """EagleExportError naming the extra to install when one of ``modules`` does not import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise EagleExportError(f"`eagle-export serve` needs {name} (not installed: {e}): "
                                   f"pip install 'eagle-export[{extra}]'") from e

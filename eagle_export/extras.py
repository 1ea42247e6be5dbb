"""The optional extras (pyproject's ``[project.optional-dependencies]``) and the one check of them.

A command that needs an extra calls ``require`` before it imports anything from it, so a missing package is one
``error:`` line naming the extra to install (exit status 2), never a traceback. This module imports nothing
optional itself, and neither does the package it sits in.
"""

from __future__ import annotations

import importlib

from eagle_export.errors import EagleExportError

# extra -> the modules each command of it imports (what `pip install 'eagle-export[extra]'` brings)
SERVE = ("fastapi", "uvicorn", "prometheus_client")
RAY = ("ray.serve",)
HTTP_CLIENT = ("httpx",)  # `bench --url`: in the serve extra, the server's own client
PLOT = ("matplotlib",)


def require(extra: str, *modules: str, command: str = "`eagle-export serve`") -> None:
    """EagleExportError naming ``extra`` when one of ``modules`` does not import (``command`` needs it)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:  # ModuleNotFoundError, or a broken install's ImportError
            raise EagleExportError(f"{command} needs {name} (not installed: {e}): "
                                   f"pip install 'eagle-export[{extra}]'") from None

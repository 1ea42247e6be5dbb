"""The server's extras, checked before anything imports them (one clear line, not a traceback).

Importing this module imports none of them: ``eagle_export.serve`` loads its submodules on first use.
"""

from __future__ import annotations

from eagle_export.extras import RAY, SERVE, require

__all__ = ["RAY", "SERVE", "require"]

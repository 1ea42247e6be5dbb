"""The research instruments' tests (tools/lab/): out of the default run (the `lab` marker; `pytest -m lab` runs
them). tools/lab is not part of the installed package, so its scripts are imported from their folder. The folder is
a package (``__init__.py``) so that this conftest does not take the module name ``conftest`` from tests/conftest.py,
which the tests import from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "lab"))


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.lab)

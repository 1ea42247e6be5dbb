"""Without its extra, each command that needs one prints one line naming the extra to install and exits 2.

The commands run in a fresh interpreter where the extras' packages fail to import exactly as missing packages do
(a meta-path finder raising ModuleNotFoundError before any other finder looks), which is a venv made with
``pip install -e .`` only, as far as those imports are concerned.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# every package the extras bring that the code imports (pyproject.toml [project.optional-dependencies])
MISSING = ("fastapi", "uvicorn", "prometheus_client", "starlette", "ray", "httpx", "matplotlib", "tensorrt",
           "tensorrt_rtx", "openai")

RUNNER = """
import contextlib, importlib.abc, io, json, sys, traceback

MISSING = set(sys.argv[1].split(","))

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
from eagle_export.cli import main

results = {}
for key, args in json.loads(sys.argv[2]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main.main(args, prog_name="eagle-export")
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc(file=err)
            code = "escaped"
    results[key] = [code, err.getvalue()]
print(json.dumps(results))
"""


def _cases(art, tmp):
    a = str(art)
    return {
        "serve": (["serve", a], "serve"),
        "serve --ray": (["serve", a, "--ray"], "ray"),
        "bench --url": (["bench", "--url", "http://127.0.0.1:9", "--concurrency", "1"], "serve"),
        "bench --plot": (["bench", a, "--plot", f"{tmp}/n.png"], "plot"),
        "tune --plot": (["tune", a, "--plot", f"{tmp}/s.png"], "plot"),
        "build": (["build", a], "tensorrt-rtx"),
    }


@pytest.fixture(scope="module")
def without_extras(models, tmp_path_factory):
    _, _, art = models("mha", max_seq_len=64)
    tmp = tmp_path_factory.mktemp("extras")
    cases = _cases(art, tmp)
    r = subprocess.run([sys.executable, "-c", RUNNER, ",".join(MISSING),
                        json.dumps({k: args for k, (args, _) in cases.items()})],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: (*results[k], extra) for k, (_, extra) in cases.items()}, art


@pytest.mark.parametrize("command", list(_cases("ART", "TMP")))
def test_a_command_without_its_extra_says_what_to_install(without_extras, command):
    results, art = without_extras
    code, err, extra = results[command]
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"pip install 'eagle-export[{extra}]'" in lines[0], err
    assert not list(art.glob("*.engine"))  # nothing started: build failed before building

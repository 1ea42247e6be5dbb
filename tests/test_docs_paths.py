"""Every file, folder and module the README and the docs name exists, and the functions docs/architecture.md's
"where is X" table points to are defined in the files it names. Moves and renames leave stale references behind
(docs/graph-contract.md once cited a module folded away long before); this keeps them honest.

Planted: a path renamed in the tree but not in a doc (e.g. ``runtime/timing.py`` -> ``runtime/timer.py``), a link to a
moved page, or a function renamed under the architecture table, each fails with the doc, the line and the name.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "lab" / "README.md",
        ROOT / "tools" / "lab" / "results.md"]
TOP = ("eagle_export", "export", "runtime", "engines", "serve", "tools", "tests", "docs", "fixture", ".ci")
# A repo path in prose or code spans: a top-level folder, then path characters. Placeholders ({a,b}, *, <X>, ...)
# are skipped.
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULE = re.compile(r"\beagle_export(?:\.\w+)+")


def _lines(doc: Path):
    in_fence = False
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        yield i, line, in_fence


def _exists(rel: str) -> bool:
    rel = rel.rstrip(".,:;")
    if any(c in rel for c in "{}*<>") or rel.endswith(("/X.py", "/x.py")):
        return True
    if (ROOT / rel).exists():
        return True
    module, _, attr = rel.rpartition(".")  # tests/model_table.FORMAT_MODELS: a module and a name in it
    return bool(attr) and (ROOT / f"{module}.py").is_file() and attr in (ROOT / f"{module}.py").read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    missing = []
    for i, line, _ in _lines(doc):
        for m in PATH.finditer(line):
            if not _exists(m.group(1)):
                missing.append(f"{doc.relative_to(ROOT)}:{i}: {m.group(1)}")
        for m in LINK.finditer(line):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}:{i}: link {target}")
    assert not missing, "\n".join(missing)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_module_imports(doc):
    bad = [f"{doc.relative_to(ROOT)}:{i}: {m.group(0)}" for i, line, _ in _lines(doc)
           for m in MODULE.finditer(line) if not _resolves(m.group(0).rstrip("."))]
    assert not bad, "\n".join(bad)


def test_the_where_is_table_names_real_functions():
    doc = ROOT / "docs" / "architecture.md"
    text = doc.read_text()
    table = text[text.index("## Where is X"):text.index("## Reference pages")]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith(("| What", "|---"))]
    assert len(rows) >= 15
    wrong = []
    for row in rows:
        what, file_cell, names_cell = [c.strip() for c in row.strip().strip("|").split(" | ")]
        files = re.findall(r"`([\w/]+\.py)`", file_cell + " " + names_cell)
        assert files, row
        sources = "".join((ROOT / f).read_text() for f in files)
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", names_cell):
            if name.endswith(".py"):
                continue
            last = re.escape(name.split(".")[-1])
            if not re.search(rf"^\s*(def|class) {last}\b|^\s*{last}\s*[:=]", sources, re.M):
                wrong.append(f"{what.strip('*')}: {name} not defined in {', '.join(files)}")
    assert not wrong, "\n".join(wrong)

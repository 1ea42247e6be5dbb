"""The ```python blocks of a section of a Markdown file, to run them exactly as printed (README, docs/runtime.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(doc: str, heading: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block between ``heading`` and the next heading of its level."""
    lines = (ROOT / doc).read_text().splitlines(keepends=True)
    level = heading.split(" ", 1)[0]
    start = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == heading)
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"^#{{1,{len(level)}}} ", lines[i])), len(lines))
    blocks, i = [], start
    while i < end:
        if lines[i].rstrip("\n") == "```python":
            j = next(k for k in range(i + 1, end) if lines[k].rstrip("\n") == "```")
            blocks.append((i + 2, "".join(lines[i + 1:j])))
            i = j
        i += 1
    return blocks


def run_block(doc: str, line: int, code: str) -> None:
    """Run one block as a program (its own globals, ``__main__``), its tracebacks naming the doc and line."""
    exec(compile("\n" * (line - 1) + code, str(ROOT / doc), "exec"), {"__name__": "__main__"})

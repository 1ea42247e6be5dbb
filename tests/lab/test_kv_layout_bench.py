"""tools/lab/kv_layout_bench: the whole-capacity binding with a mask computes what the runtime's prefix
binding does (its timings are for reading, not asserted)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from kv_layout_bench import format_rows, main, measure

from eagle_export.errors import EagleExportError


def test_both_designs_give_the_same_logits(models):
    _, _, art = models("gqa", max_seq_len=128)
    capacity, rows = measure(art, tokens=5, pasts=(3, 60, 127), repeats=2, threads=1)
    assert capacity == 128 and [r.past for r in rows] == [3, 60, 127]
    for r in rows:
        assert r.max_logit_diff < 1e-4
        assert r.prefix_exec_ms > 0 and r.capacity_exec_ms > 0
    text = format_rows(capacity, 5, rows)
    assert "capacity 128" in text and len(text.splitlines()) == 4 + len(rows)


def test_bad_settings_are_refused(models):
    _, _, art = models("gqa", max_seq_len=128)
    with pytest.raises(EagleExportError, match="--past"):
        measure(art, pasts=(0, 128))
    with pytest.raises(EagleExportError, match="--tokens"):
        measure(art, tokens=0)
    res = CliRunner().invoke(main, [str(art), "--past", "1,x"])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
    res = CliRunner().invoke(main, [str(art), "--past", "500"])
    assert res.exit_code == 1 and "capacity" in res.output and "Traceback" not in res.output

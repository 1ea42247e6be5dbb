"""tools/lab/lm_head_share_bench: the shared lm_head (a graph input bound to a mapping of the data file) and
the copy (an initializer in that file) compute the same top-k, and the program leaves nothing behind (its timings
and memory figures are for reading, not asserted)."""

from __future__ import annotations

import pytest
from lm_head_share_bench import KINDS, Shape, main, measure, report


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_copy_and_share_give_the_same_top_k_and_leave_nothing(tmp_path, dtype):
    m = measure(Shape(hidden=64, vocab=3000, dtype=dtype), rows=[1, 3], reps=1, workdir=tmp_path, threads=1)
    assert [r.rows for r in m.rows] == [1, 3]
    assert all(r.same_ids for r in m.rows)
    for r in m.rows:
        assert all(r.best_ms[k] > 0 for k in KINDS)
    for k in KINDS:
        assert set(m.memory[k]) == {"imports", "created", "after calls"}
    assert list(tmp_path.iterdir()) == []  # the data file and graphs are deleted
    text = report(m)
    assert "| 3 |" in text and "NO" not in text


def test_bad_settings_are_refused(tmp_path, capsys):
    for argv in (["--rows", "0"], ["--rows", "1,x"], ["--reps", "0"], ["--threads", "-1"],
                 ["--workdir", str(tmp_path / "absent")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err

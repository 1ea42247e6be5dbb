"""tools/lab/tree_call_bench: times the tree graph a round's tree runs (cut as the runtime cuts it), several
artifacts side by side, and leaves nothing in the artifact (its timings are for reading, not asserted)."""

from __future__ import annotations

from click.testing import CliRunner
from tree_call_bench import main

from eagle_export.tree_params import TreeLimits


def test_times_each_tree_and_leaves_the_artifact_as_it_was(models):
    art = models("mha", max_seq_len=64, limits=TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12))[2]
    before = sorted(p.name for p in art.iterdir())
    res = CliRunner().invoke(main, [f"{art}@1/3", f"{art}@2/1", "--past", "20", "--repeats", "2", "--calls", "3"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if "wall" in line]
    assert len(lines) == 2 and "(1.00x)" in lines[0] and lines[1].strip().startswith(f"{art}@2/1")
    assert sorted(p.name for p in art.iterdir()) == before


def test_a_tree_is_named_where_the_artifact_has_several_graphs(models):
    art = models("mha", max_seq_len=64, limits=TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12))[2]
    for spec, msg in ((str(art), "name a tree"), (f"{art}@9/1", "TOP_K one of"), (f"{art}@x", "TOP_K/DEPTH")):
        res = CliRunner().invoke(main, [spec])
        assert res.exit_code == 2 and msg in res.output, res.output

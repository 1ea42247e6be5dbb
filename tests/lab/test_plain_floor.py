"""tools/lab/plain_floor: our runtime's plain decoding beside a minimal loop over the same fused target graph, each
decoder's tokens checked against the other's (its timings are for reading, not asserted)."""

from __future__ import annotations

from click.testing import CliRunner
from plain_floor import main


def test_ours_and_the_minimal_loop_decode_the_same_tokens(trained):
    res = CliRunner().invoke(main, [str(trained("eagle1")), "--tokens", "8", "--rounds", "2", "--threads", "1"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    loop = next(line for line in lines if line.strip().startswith("loop"))
    ours = next(line for line in lines if line.strip().startswith("ours"))
    assert "graph" in loop and "x the loop (paired)" in ours


def test_one_decoder_alone_for_an_instruction_count(trained):
    art = trained("eagle1")
    res = CliRunner().invoke(main, [str(art), "--tokens", "8", "--only", "loop", "--requests", "1"])
    assert res.exit_code == 0, res.output
    assert [line.split()[0] for line in res.output.splitlines()[1:]] == ["loop"]
    res = CliRunner().invoke(main, [str(art), "--only", "peer"])
    assert res.exit_code == 2 and "needs --peer-dir" in res.output


def test_an_artifact_without_the_fused_graph_is_refused(models):
    res = CliRunner().invoke(main, [str(models("gqa", max_seq_len=64)[2]), "--tokens", "4", "--rounds", "1"])
    assert res.exit_code == 1 and "no fused target graph" in res.output

"""The README's main job (tools/demo.py) runs end to end on the shipped fixture and reports a lossless run."""

from __future__ import annotations

from click.testing import CliRunner

from eagle_export.tools.demo import main


def test_demo_runs_both_heads_and_is_lossless(tmp_path):
    res = CliRunner().invoke(main, ["--workdir", str(tmp_path / "demo"), "--max-new-tokens", "16"])
    assert res.exit_code == 0, res.output
    for head in ("eagle1", "eagle3"):
        assert f"== {head}:" in res.output
    assert res.output.count("tau (committed tokens per target forward, bonus included):") == 2
    assert res.output.count("speedup (median of per-prompt ratios, measured side by side):") == 2
    assert res.output.count("lossless (EAGLE tokens == no-draft tokens on every prompt): True") == 2


def test_demo_refuses_an_unknown_head(tmp_path):
    res = CliRunner().invoke(main, ["--workdir", str(tmp_path / "demo"), "--heads", "eagle9"])
    assert res.exit_code != 0 and "choose from eagle1, eagle3" in res.output

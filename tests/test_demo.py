"""The README's main job (tools/demo.py) runs end to end and reports a lossless run."""

from __future__ import annotations

from click.testing import CliRunner

from eagle_export.tools.demo import main


def test_demo_runs_and_is_lossless(tmp_path):
    res = CliRunner().invoke(main, ["--workdir", str(tmp_path / "demo"), "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "tau (tokens per target forward):" in res.output
    assert "speedup vs --no-draft" in res.output
    assert "lossless (EAGLE tokens == --no-draft tokens): True" in res.output

"""The README's Python snippet, extracted from README.md and run exactly as printed on the artifact the README's
main job makes (demo/eagle1: the bundled fixture with its EAGLE-1/2 head)."""

from __future__ import annotations

from doc_blocks import python_blocks, run_block


def test_readme_python_snippet_runs_as_printed(trained, tmp_path, monkeypatch, capsys):
    (block,) = python_blocks("README.md", "## Python API")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "eagle1").symlink_to(trained("eagle1"))
    monkeypatch.chdir(tmp_path)
    run_block("README.md", *block)
    out = capsys.readouterr().out
    assert "accepted per round:" in out and len(out.splitlines()) >= 4, out

"""The README's main job (`eagle-export demo`, tools/commands/demo.py) runs end to end on the shipped fixture and
reports a lossless run. The fixture's two artifacts come from the session's export (the `trained` fixture, exported
as the demo exports them), so the demo finds them in its workdir and does not export them again."""

from __future__ import annotations

from cli_run import cli


def test_demo_runs_both_heads_and_is_lossless(trained, tmp_path):
    work = tmp_path / "demo"
    work.mkdir()
    for head in ("eagle1", "eagle3"):
        (work / head).symlink_to(trained(head))
    res = cli("demo", "--workdir", work, "--max-new-tokens", 16)
    assert res.exit_code == 0, res.output
    for head in ("eagle1", "eagle3"):
        assert f"== {head}: artifact {work / head}" in res.output
    assert res.output.count("tau (committed tokens per target forward, bonus included):") == 2
    assert res.output.count("speedup (median of per-prompt ratios, measured side by side):") == 2
    assert res.output.count("lossless (EAGLE tokens == no-draft tokens on every prompt): True") == 2


def test_demo_refuses_an_unknown_head(tmp_path):
    res = cli("demo", "--workdir", tmp_path / "demo", "--heads", "eagle9")
    assert res.exit_code != 0 and "choose from eagle1, eagle3" in res.output

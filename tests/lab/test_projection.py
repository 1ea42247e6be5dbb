"""tools/lab/projection: the arithmetic that turns per-round costs and an acceptance profile into tokens/s, and the
measure -> project path on a tiny artifact (its figures are for reading, not asserted)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from projection import chain_tau, cli, geometric_rate, project


def test_chain_tau_is_one_plus_the_survival_products():
    assert chain_tau([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert chain_tau([0.9, 0.1], 1) == pytest.approx(1.9)  # a shallower tree reads the first depths only
    assert chain_tau([0.0, None], 2) == 1.0  # n_alpha's None: no round reached that depth
    with pytest.raises(ValueError, match="2 depths"):
        chain_tau([0.9, 0.1], 3)


def test_geometric_rate_inverts_chain_tau():
    a = geometric_rate(7, 3.34)
    assert chain_tau([a] * 7, 7) == pytest.approx(3.34, abs=1e-9)
    assert 0.6 < a < 0.75
    with pytest.raises(ValueError):
        geometric_rate(3, 5.0)  # more than 3 drafts and a bonus


def _costs() -> dict:
    tree = {"top_k": 1, "draft_ms": 1.0, "verify_ms": 2.0, "host_ms": 1.0, "per_depth": [0.8, 0.5], "tok_s": 500.0}
    return {"artifact": "x", "plain": {"target_ms": 1.5, "host_ms": 0.5, "tok_s": 480.0}, "peer_ms": 1.0,
            "trees": {"1/1/1": {**tree, "depth": 1, "tau": 1.7}, "1/2/2": {**tree, "depth": 2, "tau": 2.1,
                                                                        "verify_ms": 6.0},
                      "2/2/4": {**tree, "top_k": 2, "depth": 2, "tau": 2.5}}}


def test_project_ranks_the_trees_by_tokens_per_second():
    rows = project(_costs(), {"per_depth": {"1": [0.8, 0.5]}})
    assert [r["tree"] for r in rows] == ["1/1/1", "1/2/2"]  # no top_k 2 acceptance in the profile: left out
    one, two = rows
    assert one["tau"] == pytest.approx(1.8) and one["tok_s"] == pytest.approx(1000 * 1.8 / 4.0)
    assert two["tau"] == pytest.approx(2.2) and two["tok_s"] == pytest.approx(1000 * 2.2 / 8.0)
    assert one["vs_plain"] == pytest.approx(450.0 / 500.0) and one["vs_peer"] == pytest.approx(450.0 / 1000.0)
    measured = project(_costs(), "measured")
    assert {r["tree"]: r["tau"] for r in measured} == {"1/1/1": 1.7, "1/2/2": 2.1, "2/2/4": 2.5}


def test_measure_then_project_on_a_tiny_artifact(models, tmp_path):
    _, _, art = models("mha")
    out = tmp_path / "costs.json"
    run = CliRunner().invoke(cli, ["measure", str(art), "--out", str(out), "--tree", "1,2,2", "--tokens", "6",
                                   "--prompt-len", "12", "--threads", "1"])
    assert run.exit_code == 0, run.output
    costs = json.loads(out.read_text())
    t = costs["trees"]["1/2/2"]
    assert t["rounds"] >= 1 and t["draft_ms"] > 0 and t["verify_ms"] > 0 and len(t["per_depth"]) == 2
    shown = CliRunner().invoke(cli, ["project", str(out), "--profile", "from:1/2/2"])
    assert shown.exit_code == 0, shown.output
    assert "| 1/2/2 |" in shown.output and "projected" in shown.output

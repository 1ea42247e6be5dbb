"""`eagle-export tune` / tools/commands/tune.py: the grid, its filtering and refinement, every setting lossless, the
winner written into the manifest (which still loads, everything else unchanged), --dry-run, lossy settings refused, and
bad grids answered with one clear line. No timing assertions: which setting wins on a noisy machine is not fixed."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_run import cli, fail

from eagle_export.errors import GenerationError
from eagle_export.manifest import MANIFEST_NAME, Manifest, TunedInfo, load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands import tune as T
from eagle_export.tree_params import TreeLimits, TreeParams

P12 = [(7 * i + 3) % 48 for i in range(12)]  # ids valid in the 48-token fixtures
P9 = [(5 * i + 4) % 48 for i in range(9)]
# A small grid: 2 x 2 x 2 combinations, one of them invalid (top_k 1, depth 1 makes 2 candidates, not 4).
GRID = ("--top-k", "1,2", "--depth", "1-2", "--total-tokens", "2,4")


@pytest.fixture(scope="module")
def source(models) -> Path:
    return models("gqa")[2]


@pytest.fixture
def art(source, tmp_path) -> Path:
    return shutil.copytree(source, tmp_path / "art")


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tune") / "ids.jsonl"
    p.write_text("\n".join(json.dumps({"prompt_ids": x}) for x in (P12, P9)) + "\n")
    return p


def tune_json(art, ids_file, *args, code: int = 0) -> dict:
    r = cli("tune", art, "--prompts", ids_file, "--max-new-tokens", 6, "--threads", 1, "--json", *args)
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def test_tune_writes_the_winner(art, ids_file):
    before = json.loads((art / MANIFEST_NAME).read_text())
    out = tune_json(art, ids_file, *GRID)
    rows = out["settings"]
    assert out["written"] is True and out["lossless"] is True and out["ranked_by"] == "speedup"
    assert out["skipped"] == {"total_tokens > top_k + depth*top_k^2": 2}  # (1, 1, 4) and (1, 2, 4)
    grid_trees = {(r["tree"]["top_k"], r["tree"]["depth"], r["tree"]["total_tokens"])
                  for r in rows if r["stage"] == "grid"}
    assert grid_trees == {(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 1, 4), (2, 2, 2), (2, 2, 4)}
    assert len(rows) == len({json.dumps(r["tree"], sort_keys=True) for r in rows})  # nothing measured twice
    rt = EagleRuntime.open(art, threads=1)
    confirmed = [r for r in rows if r["confirmed"]]
    assert rows[:3] == confirmed  # the best three measured twice more, ranked ahead of the rest
    for r in rows:
        assert r["lossless"] is True and r["lossy_prompts"] == []
        assert r["runs"] == (2 * (1 + T.CONFIRM_PASSES) if r["confirmed"] else 2)  # prompts x passes
        # tau is the setting's committed tokens per target forward, recomputed here from greedy runs of its tree.
        acc = [a for p in (P12, P9) for a in rt.generate(prompt_ids=p, max_new_tokens=6, stop_on_eos=False,
                                                         tree=TreeParams(**r["tree"])).stats.accept_lengths]
        assert r["tau"] == pytest.approx((sum(acc) + len(acc)) / len(acc)), r
    for group in (confirmed, rows[3:]):
        speedups = [r["speedup"] for r in group]
        assert speedups == sorted(speedups, reverse=True)  # rank order
    assert out["winner"] == rows[0]
    m = load_manifest(art)  # still loads
    assert m.tree_defaults.to_dict() == out["winner"]["tree"]
    assert m.tuned is not None and m.tuned.tree == out["winner"]["tree"]
    assert (m.tuned.backend, m.tuned.threads, m.tuned.prompts, m.tuned.max_new_tokens) == ("ort", 1, 2, 6)
    assert m.tuned.settings == len(rows) and m.tuned.speedup == out["winner"]["speedup"]
    after = json.loads((art / MANIFEST_NAME).read_text())
    assert list(after) == list(before) + ["tuned"]  # same keys, same order, one more
    assert {k: v for k, v in after.items() if k not in ("tree_defaults", "tuned")} == \
        {k: v for k, v in before.items() if k != "tree_defaults"}
    assert Manifest.from_dict(after).to_dict() == after  # the new field round-trips
    assert not (art / f".{MANIFEST_NAME}.partial").exists()
    # the new default is what generate uses now
    g = json.loads(cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", 3, "--json").stdout)
    assert g["tree"] == out["winner"]["tree"]


def test_spin_stage_picks_the_fastest_policy_and_the_runtime_defaults_to_it(art, ids_file):
    """tune --spin auto measures every candidate policy with the default tree (lossless), keeps the one with the most
    EAGLE tokens/s, runs the tree stages with it and records it; the runtime then opens with it unless told
    otherwise. A given policy is used as is (no stage) and recorded the same way."""
    out = tune_json(art, ids_file, "--top-k", 1, "--depth", 1, "--total-tokens", 2, "--no-refine")
    stage = out["spin_stage"]
    assert sorted(r["spin"] for r in stage) == sorted(T.SPIN_CANDIDATES)
    assert all(r["lossless"] and r["runs"] == 4 for r in stage)  # 2 prompts x 2 passes (order reversed on the 2nd)
    best = max(stage, key=lambda r: r["eagle_tok_s"])
    assert out["spin"] == best["spin"] == stage[0]["spin"]
    m = load_manifest(art)
    assert m.tuned.spin == out["spin"]
    assert EagleRuntime.open(art, threads=1).backend.spin == out["spin"]
    assert EagleRuntime.open(art, threads=1, spin="on").backend.spin == "on"  # an explicit policy wins
    out = tune_json(art, ids_file, "--top-k", 1, "--depth", 1, "--total-tokens", 2, "--no-refine", "--spin",
                    "target=on,draft=run")
    assert out["spin_stage"] == [] and out["spin"] == "target=on,draft=run"
    assert load_manifest(art).tuned.spin == "target=on,draft=run"
    assert EagleRuntime.open(art, threads=1).backend.spin == "target=on,draft=run"
    fail("tune", art, "--spin", "fast", expect=("spin must be one of",))


def test_tune_dry_run_and_table(art, ids_file):
    raw = (art / MANIFEST_NAME).read_bytes()
    out = tune_json(art, ids_file, "--top-k", 2, "--depth", 1, "--total-tokens", "2,4", "--dry-run", "--no-refine")
    assert out["written"] is False and out["refine"] is False
    assert [r["stage"] for r in out["settings"]] == ["grid", "grid"]
    assert (art / MANIFEST_NAME).read_bytes() == raw
    r = cli("tune", art, "--prompts", ids_file, "--max-new-tokens", 4, "--top-k", 2, "--depth", 1,
            "--total-tokens", 2, "--dry-run", "--threads", 1)
    assert r.exit_code == 0, r.output
    for f in ("top_k", "speedup", "lossless", "winner: top_k", "ranked by speedup", "dry run: manifest not changed"):
        assert f in r.stdout
    assert "[tune]" in r.stderr and "settings to measure" in r.stderr  # progress lines
    assert (art / MANIFEST_NAME).read_bytes() == raw


def test_refinement_around_the_winner(art, ids_file):
    # --confirm 0: the refinement is centred on the grid's winner as first measured, which confirming would re-rank
    out = tune_json(art, ids_file, "--top-k", "2", "--depth", "2,4", "--total-tokens", "4,8", "--dry-run",
                    "--confirm", "0")
    grid = [r for r in out["settings"] if r["stage"] == "grid"]
    refine = [r["tree"] for r in out["settings"] if r["stage"] == "refine"]
    assert len(grid) == 4
    best = max(grid, key=lambda r: r["speedup"])["tree"]
    # one dimension at a time: top_k has one value (nothing); depth 2,4 and total_tokens 4,8 give the midpoint
    # (3, 6) and, from the lower value, also its half (1, 2)
    near = {"depth": {2: [1, 3], 4: [3]}, "total_tokens": {4: [2, 6], 8: [6]}}
    want = [{**best, dim: v} for dim, by in near.items() for v in by[best[dim]]]
    want = [t for t in want if t["total_tokens"] <= TreeParams(**t).max_candidates]
    def key(t: dict) -> list:
        return sorted(t.items())

    assert sorted(refine, key=key) == sorted(want, key=key)  # rows are in rank order, not proposal order


def test_lossy_setting_is_never_the_winner(art, ids_file, monkeypatch):
    real = T._summarise

    def sabotage(tree, stage, rows):  # as if EAGLE had diverged from no-draft at top_k 2
        row = real(tree, stage, rows)
        if tree.top_k == 2:
            row.lossless, row.lossy_prompts = False, [rows[0].source]
        return row

    monkeypatch.setattr(T, "_summarise", sabotage)
    raw = (art / MANIFEST_NAME).read_bytes()
    out = tune_json(art, ids_file, *GRID, "--no-refine", code=1)
    assert out["lossless"] is False and out["written"] is False
    assert out["winner"]["tree"]["top_k"] == 1 and out["winner"]["lossless"] is True
    assert [r["lossless"] for r in out["settings"]] == sorted((r["lossless"] for r in out["settings"]), reverse=True)
    assert (art / MANIFEST_NAME).read_bytes() == raw
    r = cli("tune", art, "--prompts", ids_file, "--max-new-tokens", 4, *GRID, "--no-refine", "--threads", 1)
    assert r.exit_code == 1 and "LOSSY: top_k 2" in r.stdout and "were lossy" in r.stderr
    assert (art / MANIFEST_NAME).read_bytes() == raw


def test_write_winner_refuses_a_lossy_report(art):
    bad = T.SettingRow(TreeParams(2, 1, 2), "grid", 1.0, 10.0, 20.0, 0.5, False, 2, ["builtin 1"])
    good = T.SettingRow(TreeParams(1, 1, 2), "grid", 1.0, 10.0, 20.0, 0.5, True, 2)
    report = T.TuneReport(str(art), "ort", "cpu", 1, 4, 1, 2, T.Grid(), True, [good, bad], {}, TreeParams())
    assert report.winner is good
    with pytest.raises(T.TuneError, match="lossy"):
        T.write_winner(art, report)
    report.rows = [good]
    report.spin_rows, report.spin = [T.SpinRow("run", 30.0, 20.0, False, 4)], "run"  # EAGLE != no-draft there
    with pytest.raises(T.TuneError, match="spin stage was lossy"):
        T.write_winner(art, report)
    report.spin_rows = [T.SpinRow("run", 30.0, 20.0, True, 4)]
    m = T.write_winner(art, report)
    assert m.tree_defaults == TreeParams(1, 1, 2) and m.tuned.spin == "run"


def test_admissible_and_parse_list():
    class Session:
        manifest = SimpleNamespace(tree_limits=TreeLimits(4, 3, 12), quantization=None)
        backend = "ort"

        def check_tree(self, tree):  # like TensorRT engines built for a verify of at most 9 tokens
            if tree.verify_tokens > 9:
                raise GenerationError("too wide")

    s = Session()
    assert T.admissible(TreeParams(2, 2, 8), s) is None
    assert T.admissible(TreeParams(1, 1, 4), s) == "total_tokens > top_k + depth*top_k^2"
    assert T.admissible(TreeParams(8, 2, 8), s) == "above the artifact's tree limits"
    assert T.admissible(TreeParams(4, 2, 10), s) == "does not fit the engines"
    assert T.parse_list("8, 1,2-4,2", "--top-k", 1) == (1, 2, 3, 4, 8)
    assert T.parse_list([3, 0], "--depth", 0) == (0, 3)
    assert T.Grid.parse().to_dict() == {"top_k": [1, 2, 4, 8], "depth": [2, 4, 8], "total_tokens": [4, 8, 16, 32, 60]}
    # Where only chains are token-exact (MatMulNBits rounding activations, on ONNX Runtime): branching trees only
    # with inexact_trees, and a narrow default grid (chains and 2-wide trees of 3-6 verify tokens).
    s.manifest = SimpleNamespace(tree_limits=TreeLimits(4, 3, 12),
                                 quantization=SimpleNamespace(rounds_activations=True))
    assert T.admissible(TreeParams(2, 2, 4), s) == T.INEXACT
    assert T.admissible(TreeParams(2, 2, 4), s, inexact_trees=True) is None
    assert T.admissible(TreeParams(1, 2, 3), s) is None
    s.backend = "tensorrt"
    assert T.admissible(TreeParams(2, 2, 4), s) is None
    assert T.Grid.parse(narrow=True).to_dict() == {"top_k": [1, 2], "depth": [1, 2, 3, 4, 5],
                                                   "total_tokens": [2, 3, 4, 5]}


def test_tuned_field_round_trips_and_is_optional(source):
    m = load_manifest(source)
    assert m.tuned is None and "tuned" not in m.to_dict()  # manifests without it load as before
    m.tuned = TunedInfo("ort", None, "cpu", {"top_k": 2, "depth": 2, "total_tokens": 4}, "speedup", 1.1, 5.0, 4.0,
                        1.25, 7, 4, 64, 1, "2026-01-01T00:00:00+00:00", "0.1.0")
    d = m.to_dict()
    assert Manifest.from_dict(d).to_dict() == d and Manifest.from_dict(d).tuned == m.tuned


@pytest.mark.parametrize("args, fragment", [
    (("--top-k", "x"), "--top-k must be comma-separated integers or ranges like 2-5, got 'x'"),
    (("--depth", "5-3"), "--depth: the range '5-3' is empty"),
    (("--top-k", "0"), "--top-k values must be integers >= 1, got 0"),
    (("--total-tokens", ","), "--total-tokens must be comma-separated integers"),
    (("--top-k", "11", "--depth", "9"), "no setting of the grid can run"),
    (("--top-k", "1", "--depth", "1", "--total-tokens", "5"), "1 total_tokens > top_k + depth*top_k^2"),
])
def test_bad_grids_are_refused(art, args, fragment):
    raw = (art / MANIFEST_NAME).read_bytes()
    fail("tune", art, "--max-new-tokens", 2, *args, expect=(fragment,))
    assert (art / MANIFEST_NAME).read_bytes() == raw


def test_bad_requests(art, tmp_path, monkeypatch):
    fail("tune", tmp_path / "missing", expect=("is not a directory",))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    fail("tune", art, "--prompts", empty, expect=("no prompts",))
    r = cli("tune", art, "--repeats", 0)
    assert r.exit_code == 2 and "--repeats" in r.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    fail("tune", art, "--plot", tmp_path / "s.png", expect=("--plot needs matplotlib",))

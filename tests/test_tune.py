"""`eagle-export tune` / tools/commands/tune/: the grid, its filtering and refinement, every setting lossless, the
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
from eagle_export.tools.commands.tune.batch import Candidate, SizeRow
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
    # a random head: no tree pays, so --min-speedup 0.01 for a winner that becomes the default (test_default_decoding
    # covers the no-draft default); --thresholds 0: the grid and the refinement only
    out = tune_json(art, ids_file, *GRID, "--min-speedup", 0.01, "--thresholds", 0)
    rows = out["settings"]
    assert out["written"] is True and out["lossless"] is True and out["ranked_by"] == "speedup"
    # (1, 1, 4) and (1, 2, 4) cannot run; (1, 2, 2) and (2, 2, 2) verify the trees of depth 1 (TreeParams.trimmed:
    # a second level is never selected into 2 tokens), so they are not measured again
    assert out["skipped"] == {"total_tokens > top_k + depth*top_k^2": 2, T.SAME_TREES: 2}
    grid_trees = {(r["tree"]["top_k"], r["tree"]["depth"], r["tree"]["total_tokens"])
                  for r in rows if r["stage"] == "grid"}
    assert grid_trees == {(1, 1, 2), (2, 1, 2), (2, 1, 4), (2, 2, 4)}
    assert len(rows) == len({json.dumps(r["tree"], sort_keys=True) for r in rows})  # nothing measured twice
    rt = EagleRuntime.open(art, threads=1, guard=False)  # as tune measured: every round drafts
    confirmed = [r for r in rows if r["confirmed"]]
    assert rows[:3] == confirmed  # the best three measured twice more, ranked ahead of the rest
    dropped = [r for r in rows if r["dropped"]]
    assert rows[len(rows) - len(dropped):] == dropped  # screened out on the first prompt: ranked last
    for r in rows:
        assert r["lossless"] is True and r["lossy_prompts"] == []
        # prompts x passes: the screen's first prompt only for the dropped
        assert r["runs"] == (2 * (1 + T.CONFIRM_PASSES) if r["confirmed"] else 1 if r["dropped"] else 2)
        # top_k 1 and 2: the artifact's draft tree graphs; a refinement to depth 0 (the root's children alone, when
        # a depth-1 tree wins on this random head's timings) drafts in the step graph's context pass
        assert r["path"] == (T.TREE_PATH if r["tree"]["depth"] >= 1 else T.STEP_PATH), r["tree"]
        # tau is the setting's committed tokens per target forward, recomputed here from greedy runs of its tree.
        acc = [a for p in (P12, P9) for a in rt.generate(prompt_ids=p, max_new_tokens=6, stop_on_eos=False,
                                                         tree=TreeParams(**r["tree"])).stats.accept_lengths]
        assert r["tau"] == pytest.approx((sum(acc) + len(acc)) / len(acc)), r
    for group in (confirmed, rows[3:len(rows) - len(dropped)], dropped):
        speedups = [r["speedup"] for r in group]
        assert speedups == sorted(speedups, reverse=True)  # rank order
    assert out["winner"] == rows[0]
    m = load_manifest(art)  # still loads
    assert m.tree_defaults.to_dict() == out["winner"]["tree"]
    assert m.tuned is not None and m.tuned.tree == out["winner"]["tree"]
    assert (m.tuned.backend, m.tuned.threads, m.tuned.prompts, m.tuned.max_new_tokens) == ("ort", 1, 2, 6)
    assert m.tuned.settings == len(rows) and m.tuned.speedup == out["winner"]["speedup"]
    # the winner measured again with the speculation guard on, when it is the default (it beat --min-speedup)
    a = out["as_run"]
    assert (a is None) == (m.tuned.speedup_as_run is None) == out["no_draft"]
    assert a is None or (a["tree"] == out["winner"]["tree"] and m.tuned.speedup_as_run == a["speedup"])
    after = json.loads((art / MANIFEST_NAME).read_text())
    assert list(after) == list(before) + ["tuned"]  # same keys, same order, one more
    assert {k: v for k, v in after.items() if k not in ("tree_defaults", "tuned")} == \
        {k: v for k, v in before.items() if k != "tree_defaults"}
    assert Manifest.from_dict(after).to_dict() == after  # the new field round-trips
    assert not (art / f".{MANIFEST_NAME}.partial").exists()
    # the new default is what generate uses now
    g = json.loads(cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", 3, "--json").stdout)
    assert g["tree"] == out["winner"]["tree"]


# tune --confirm's ranking under a deterministic stand-in for the measurement: tree -> (EAGLE tok/s, no-draft tok/s)
# of its first pass, then of every later pass. The first pass ranks A > B > D > E = C > F (E and C tie on speedup,
# E with more EAGLE tok/s); the confirming passes reorder the best three: B (1.45x over its six runs) > D (1.3x)
# > A (1.0x, one lucky pass), all three still ahead of E and C (1.35x, measured once).
A, B_, C_, D, E, F, G = (TreeParams(2, 2, 4), TreeParams(2, 1, 4), TreeParams(1, 2, 3), TreeParams(2, 2, 3),
                         TreeParams(2, 1, 2), TreeParams(1, 1, 2), TreeParams(2, 1, 3))
FAKE_TOK_S = {A: ((32, 20), (20, 20)), B_: ((30, 20), (29, 20)), D: ((28, 20), (26, 20)),
              C_: ((27, 20), (27, 20)), E: ((54, 40), (54, 40)), F: ((18, 20), (18, 20)), G: ((17, 20), (17, 20))}


def test_confirm_reranks_the_best_settings_over_all_their_runs(art, ids_file, monkeypatch):
    """``PairedSession.measure`` replaced by a deterministic stand-in with its contract (one PromptRow per prompt,
    speedup = EAGLE / no-draft tok/s): the best three of the grid's first pass are measured twice more, in the
    order A B D, then D B A; each is ranked by the median over its six runs, ahead of every setting measured once
    (which keep their first-pass order, ties by EAGLE tok/s); the winner is the best confirmed setting, measured
    once more with the speculation guard on (what `bench` of the default will see)."""
    from eagle_export.tools.commands.bench import PairedSession, PromptRow

    calls: list[tuple[TreeParams, int]] = []
    guarded: list[bool] = []  # per call: did the runtime's drafting requests run with the speculation guard

    def measure(self, tree, max_new_tokens, *, parity=0, log=None, stop_on_eos=False, repeats=1, peer=None,
                only=None):
        first, later = FAKE_TOK_S[tree]
        e, n = first if not any(t == tree for t, _ in calls) else later
        calls.append((tree, parity))
        guarded.append(self.rt.generator.guard is not None)
        return [PromptRow(spec.source, len(ids), max_new_tokens, 1.5, max_new_tokens // 2, float(e), float(n), e / n,
                          True, 0.1, 0.03, 0.05, 0.02, [1] * (max_new_tokens // 2))
                for i, (spec, ids) in enumerate(zip(self.specs, self.prompt_ids, strict=True))
                if only is None or i in only]

    monkeypatch.setattr(PairedSession, "measure", measure)
    # screen=False: every grid setting measured once on every prompt, so the ranking is the confirmation's alone
    report = T.tune(art, prompts=ids_file, max_new_tokens=4, top_k="1,2", depth="1,2", total_tokens="2-4",
                    threads=1, refine=False, warmup=False, spin=None, confirm=3, screen=False,
                    thresholds="0")  # no threshold stage: the ranking is the grid's and the confirmation's
    grid = T.Grid.parse("1,2", "1,2", "2-4").settings()  # as trimmed, each once: (1, 2, 2) is (1, 1, 2)
    grid = list(dict.fromkeys(t.trimmed() for t in grid if t.total_tokens <= t.max_candidates))
    assert len(grid) == len(FAKE_TOK_S)
    # the confirming passes interleaved, then reversed; last, the winner once more with the guard on (as it will run)
    assert [t for t, _ in calls] == [*grid, A, B_, D, D, B_, A, B_]
    assert guarded == [False] * (len(calls) - 1) + [True]
    assert report.as_run.tree == B_ and report.as_run.speedup == 1.45 and report.as_run.stage == "as run"
    assert [p for _, p in calls][:-1] == [2 * i for i in range(len(calls) - 1)]  # each continues the rotation
    assert [r.tree for r in report.rows] == [B_, D, A, E, C_, F, G]
    assert [r.confirmed for r in report.rows] == [True] * 3 + [False] * 4
    assert [r.runs for r in report.rows] == [6] * 3 + [2] * 4
    assert [r.speedup for r in report.rows] == [1.45, 1.3, 1.0, 1.35, 1.35, 0.9, 0.85]
    assert report.winner.tree == B_ and not report.lossy


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
    plain = max(stage, key=lambda r: r["no_draft_tok_s"])  # what the record keeps where nothing drafts by default
    nothing_drafts = out["no_draft"] and all(row["choice"]["tree"] is None for row in out["batch"])
    assert out["recorded_spin"] == (plain["spin"] if nothing_drafts else out["spin"])
    m = load_manifest(art)
    assert m.tuned.spin == out["recorded_spin"]
    assert EagleRuntime.open(art, threads=1).backend.spin == out["recorded_spin"]
    assert EagleRuntime.open(art, threads=1, spin="on").backend.spin == "on"  # an explicit policy wins
    out = tune_json(art, ids_file, "--top-k", 1, "--depth", 1, "--total-tokens", 2, "--no-refine", "--spin",
                    "target=on,draft=run")
    assert out["spin_stage"] == [] and out["spin"] == "target=on,draft=run"
    assert load_manifest(art).tuned.spin == "target=on,draft=run"
    assert EagleRuntime.open(art, threads=1).backend.spin == "target=on,draft=run"
    fail("tune", art, "--spin", "fast", expect=("spin must be one of",))


def test_tune_dry_run_and_table(art, ids_file):
    raw = (art / MANIFEST_NAME).read_bytes()
    out = tune_json(art, ids_file, "--top-k", 2, "--depth", 1, "--total-tokens", "2,4", "--dry-run", "--no-refine",
                    "--thresholds", 0)
    assert out["written"] is False and out["refine"] is False
    assert [r["stage"] for r in out["settings"]] == ["grid", "grid"]
    assert (art / MANIFEST_NAME).read_bytes() == raw
    r = cli("tune", art, "--prompts", ids_file, "--max-new-tokens", 4, "--top-k", 2, "--depth", 1,
            "--total-tokens", 2, "--dry-run", "--threads", 1)
    assert r.exit_code == 0, r.output
    for f in ("top_k", "speedup", "lossless", "winner: top_k", "ranked by speedup", "dry run: manifest not changed"):
        assert f in r.stdout
    assert "[tune]" in r.stderr and "settings to measure" in r.stderr  # progress lines
    assert "built-in" not in r.stdout  # its own prompts: no hint to give some
    assert (art / MANIFEST_NAME).read_bytes() == raw


def test_refinement_around_the_winner(art, ids_file):
    # --confirm 0: the refinement is centred on the grid's winner as first measured, which confirming would re-rank
    out = tune_json(art, ids_file, "--top-k", "2", "--depth", "2,4", "--total-tokens", "4,8", "--dry-run",
                    "--confirm", "0")
    grid = [r for r in out["settings"] if r["stage"] == "grid"]
    refine = [r["tree"] for r in out["settings"] if r["stage"] == "refine"]
    # (2, 4, 4) runs, and is measured, as (2, 3, 4): a level-4 node is never among 4 verified ones
    assert sorted((r["tree"]["depth"], r["tree"]["total_tokens"]) for r in grid) == [(2, 4), (2, 8), (3, 4), (4, 8)]
    best = max(grid, key=lambda r: r["speedup"])["tree"]
    # one dimension at a time: top_k has one value (nothing); depth and total_tokens give the midpoints to their
    # neighbours in the lists 2,4 and 4,8 (from a trimmed depth 3, (2 + 3) // 2 = 2), and from the lowest also its
    # half; each as trimmed, and not one measured already
    near = {"depth": {2: [1, 3], 3: [2], 4: [3]}, "total_tokens": {4: [2, 6], 8: [6]}}
    want = [TreeParams(**{**best, dim: v}) for dim, by in near.items() for v in by[best[dim]]]
    done = [TreeParams(**r["tree"]) for r in grid]
    want = list(dict.fromkeys(t.trimmed() for t in want if t.total_tokens <= t.max_candidates))
    want = [t.to_dict() for t in want if t not in done]
    def key(t: dict) -> list:
        return sorted(t.items())

    assert sorted(refine, key=key) == sorted(want, key=key)  # rows are in rank order, not proposal order


def test_lossy_setting_is_never_the_winner(art, ids_file, monkeypatch):
    real = T._summarise

    def sabotage(tree, stage, rows, path=T.TREE_PATH):  # as if EAGLE had diverged from no-draft at top_k 2
        row = real(tree, stage, rows, path)
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


def test_every_setting_runs_on_the_path_the_runtime_runs_it(art, ids_file):
    """A setting whose top_k has a draft tree graph (the export writes them for top_k 1-4) is measured as the runtime
    drafts it: one draft call a round, the graph cut to the setting's depth; a top_k without one (5) level by level
    with the step graph. The report says which, and the tree tune writes is drafted as it was measured."""
    from eagle_export import contract as C
    from eagle_export.tools.commands.bench import PairedSession

    out = tune_json(art, ids_file, "--top-k", "2,5", "--depth", "1,3", "--total-tokens", 4, "--no-refine",
                    "--no-screen", "--confirm", 0, "--spin", "run")
    paths = {(r["tree"]["top_k"], r["tree"]["depth"]): r["path"] for r in out["settings"]}
    assert paths == {(2, 1): T.TREE_PATH, (2, 3): T.TREE_PATH, (5, 1): T.STEP_PATH, (5, 3): T.STEP_PATH}
    with PairedSession(art, prompts=ids_file, threads=1, guard=False) as s:  # as tune runs it: every round drafts
        for tree in (TreeParams(2, 3, 4), TreeParams(5, 3, 4)):
            run = s.run(0, 6, tree, True)  # the proxy counts the decode's calls (after the prefill's token)
            calls, rounds = dict(s.proxy.calls), run.rounds
            if tree.top_k == 2:  # one call for each round that goes on (the first round's tree: the prefill's)
                assert calls == {s.rt.backend.target_graph: rounds, C.tree_call(2, 3): rounds - 1}, calls
            else:  # every round's levels, and the context of each round that goes on
                assert calls == {s.rt.backend.target_graph: rounds, C.DRAFT_GRAPH: rounds * 3 + rounds - 1}, calls
    winner = TreeParams(**out["winner"]["tree"])
    rt = EagleRuntime.open(art, threads=1)
    assert rt.manifest.tree_defaults == winner
    assert (C.tree_call(winner.top_k, winner.depth) in rt.backend.graphs) == (out["winner"]["path"] == T.TREE_PATH)


def test_screen_keeps_the_best_third_and_any_close_to_the_best():
    """The grid's screen goes on with the best third of the settings measured on the first prompts (at least
    ``keep_min``) and any within ``margin`` of the best's speedup; lossy ones stay to be reported."""
    def row(speedup, lossless=True):
        return T.SettingRow(TreeParams(1, 1, 1), "grid", 2.0, 100.0, 50.0, speedup, lossless, 1)

    rows = [row(x / 10) for x in (20, 19, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5)] + [row(3.0, lossless=False)]
    keep, drop = T.screened(rows, keep_min=3, margin=0.1)
    assert [r.speedup for r in keep] == [2.0, 1.9, 1.5, 1.4, 1.3, 3.0]  # ceil(13 / 3) = 5 lossless, the lossy one
    assert [r.speedup for r in drop] == [1.2, 1.1, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    keep, _ = T.screened(rows, keep_min=3, margin=0.5)  # within half of 2.0: down to 1.0
    assert [r.speedup for r in keep if r.lossless] == [2.0, 1.9, 1.5, 1.4, 1.3, 1.2, 1.1, 1.0]
    keep, drop = T.screened(rows[:4], keep_min=5)
    assert len(keep) == 4 and drop == []


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


def test_a_plain_default_records_the_spin_policy_fastest_for_plain_decoding(art):
    """Where no tree pays at any batch size measured, the record keeps the spin stage's policy with the most no-draft
    tokens/s (the runtime then decodes plainly by default), not the one with the most EAGLE tokens/s that the stages
    ran with; where a tree pays, for one sequence or at some N, it keeps the stages' policy."""
    eagle_best = T.SpinRow("target=run,draft=off", 30.0, 20.0, True, 4)
    plain_best = T.SpinRow("target=on,draft=off", 25.0, 24.0, True, 4)
    lossy = T.SpinRow("off", 10.0, 99.0, False, 4)  # never kept
    flat = T.SettingRow(TreeParams(1, 1, 2), "grid", 1.0, 20.0, 20.0, 1.0, True, 2)  # below MIN_SPEEDUP: no draft
    report = T.TuneReport(str(art), "ort", "cpu", 1, 4, 1, 2, T.Grid(), True, [flat], {}, TreeParams(),
                          spin_rows=[eagle_best, plain_best, lossy], spin=eagle_best.spin)
    assert report.no_draft and report.recorded_spin == plain_best.spin
    report.spin_rows = [eagle_best, plain_best]
    m = T.write_winner(art, report)
    assert m.tuned.spin == plain_best.spin and m.batch_trees.pick(1) is None
    assert "fastest for plain decoding" in report.format()
    pays_at_2 = SizeRow(2, 4, [Candidate(TreeParams(1, 1, 2), 1.5, 30.0, 20.0, 1.5, True)], min_speedup=1.05)
    report.batch = [pays_at_2]
    assert report.recorded_spin == eagle_best.spin
    report.batch = []
    report.rows = [T.SettingRow(TreeParams(1, 1, 2), "grid", 1.5, 30.0, 20.0, 1.5, True, 2)]
    assert not report.no_draft and report.recorded_spin == eagle_best.spin
    assert T.write_winner(art, report).tuned.spin == eagle_best.spin


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
    # around a trimmed winner (1/8/8 runs as 1/7/8), whose depth is not in the list: its neighbours' midpoints
    grid = T.Grid((1,), (2, 4, 8), (4, 8))
    # (depth (4 + 7) // 2 = 5 makes 6 candidates, too few for 8; total_tokens (4 + 8) // 2 = 6 runs as 1/5/6)
    s.manifest = SimpleNamespace(tree_limits=TreeLimits(4, 8, 12), quantization=None)
    assert T.refinements(TreeParams(1, 7, 8), grid, set(), s) == [TreeParams(1, 5, 6)]
    assert T.refinements(TreeParams(1, 7, 8), grid, {TreeParams(1, 5, 6)}, s) == []
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

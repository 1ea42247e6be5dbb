"""The tree per number of active sequences (manifest ``batch_trees``, eagle_export/tree_params.py ``BatchTrees``):
the table is checked on load; the scheduler applies its row for each round's active count (a tree, or plain
one-token rounds), explicit trees win over it; tokens stay those of plain decoding while sequences join, leave and
change trees between rounds; the draft cache of a sequence that had plain rounds catches up before it drafts."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from eagle_export.errors import GenerationError, ManifestError
from eagle_export.manifest import load_manifest, set_tree_defaults
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.scheduler import RequestStream
from eagle_export.tree_params import BatchTree, BatchTrees, TreeParams

B = 4
# verifies 7 rows; top_k 4 and a depth within tree_defaults' (4, 3, 12): the draft tree graph grows it with the context
# pass, so switching away from it must drop a tree grown for the next round
T1 = TreeParams(top_k=4, depth=2, total_tokens=6)
T4 = TreeParams(top_k=1, depth=3, total_tokens=3)  # verifies 4 rows
OWN = TreeParams(top_k=3, depth=2, total_tokens=7)  # an explicit tree: verifies 8 rows
# 1 sequence: T1; 2 and 3: no draft; 4: T4 (tree_defaults, top_k 4 / 12 tokens, is none of them)
TABLE = BatchTrees((BatchTree(1, T1), BatchTree(2, None), BatchTree(4, T4)))


def test_table_rows_and_checks():
    assert [TABLE.pick(n) for n in (1, 2, 3, 4, 9)] == [T1, None, None, T4, T4]
    assert BatchTrees.from_list(TABLE.to_list()) == TABLE
    bad = {
        "non-empty list": [],
        "must start at active 1": [{"active": 2, "tree": None}],
        "larger than the row before": [{"active": 1, "tree": None}, {"active": 1, "tree": None}],
        "null (no draft) or": [{"active": 1, "tree": {"top_k": 2}}],
        "keys active, tree": [{"active": 1}],
        "exceeds the 6 draft nodes": [{"active": 1, "tree": {"top_k": 2, "depth": 1, "total_tokens": 9}}],
        "active must be an integer": [{"active": "1", "tree": None}],
    }
    for msg, raw in bad.items():
        with pytest.raises(GenerationError, match=re.escape(msg)):
            BatchTrees.from_list(raw)


@pytest.fixture(scope="module")
def tabled(models, tmp_path_factory):
    """The batched tiny artifact, copied, with TABLE in its manifest."""
    _, _, art = models("mha", max_batch=B)
    out = tmp_path_factory.mktemp("tabled") / "art"
    shutil.copytree(art, out)
    set_tree_defaults(out, None, batch_trees=TABLE)
    return out


def test_manifest_keeps_and_checks_the_table(tabled, tmp_path):
    assert load_manifest(tabled).batch_trees == TABLE
    bad = tmp_path / "bad"
    shutil.copytree(tabled, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    raw["batch_trees"][1]["active"] = 1
    (bad / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"batch_trees\[1\].active 1 must be larger.*rerun `eagle-export tune"):
        load_manifest(bad)
    raw["batch_trees"] = [{"active": 1, "tree": None}, {"active": 8, "tree": None}]
    (bad / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="8 active sequences, more than the artifact's --max-batch 4"):
        load_manifest(bad)


def _requests(vocab: int, count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=int(rng.integers(2, 30))).tolist(), int(rng.integers(6, 40)))
            for _ in range(count)]


def test_scheduler_applies_the_table_per_round_losslessly(tabled):
    """Each round of a table-following request uses the row of that round's active count: its trace hook sees a
    verify tree of that row's size in drafting rounds and is not called in no-draft rounds. An explicit tree wins,
    --no-draft stays plain; every request's tokens equal plain decoding alone."""
    rt = EagleRuntime.open(tabled, threads=1, max_batch=B)
    single = EagleRuntime.open(tabled, threads=1)
    sched, gen = rt.scheduler, rt.generator
    reqs = _requests(rt.manifest.target.vocab_size, 10, seed=3)
    kinds = ["tuned"] * len(reqs)
    kinds[2], kinds[7] = "own", "plain"
    seen: list[list[tuple[int, int, int]]] = [[] for _ in reqs]

    def make(i):
        p, n = reqs[i]
        tree = OWN if kinds[i] == "own" else None

        def hook(vt, acc):  # runs in the scheduler thread, inside the round
            seen[i].append((sched.rounds, len(gen.active), vt.num_nodes))
        return lambda: gen.check(p, n, tree, kinds[i] != "plain", False, None, None, on_round=hook)

    with sched._cv:  # every request queued before the first round: the same rounds (and active counts) every run
        streams = [sched.submit(make(i), RequestStream()) for i in range(len(reqs))]
    results = [s.wait(timeout=300) for s in streams]
    active = sched.active_per_round
    assert {1, 2, 3, 4} <= set(active), active  # every row of the table (and a count between rows) was used
    for i, ((p, n), res) in enumerate(zip(reqs, results, strict=True)):
        plain = single.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, use_draft=False)
        assert res.tokens == plain.tokens, i
        first = sched.join_rounds[i]
        mine = range(first, first + res.stats.rounds)
        if kinds[i] == "tuned":
            want = [(r, active[r], TABLE.pick(active[r]).verify_tokens) for r in mine if TABLE.pick(active[r])]
        elif kinds[i] == "own":
            want = [(r, active[r], OWN.verify_tokens) for r in mine]
        else:
            want = []
        assert seen[i] == want, (i, kinds[i])
    assert any(seen[i] for i in range(len(reqs)) if kinds[i] == "tuned")
    rt.close()
    single.close()


def test_draft_cache_catches_up_after_plain_rounds(tabled):
    """Two sequences that alternate plain and drafting rounds (with a lag long enough to fill its rows) end with
    the draft cache and context row a sequence that drafted every round has: the draft still sees every token."""
    def drive(schedule):
        rt = EagleRuntime.open(tabled, threads=1, max_batch=2, prefill_chunk=8)
        gen = rt.generator
        sinks = [RequestStream(), RequestStream()]
        for (p, _), sink in zip(_requests(rt.manifest.target.vocab_size, 2, seed=5), sinks, strict=True):
            gen.join(gen.check(p, 200, None, True, False), sink)
        for tree in schedule:
            gen.round(tree)
        assert len(gen.active) == 2
        P = gen._lag_rows
        out = [(s.L, [c[0, :s.L].clone() for c in gen.dcache.rows(b * gen.dplan.stride, s.L)],
                gen.ctx_ids[b].copy(), list(s.stop.out)) for b, s in enumerate(gen.active)]
        rt.close()
        return out, P

    mixed, P = drive([T1, None, None, T4, *[None] * 12, T1, None, T1])
    assert P < 12  # the 12 plain rounds filled the lag rows once (a context pass between drafting rounds)
    ref, _ = drive([T1] * 16)
    for (L, rows, ctx, toks), (L_ref, rows_ref, ctx_ref, toks_ref) in zip(mixed, ref, strict=True):
        n = min(L, L_ref)
        k = min(len(toks), len(toks_ref))
        assert toks[:k] == toks_ref[:k]
        for a, b in zip(rows, rows_ref, strict=True):
            torch.testing.assert_close(a[:n], b[:n], rtol=1e-4, atol=1e-5)
        if L == L_ref:
            assert (ctx == ctx_ref).all()


def test_a_sequence_sitting_out_beside_an_explicit_tree_catches_up_from_its_own_row(tabled):
    """Slot 0 verifies an explicit tree (8 rows a round) every round; slot 1 follows the table, which the rounds
    given here turn off and on, so it sits out rounds and keeps its root's target feature for the draft's catch-up:
    row b * tt = 8 of that round's target output, not row b = 1 (slot 0's first tree node). Its tokens would stay
    right either way (the target decides them): its draft cache and context row must be those of a run where it
    drafted every round (the draft's inputs, which decide its acceptance from then on)."""
    def drive(schedule):
        rt = EagleRuntime.open(tabled, threads=1, max_batch=2, prefill_chunk=8)
        gen = rt.generator
        sinks = [RequestStream(), RequestStream()]
        drafted = []  # slot 1's rounds with a draft (its trace hook runs in those only)
        for (p, _), tree, sink in zip(_requests(rt.manifest.target.vocab_size, 2, seed=7), (OWN, None), sinks,
                                      strict=True):
            hook = None if tree is OWN else lambda vt, acc: drafted.append(vt.num_nodes)
            gen.join(gen.check(p, 200, tree, True, False, on_round=hook), sink)
        for tree in schedule:
            gen.round(tree)
        assert len(gen.active) == 2 and gen.active[0].req.tree == OWN and gen.active[1].req.tuned
        s = gen.active[1]
        out = (s.L, [c[0, :s.L].clone() for c in gen.dcache.rows(gen.dplan.stride, s.L)], gen.ctx_ids[1].copy(),
               list(s.stop.out), len(drafted))
        rt.close()
        return out, gen._lag_rows

    P = 10  # the lag rows of this artifact at max_batch 2: 10 plain rounds fill them (a catch-up between rounds)
    mixed, lag_rows = drive([T1, None, None, T1, *[None] * P, T1, T1, T1])
    assert lag_rows == P
    ref, _ = drive([T1] * (5 + P))
    (L, rows, ctx, toks, drafted), (L_ref, rows_ref, ctx_ref, toks_ref, _) = mixed, ref
    assert drafted == 5  # slot 1 drafted in the T1 rounds only: it sat out 2 rounds, then P (its lag rows full)
    n, k = min(L, L_ref), min(len(toks), len(toks_ref))
    assert toks[:k] == toks_ref[:k]
    for a, b in zip(rows, rows_ref, strict=True):
        torch.testing.assert_close(a[:n], b[:n], rtol=1e-4, atol=1e-5)
    if L == L_ref:
        assert (ctx == ctx_ref).all()


def test_tune_writes_the_table_and_bench_reports_it(models, tmp_path):
    """tune's per-batch stage measures each candidate against batched no-draft and writes N's row (the best
    candidate, or no draft below 1x); bench --concurrency then reports EAGLE as tuned beside plain batching."""
    from eagle_export.tools.commands.bench.concurrency import bench_concurrency
    from eagle_export.tools.commands.tune import TuneError, tune, write_winner

    _, _, src = models("mha", max_batch=B)
    art = tmp_path / "art"
    shutil.copytree(src, art)
    with pytest.raises(TuneError, match="--batch-sizes 8 is above the artifact's --max-batch 4"):
        tune(art, batch_sizes="2,8")
    report = tune(art, top_k="1", depth="1", total_tokens="1,2", max_new_tokens=6, threads=1, refine=False,
                  batch_sizes="auto", batch_requests=2)
    assert [row.active for row in report.batch] == [2, 4]
    for row in report.batch:
        assert sorted(c.tree.total_tokens for c in row.candidates) == [1, 2]  # the ladder: one tree per size
        best = max(row.candidates, key=lambda c: c.speedup)
        # a size drafts only where its best tree beats plain decoding by the margin (tune --min-speedup)
        assert row.choice.tree == (best.tree if best.speedup >= row.min_speedup else None)
    write_winner(art, report)
    table = load_manifest(art).batch_trees
    assert table == report.batch_table and [r.active for r in table.rows] == [1, 2, 4]
    assert "batch_trees: N>=1" in report.format()

    out = bench_concurrency(art, concurrency=[2], requests=2, max_new_tokens=6, threads=1)
    (level,) = out.levels
    assert level.lossless and level.tuned is not None and level.tuned.tokens == 12
    assert out.to_dict()["aggregate"]["throughput_tokens_per_s"]["tuned"] == level.tuned.throughput
    assert "EAGLE as tuned" in out.format()

"""Batched EAGLE and continuous batching (runtime/generator.py, runtime/scheduler.py,
runtime/slots.py).

One runtime with B = 4 slots serves more requests than slots, of different prompt lengths and lengths to
generate, so they join at different rounds and leave when they finish; every sequence must be exactly what it is
alone. Greedy: transformers' generate for each prompt alone (EAGLE-1/2 and EAGLE-3, fp32), and the
single-sequence runtime's tokens on an fp16 artifact. Sampling: the same seeded request alone and in a full
batch gives the same tokens. A bad request fails alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from model_table import EAGLE3_MODELS
from reference import Comparison, GreedyReference

from eagle_export import contract as C
from eagle_export.errors import GenerationError
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.runtime import EagleRuntime, SamplingParams
from eagle_export.runtime.slots import LayoutPlan, StopRule, move_order
from eagle_export.tree_params import TreeParams

B = 4
TREES = [TreeParams(top_k=4, depth=3, total_tokens=10), TreeParams(top_k=1, depth=5, total_tokens=5),
         TreeParams(top_k=2, depth=2, total_tokens=6)]


def requests(vocab: int, count: int = 10, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens): prompt lengths 1..60 and lengths 8..47, so sequences end at different rounds."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=int(rng.integers(1, 61))).tolist(), int(rng.integers(8, 48)))
            for _ in range(count)]


def run_batched(rt: EagleRuntime, reqs, **kw) -> list:
    streams = [rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, **kw) for p, n in reqs]
    return [s.wait(timeout=300) for s in streams]


def check_joins(rt: EagleRuntime, count: int) -> None:
    sched = rt.scheduler
    assert len(sched.join_rounds) == count
    assert len(set(sched.join_rounds)) >= 3, sched.join_rounds  # requests joined a running batch at several rounds
    assert max(sched.active_per_round) == B


MODELS = [
    pytest.param("mha", dict(fc_bias=True), id="eagle1-mha"),
    pytest.param(*EAGLE3_MODELS["llama-d2t"], id="eagle3-llama-d2t"),
]


@pytest.mark.parametrize("preset, kw", MODELS)
def test_batched_greedy_equals_transformers_generate(models, preset, kw):
    target, _, art = models(preset, max_batch=B, **kw)
    rt = EagleRuntime.open(art, threads=1, guard=False, max_batch=B)
    single = EagleRuntime.open(art, threads=1, guard=False)
    ref = GreedyReference(target)
    reqs = requests(rt.manifest.target.vocab_size)
    cmp = Comparison()
    accepted = 0
    for tree in TREES[:2]:
        rt.scheduler.join_rounds.clear()
        for (prompt, n), res in zip(reqs, run_batched(rt, reqs, tree=tree), strict=True):
            assert res.finish_reason == "length" and len(res.tokens) == n
            ref.compare(prompt, res.tokens, ref.generate(prompt, n), cmp, f"batched {tree}")
            accepted += sum(res.stats.accept_lengths)
            # the trees too: a draft-side slip (another slot's context row) keeps greedy tokens but not acceptance
            alone = single.generate(prompt_ids=prompt, max_new_tokens=n, stop_on_eos=False, tree=tree)
            assert res.stats.accept_lengths == alone.stats.accept_lengths
        check_joins(rt, len(reqs))
    assert not cmp.failures, "\n".join(cmp.failures[:5])
    assert cmp.ties <= 2 and accepted > 20  # real multi-token acceptance, not only rejections
    rt.close()


@pytest.mark.parametrize("preset, kw", [pytest.param("gqa", {}, id="eagle1-gqa"),
                                        pytest.param(*EAGLE3_MODELS["qwen2-identity"], id="eagle3-qwen2")])
def test_batched_fp16_equals_single_sequence(models, preset, kw):
    """fp16 graphs: each sequence of a batch (mixed trees and --no-draft) equals the same request run alone on the
    single-sequence runtime, token for token: padding rows and masked regions change nothing."""
    _, _, art = models(preset, dtype="fp16", max_batch=B, **kw)
    single = EagleRuntime.open(art, threads=1, guard=False)
    rt = EagleRuntime.open(art, threads=1, guard=False, max_batch=B)
    reqs = requests(single.manifest.target.vocab_size, seed=1)
    kws = [dict(tree=TREES[i % 3]) if i % 4 != 3 else dict(use_draft=False) for i in range(len(reqs))]
    streams = [rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, **kw)
               for (p, n), kw in zip(reqs, kws, strict=True)]
    for (p, n), kw, s in zip(reqs, kws, streams, strict=True):
        alone = single.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, **kw)
        got = s.wait(timeout=300)
        assert got.tokens == alone.tokens, (p, kw)
        assert got.stats.accept_lengths == alone.stats.accept_lengths
    check_joins(rt, len(reqs))
    rt.close()


def test_sampling_does_not_depend_on_the_batch(models):
    """A seeded sampled request gives the same tokens alone and in a full batch of other (greedy and sampled)
    requests, and the same as on the single-sequence runtime."""
    _, _, art = models("mha", max_batch=B)
    rt = EagleRuntime.open(art, threads=1, guard=False, max_batch=B)
    single = EagleRuntime.open(art, threads=1, guard=False)
    prompt, sp = [5, 9, 13, 2, 7], SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    kw = dict(prompt_ids=prompt, max_new_tokens=40, stop_on_eos=False, tree=TREES[0], sampling=sp)
    alone = rt.submit(**kw).wait(timeout=300).tokens
    others = [rt.submit(prompt_ids=[3 + i] * (5 + 9 * i), max_new_tokens=60, stop_on_eos=False,
                        sampling=SamplingParams(temperature=1.0, seed=100 + i) if i % 2 else None)
              for i in range(B - 1)]
    crowded = rt.submit(**kw)
    assert crowded.wait(timeout=300).tokens == alone
    assert [o.wait(timeout=300) for o in others]
    assert max(rt.scheduler.active_per_round) == B
    assert single.generate(**kw).tokens == alone
    other_seed = rt.submit(**{**kw, "sampling": sp.with_seed(8)}).wait(timeout=300).tokens
    assert other_seed != alone  # the seed matters: the equality above is not vacuous
    rt.close()


def test_bad_request_fails_alone_and_threads_submit(models):
    """Requests submitted from several threads, one of them with an id outside the vocabulary: that stream raises
    a GenerationError, every other one gets its single-sequence tokens."""
    _, _, art = models("mha", max_batch=B)
    rt = EagleRuntime.open(art, threads=1, guard=False, max_batch=B)
    single = EagleRuntime.open(art, threads=1, guard=False)
    reqs = requests(single.manifest.target.vocab_size, count=6, seed=2)
    want = [single.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False).tokens for p, n in reqs]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(reqs) + 1)

    def client(i: int) -> None:
        start.wait()
        if i == len(reqs):
            bad = rt.submit(prompt_ids=[1, 2, 10_000], max_new_tokens=8)
            try:
                list(bad)
            except GenerationError as e:
                errors.append(e)
            return
        p, n = reqs[i]
        stream = rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False)
        chunks = list(stream)
        got[i] = [t for c in chunks for t in c]
        assert stream.result.tokens == got[i]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(errors) == 1 and "outside the vocabulary" in str(errors[0])
    assert [got.get(i) for i in range(len(reqs))] == want
    # generate() on a batched runtime goes through the same slots, and its errors are raised as before
    assert rt.generate(prompt_ids=reqs[0][0], max_new_tokens=reqs[0][1], stop_on_eos=False).tokens == want[0]
    with pytest.raises(GenerationError, match="max_new_tokens"):
        rt.generate(prompt_ids=[1, 2], max_new_tokens=0)
    rt.close()


def test_sequences_reaching_the_capacity_in_a_batch(tmp_path):
    """The trained fixture (long accepted paths) at capacity 64, its 12 prompts run to the capacity 4 at a time:
    each ends as it does alone (tokens, finish_reason, acceptance), although most last rounds accept a path
    past the stride (capped at the graph's past_len range, 63): those rows are not written into the
    neighbour's region."""
    from eagle_export.prompts import read_prompts
    from eagle_export.tools.commands.demo import FIXTURE, fixture_tree

    art = export_artifact(FIXTURE / "target", FIXTURE / "eagle1", tmp_path / "fx",
                          ExportOptions(max_seq_len=64, tree=fixture_tree("eagle1"), max_batch=B), progress=False)
    single = EagleRuntime.open(art, threads=1, guard=False)
    rt = EagleRuntime.open(art, threads=1, guard=False, max_batch=B)
    assert rt.generator.tplan.rows_per_slot == 63
    prompts = [single.encode(spec.text) for spec in read_prompts(FIXTURE / "prompts.jsonl")]
    streams = [rt.submit(prompt_ids=p, max_new_tokens=64, stop_on_eos=False) for p in prompts]
    past_the_region = 0
    for p, stream in zip(prompts, streams, strict=True):
        got = stream.wait(timeout=300)
        alone = single.generate(prompt_ids=p, max_new_tokens=64, stop_on_eos=False)
        assert (got.tokens, got.finish_reason) == (alone.tokens, "capacity") and len(p) + len(got.tokens) == 64
        assert got.stats.accept_lengths == alone.stats.accept_lengths
        acc = got.stats.accept_lengths
        past_the_region += len(p) + sum(a + 1 for a in acc[:-1]) + acc[-1] + 1 > 63  # last round: L + path rows
    assert past_the_region >= 3 and max(rt.scheduler.active_per_round) == B  # the case this test is about
    rt.close()


def test_max_batch_above_the_artifact_is_refused(models):
    _, _, art = models("mha")
    with pytest.raises(GenerationError, match=r"max_batch must be an integer in \[1, 1\]"):
        EagleRuntime.open(art, max_batch=2)


# ---- pure bookkeeping ------------------------------------------------------------------------------


def test_stop_rule():
    s = StopRule(max_new=5, room=100, eos={9})
    assert s.emit([1, 2]) == ([1, 2], None)
    assert s.emit([3, 9, 4]) == ([3, 9], "eos")
    s = StopRule(max_new=5, room=3, eos=None)
    assert s.emit([1, 2, 3, 4]) == ([1, 2, 3], "capacity")
    s = StopRule(max_new=3, room=10, eos=None)
    assert s.emit([1, 2]) == ([1, 2], None) and s.emit([3, 4]) == ([3], "length") and s.out == [1, 2, 3]


def test_layout_plan_keeps_padding_bounded():
    plan = LayoutPlan(rows_per_slot=1000, step=64)
    assert plan.stride == 64
    assert plan.wanted(10) == 64 and plan.wanted(64) == 64
    assert plan.wanted(65) == 128  # grows by whole steps
    plan.stride = 512
    assert plan.wanted(500) == 512 and plan.wanted(449) == 512  # under two steps of slack: no move
    assert plan.wanted(300) == 320  # shrinks when the longest sequence left
    assert plan.wanted(990) == 1000  # never past the region's rows
    with pytest.raises(ValueError):
        plan.wanted(1001)
    long = LayoutPlan(rows_per_slot=100_000, step=16)
    assert long.wanted(40) == 48 and long.granule(40) == 16  # short sequences: fine steps, little padding
    assert long.granule(5000) == 512 and long.wanted(5000) == 5120  # long ones: need / 16 .. need / 8, few moves
    long.stride = 5120
    assert long.wanted(4500) == 5120 and long.wanted(4000) == 4096


def test_move_order_never_overwrites_an_unmoved_region():
    """Simulate the in-place region moves on a flat array: every slot's rows must arrive intact."""
    for old, new in ((8, 13), (13, 8), (5, 5)):
        count, length = 4, 5
        buf = np.full(count * max(old, new) + 8, -1)
        for b in range(count):
            buf[b * old:b * old + length] = 10 * b + np.arange(length)
        for b in move_order(old, new, count):
            buf[b * new:b * new + length] = buf[b * old:b * old + length].copy()
        for b in range(count):
            assert buf[b * new:b * new + length].tolist() == (10 * b + np.arange(length)).tolist()


# ---- one set of weights --------------------------------------------------------------------------

_RSS_CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from eagle_export.runtime import EagleRuntime

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

b = int(sys.argv[2])
before = rss()
rt = EagleRuntime.open(sys.argv[1], threads=1, guard=False, max_batch=b)
streams = [rt.submit(prompt_ids=list(range(3, 23 + 5 * i)), max_new_tokens=24, stop_on_eos=False) for i in range(b)]
for s in streams:
    s.wait(timeout=300)
g = rt.scheduler.gen
bufs = [*g.tcache.allocations, *g.dcache.allocations, g.ctx_hidden, *g._t.values()]
host = [g._mask.array, g._ids.array, g._pos.array, g._lidx.array, g.ctx_vals, g.ctx_ids]
print(json.dumps({"rss": rss() - before, "active": max(rt.scheduler.active_per_round),
                  "kv": sum(t.numel() * t.element_size() for t in (g.tcache.allocations[0], g.dcache.allocations[0])),
                  "buffers": sum(t.numel() * t.element_size() for t in bufs) + sum(a.nbytes for a in host)}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="reads the resident set size from /proc")
def test_eight_sequences_share_one_set_of_weights(tmp_path):
    """The trained fixture (32 MiB of fp32 weights, 8.5 MiB of K/V per sequence) in a fresh process: a runtime
    with B = 8 busy slots is resident within a B = 1 runtime plus 7 more K/V caches plus 15% of them. A copy of
    the weights per slot would add 7 x 32 MiB."""
    from eagle_export.tools.commands.demo import FIXTURE, fixture_tree

    art = export_artifact(FIXTURE / "target", FIXTURE / "eagle1", tmp_path / "fx",
                          ExportOptions(max_seq_len=960, tree=fixture_tree("eagle1"), max_batch=8), progress=False)

    def child(b: int) -> dict:
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(art), str(b)], capture_output=True, text=True,
                           timeout=600, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])

    one, eight = child(1), child(8)
    weights = sum(p.stat().st_size for p in art.glob("*.onnx*"))
    extra_kv, extra = eight["kv"] - one["kv"], eight["buffers"] - one["buffers"]
    mib = 2**20
    print(f"\nweights {weights / mib:.1f} MiB; B=1: RSS +{one['rss'] / mib:.1f} MiB (K/V {one['kv'] / mib:.1f}, all "
          f"buffers {one['buffers'] / mib:.1f}); B=8: RSS +{eight['rss'] / mib:.1f} MiB (K/V {eight['kv'] / mib:.1f}, "
          f"all buffers {eight['buffers'] / mib:.1f}); B=8 - B=1: {(eight['rss'] - one['rss']) / mib:.1f} MiB")
    assert eight["active"] == 8 and extra_kv > weights  # the 7 extra caches outweigh one copy of the weights
    # B = 8 costs its extra buffers (mostly the 7 K/V caches) + 15%, and 8 MiB for the graphs' larger working
    # memory and allocator noise (measured spread of one process's RSS: about 10 MiB): never a weight copy.
    assert eight["rss"] <= one["rss"] + 1.15 * extra + 8 * mib


# ---- the TensorRT engines' profiles -------------------------------------------------------------


def test_batched_calls_fit_the_engines_profiles(models, tmp_path):
    """Engines built from an artifact exported with --max-batch 4 (TensorRT-RTX on the CPU): every call of a
    batched run (prefills alone, tree levels, verifies and context passes over several sequences) is planned as
    TrtBackend plans it, inside a profile, at aligned addresses (ONNX Runtime computes; no GPU here), and the
    tokens equal the single-sequence runtime's."""
    import shutil

    from conftest import ENGINE_MODEL
    from test_trt_backend import PlanningBackend

    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.manifest import load_manifest
    from eagle_export.runtime.embedding import TokenEmbedding
    from eagle_export.runtime.generator import Generator
    from eagle_export.runtime.scheduler import RequestStream, Scheduler

    art = shutil.copytree(models(max_batch=B, **ENGINE_MODEL)[2], tmp_path / "art")
    build_engines(art, BuildOptions(engine_lib="tensorrt-rtx"), progress=False)
    m = load_manifest(art)
    assert m.engines.options["max_batch"] == B  # carried from export --max-batch
    be = PlanningBackend(art, m)
    table = TokenEmbedding.open(art, m)
    sched = Scheduler(Generator(m, be, table, prefill_chunk=16, slots=B))
    single = Generator(m, PlanningBackend(art, m), table, prefill_chunk=16)
    rng = np.random.default_rng(3)
    reqs = [(rng.integers(3, 48, size=int(rng.integers(1, 30))).tolist(), int(rng.integers(4, 30))) for _ in range(7)]
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)
    streams = [sched.submit(lambda p=p, n=n: sched.gen.check(p, n, tree, stop_on_eos=False), RequestStream())
               for p, n in reqs]
    for (p, n), s in zip(reqs, streams, strict=True):
        want = [t for c in single.run(p, n, tree=tree, stop_on_eos=False) for t in c]
        assert s.wait(timeout=300).tokens == want
    sched.close()
    batched = [c for c in be.calls if c.axes["batch"] > 1]
    assert {c.graph for c in batched} == {C.TARGET_GRAPH, C.DRAFT_GRAPH}
    assert {(c.graph, c.profile) for c in be.calls} == {(g, i) for g in (C.TARGET_GRAPH, C.DRAFT_GRAPH) for i in (0, 1)}
    assert max(c.axes["batch"] for c in batched) == B


def test_run_takes_the_callers_random_source(models):
    """Generator.run(rng=...) samples from the caller's source: the same draws as the seed it was made from."""
    _, _, art = models("mha")
    rt = EagleRuntime.open(art, threads=1, guard=False)
    sp = SamplingParams(temperature=1.0, seed=11)
    want = rt.generate(prompt_ids=[4, 8, 15], max_new_tokens=24, stop_on_eos=False, sampling=sp).tokens
    got = [t for c in rt.generator.run([4, 8, 15], 24, stop_on_eos=False, sampling=sp.with_seed(None),
                                       rng=np.random.default_rng(11)) for t in c]
    assert got == want


def test_batched_on_the_emulated_tensorrt_backend(models, tmp_path):
    """The real TrtBackend, executed by the CPU emulator (TensorRT's rules enforced on every call), on engines built
    from an artifact exported with --max-batch 4: a batched run of more requests than slots equals the
    single-sequence ONNX Runtime runtime on the same (standard) graph, token for token (greedy, EAGLE and
    --no-draft)."""
    import shutil

    from conftest import ENGINE_MODEL

    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.manifest import load_manifest
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = shutil.copytree(models(max_batch=B, **ENGINE_MODEL)[2], tmp_path / "art")
    build_engines(art, BuildOptions(engine_lib="tensorrt-rtx", max_prefill=16), progress=False)
    be = emulated_backend(art)
    rt = EagleRuntime(art, load_manifest(art), be, None, min(16, be.max_prefill), max_batch=B)
    # The graph TensorRT runs, the standard one: the fused graph's float32 results differ by ~1e-6, which flips
    # the near-ties a random tiny model has on some CPUs (seen on an AVX-512 Xeon: logits 2.4472942 vs 2.4472947).
    single = EagleRuntime.open(art, threads=1, guard=False, fused=False)
    rng = np.random.default_rng(4)
    reqs = [(rng.integers(3, 48, size=int(rng.integers(1, 30))).tolist(), int(rng.integers(4, 30))) for _ in range(7)]
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)
    for kw in (dict(tree=tree), dict(use_draft=False)):
        for (p, n), got in zip(reqs, run_batched(rt, reqs, **kw), strict=True):
            assert got.tokens == single.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, **kw).tokens
    assert max(rt.scheduler.active_per_round) == B
    rt.close()


def test_batched_device_rounds_read_once_and_a_sampled_request_among_them(models, tmp_path):
    """The emulated TensorRT backend over engines that select and accept (engines/round_ops.py), --max-batch 4:
    greedy requests with the default tree run every round on the device, the verify inputs of all sequences made
    there, one host read a round (and one per prefill), tokens equal to the single ONNX Runtime runtime's. With
    sampled requests among them, a round that holds one selects and accepts on the host (the greedy sequences'
    trees drafted again from their context rows) and every request still equals its single run. (This random model
    accepts no draft: what the rounds accept is checked on a drafting pair, below.)"""
    import shutil

    from conftest import ENGINE_MODEL

    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.manifest import load_manifest
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = shutil.copytree(models(max_batch=B, **ENGINE_MODEL)[2], tmp_path / "art")
    build_engines(art, BuildOptions(engine_lib="tensorrt-rtx", max_prefill=16), progress=False)
    be = emulated_backend(art)
    rt = EagleRuntime(art, load_manifest(art), be, None, min(16, be.max_prefill), max_batch=B, guard=None)
    single = EagleRuntime.open(art, threads=1, guard=False, fused=False)
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)
    assert be.tree_selects == {4: 12} and be.accepts_in_graph
    rng = np.random.default_rng(5)
    reqs = [(rng.integers(3, 48, size=int(rng.integers(1, 30))).tolist(), int(rng.integers(4, 30))) for _ in range(7)]
    mem = be.emulator.mem
    before = mem.host_reads
    results = run_batched(rt, reqs, tree=tree)
    rounds = len(rt.scheduler.active_per_round)
    assert mem.host_reads - before == len(reqs) + rounds  # each prefill's first token, then one read a round
    assert max(rt.scheduler.active_per_round) == B
    for (p, n), got in zip(reqs, results, strict=True):
        assert got.tokens == single.generate(prompt_ids=p, max_new_tokens=n, tree=tree, stop_on_eos=False).tokens
    # Mixed: every other request sampled (seeded), the rest greedy.
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    kws = [dict(tree=tree, sampling=sp.with_seed(i)) if i % 2 else dict(tree=tree) for i in range(len(reqs))]
    gen = rt.generator
    on_device, fallbacks = gen._on_device, []

    def watched(slots):  # which rounds went back to the host with a tree selected on the device
        dev = [s.dev for s in slots]
        got = on_device(slots)
        fallbacks.append(any(dev) and not got)
        return got

    gen._on_device = watched
    streams = [rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, **kw)
               for (p, n), kw in zip(reqs, kws, strict=True)]
    for (p, n), kw, s in zip(reqs, kws, streams, strict=True):
        assert s.wait(timeout=300).tokens == single.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False,
                                                             **kw).tokens
    assert any(fallbacks)  # the host path took over device trees (and drafted them again), losslessly
    rt.close()


def test_device_rounds_accept_what_the_host_accepts_on_a_drafting_pair(tmp_path):
    """The bigram pair (tests/bigram.py: every draft accepted, except after two 'wrong' tokens where none is), exported
    with --max-batch 4, engines built with the operators that select and accept (engines/round_ops.py), emulated:
    runtimes of one and of four sequences whose rounds run on the device accept, round by round, exactly what the
    same engines accept when the host selects and accepts, and output the cycle. A random tiny model accepts nothing,
    so only a drafting pair can tell a wrong device tree (another sequence's, a stale one, a wrong mask or padding) or
    a wrong acceptance (path, bonus) from a right one: planted, each of those changes the accepted lengths. Then
    four sequences with two tree widths: the narrower trees' rows end in padding rows, each a depth-0 root of its
    own, which the emulator's ArgMax (the last of equal values first, as TensorRT may) took for the root of a round
    that accepts nothing until the deepest row's score broke the tie by row (planted: that request fails)."""
    from bigram import make_bigram_pair

    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.manifest import load_manifest
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    cycle = list(range(10, 27))
    target, draft = make_bigram_pair(tmp_path / "pair", cycle, wrong=(14, 21))
    art = export_artifact(target, draft, tmp_path / "art", ExportOptions(max_seq_len=128, max_batch=B), progress=False)
    build_engines(art, BuildOptions(engine_lib="tensorrt-rtx", max_prefill=16), progress=False)
    m = load_manifest(art)
    tree = m.tree_defaults
    rng = np.random.default_rng(2)
    reqs = [([*rng.integers(40, 300, size=int(rng.integers(0, 9))).tolist(), int(rng.choice(cycle))],
             int(rng.integers(10, 40))) for _ in range(7)]

    def runtime(slots: int, device: bool) -> EagleRuntime:
        be = emulated_backend(art)
        rt = EagleRuntime(art, m, be, None, min(16, be.max_prefill), max_batch=slots, guard=None)
        if not device:
            rt.generator._device_round = lambda s: False  # every tree selected and accepted on the host
        return rt

    for slots in (1, B):
        dev, host = runtime(slots, True), runtime(slots, False)
        assert dev.backend.tree_selects == {tree.top_k: tree.total_tokens} and dev.backend.accepts_in_graph
        got, want = run_batched(dev, reqs, tree=tree), run_batched(host, reqs, tree=tree)
        for (p, n), a, b in zip(reqs, got, want, strict=True):
            start = cycle.index(p[-1])
            assert a.tokens == [cycle[(start + 1 + i) % len(cycle)] for i in range(n)]
            assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths
        lengths = [x for r in got for x in r.stats.accept_lengths]
        assert max(lengths) == tree.depth + 1 and min(lengths) == 0  # full rounds, and rounds after a wrong token
        if slots == B:  # every other request a narrower tree: its rows of a device round end in padding rows
            narrow = TreeParams(tree.top_k, tree.depth, tree.total_tokens - 2)
            trees = [tree if i % 2 else narrow for i in range(len(reqs))]

            got, want = ([x.wait(timeout=300) for x in [
                rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, tree=t)
                for (p, n), t in zip(reqs, trees, strict=True)]] for rt in (dev, host))
            for a, b in zip(got, want, strict=True):
                assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths
            assert 0 in got[0].stats.accept_lengths  # a narrow tree's round that accepted nothing
        dev.close()
        host.close()

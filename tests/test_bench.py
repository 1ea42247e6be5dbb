"""`eagle-export bench` / tools/commands/bench/: EAGLE against --no-draft side by side, the JSON report's fields and
ranges, prompts files (text and ids lines, malformed lines named by number), the optional --plot."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from cli_run import cli, fail

from eagle_export import contract as C
from eagle_export.runtime.backend import Backend
from eagle_export.runtime.timing import TimingBackend
from eagle_export.tools.commands.bench import (
    _row,
    _Run,
    bench,
    median_run,
    mode_order,
    n_alpha,
)
from eagle_export.tools.commands.bench import peer as pog
from eagle_export.tools.commands.bench.peer import PeerRun
from eagle_export.tools.commands.demo import FIXTURE

P12 = [(7 * i + 3) % 48 for i in range(12)]  # ids valid in the 48-token fixtures
P9 = [(5 * i + 4) % 48 for i in range(9)]


def bench_json(*args) -> dict:
    r = cli("bench", *args, "--json", "--threads", 1)
    assert r.exception is None and r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def gqa(models):
    return models("gqa")[2]


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "ids.jsonl"
    p.write_text("\n".join(json.dumps({"prompt_ids": x}) for x in (P12, P9)) + "\n")
    return p


def test_bench_json_fields_and_ranges(gqa, ids_file):
    out = bench_json(gqa, "--prompts", ids_file, "--max-new-tokens", 16, "--no-guard")  # every round drafts
    agg = out["aggregate"]
    assert {"tau", "speedup", "tokens_per_s", "n_alpha", "time_split", "peak_rss_mb", "lossless", "prompts",
            "max_new_tokens", "tree", "mode_share", "spec_tau", "default", "guard"} <= set(agg)
    assert agg["mode_share"] == {"spec": 1.0, "plain": 0.0, "short_chain": 0.0} and agg["spec_tau"] == agg["tau"]
    assert agg["default"] is True and agg["guard"] is False
    assert agg["lossless"] is True
    assert agg["prompts"] == 2 and agg["max_new_tokens"] == 16
    assert agg["tree"] == {"top_k": 4, "depth": 3, "total_tokens": 12}
    assert agg["tokens_per_s"]["eagle"] > 0 and agg["tokens_per_s"]["no_draft"] > 0
    assert agg["peak_rss_mb"] > 0
    na = agg["n_alpha"]
    assert len(na) == 4  # depth + 1 levels
    assert na[0] is not None
    assert all(a is None or 0 <= a <= 1 for a in na)
    split = agg["time_split"]
    assert set(split) == {"draft", "target", "host"}
    assert all(0 <= v <= 1 for v in split.values())
    assert sum(split.values()) == pytest.approx(1, abs=1e-6)
    assert split["draft"] > 0 and split["target"] > 0
    rows = out["prompts"]
    assert [r["prompt_tokens"] for r in rows] == [12, 9]
    for r in rows:
        assert r["new_tokens"] == 16 and r["lossless"] is True  # EOS ignored: both modes run to the length
        assert r["speedup"] == pytest.approx(r["eagle_tok_s"] / r["no_draft_tok_s"])
        acc = r["accept_lengths"]
        assert r["rounds"] == len(acc) and r["tau"] == pytest.approx((sum(acc) + len(acc)) / len(acc))
        # The rounds committed the 15 tokens after the prefill's, the last one possibly cut at the length.
        assert sum(acc) + len(acc) - (acc[-1] + 1) < 16 - 1 <= sum(acc) + len(acc)
    acc = [a for r in rows for a in r["accept_lengths"]]
    assert agg["tau"] == pytest.approx((sum(acc) + len(acc)) / len(acc))
    assert agg["speedup"] == pytest.approx(statistics.median(r["speedup"] for r in rows))
    assert agg["tokens_per_s"] == pytest.approx({"eagle": statistics.median(r["eagle_tok_s"] for r in rows),
                                                 "no_draft": statistics.median(r["no_draft_tok_s"] for r in rows)})
    assert na == n_alpha(acc, 4)


def test_n_alpha_counts_a_depth_only_over_rounds_that_drafted_it():
    """A guarded chain's short rounds (runtime/chain_length.py) draft fewer tokens: a 2-token round that accepted
    both says nothing of a third (planted: counting it as a miss at depth 3 gives 1/3 there, not 1)."""
    accepts, drafts = [2, 2, 4, 0], [2, 2, 4, 4]
    assert n_alpha(accepts, 4, drafts) == [pytest.approx(3 / 4), 1.0, 1.0, 1.0]
    assert n_alpha(accepts, 4) == [pytest.approx(3 / 4), 1.0, pytest.approx(1 / 3), 1.0]


def test_bench_on_the_trained_fixture_reports_its_acceptance(trained, tmp_path):
    """Acceptance that only a trained head reaches: EAGLE-1/2 on 3 of the fixture's prompts, its tuned tree. A random
    head (or drafting from the wrong features) gives tau ~1.0; the card reports 4.05 on the whole prompt set."""
    p = tmp_path / "three.jsonl"
    p.write_text("".join((FIXTURE / "prompts.jsonl").read_text().splitlines(keepends=True)[:3]))
    out = bench_json(trained("eagle1"), "--prompts", p, "--max-new-tokens", 32, "--no-guard")
    agg = out["aggregate"]
    print(f"\nfixture eagle1, {agg['prompts']} prompts x 32 tokens: tau {agg['tau']:.2f}, n-alpha {agg['n_alpha']}")
    assert agg["lossless"] is True
    assert agg["tau"] > 2.5, agg
    assert agg["n_alpha"][0] > 0.5  # most first drafts accepted


def test_bench_text_and_ids_prompts_file_and_table(tiny, tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text(json.dumps({"prompt": "The quick brown fox"}) + "\n\n" + json.dumps({"prompt_ids": P12}) + "\n")
    out = bench_json(tiny[2], "--prompts", p, "--max-new-tokens", 16, "--top-k", 3, "--depth", 2,
                     "--total-tokens", 6)
    agg = out["aggregate"]
    assert agg["prompts"] == 2 and agg["lossless"] is True
    assert agg["tree"] == {"top_k": 3, "depth": 2, "total_tokens": 6}
    assert agg["weights"] == "float32"  # the artifact's weights, from its manifest
    assert len(agg["n_alpha"]) == 3
    assert out["prompts"][1]["prompt_tokens"] == 12
    r = cli("bench", tiny[2], "--prompts", p, "--max-new-tokens", 8, "--threads", 1)  # the readable table
    assert r.exit_code == 0, r.output
    for f in ("tau", "n-alpha", "speedup", "no-draft", "peak memory", "ru_maxrss", "lossless", "EOS ignored",
              "; weights float32; "):
        assert f in r.stdout


def test_bench_builtin_prompts(gqa):
    report = bench(gqa, max_new_tokens=8, threads=1)  # no tokenizer: built-in id prompts within the vocabulary
    assert len(report.rows) >= 2 and report.lossless
    d = report.to_dict()
    assert d["aggregate"]["prompts"] == len(d["prompts"])


class _FakeBackend:
    """A Backend (runtime/backend.py) that records calls; ``exec_s``: what it reports as last_exec_s."""

    name, device, host_memory, max_prefill, target_graph, tree_graph = "fake", "cpu", True, None, "target_verify", None
    tree_depths, fixed_tree_depth, accepts_in_graph, tree_selects = {}, False, False, {}
    open_s = 0.0

    def __init__(self, exec_s):
        self.last_exec_s = exec_s
        self.calls: list = []
        self.syncs = 0

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def run(self, graph, inputs, outputs):
        self.calls.append(graph)

    def check_tree(self, tree):
        self.calls.append(("check_tree", tree))

    def to_host(self, x):
        return x.numpy()

    def copy_from_host(self, dst, src):
        dst.copy_(torch.from_numpy(src).reshape(dst.shape))

    def synchronize(self):
        self.syncs += 1


def test_timing_proxy_forwards_and_times():
    inner = _FakeBackend(0.25)  # ONNX Runtime-like: reports its execution time
    proxy = TimingBackend(inner)
    assert isinstance(proxy, Backend) and (proxy.name, proxy.device, proxy.host_memory) == ("fake", "cpu", True)
    proxy.run(C.TARGET_GRAPH, {}, {})
    proxy.run(C.DRAFT_GRAPH, {}, {})
    proxy.run(C.DRAFT_GRAPH, {}, {})
    assert inner.calls == [C.TARGET_GRAPH, C.DRAFT_GRAPH, C.DRAFT_GRAPH]
    assert proxy.calls == {C.TARGET_GRAPH: 1, C.DRAFT_GRAPH: 2}
    assert proxy.seconds == {C.TARGET_GRAPH: 0.25, C.DRAFT_GRAPH: 0.5} and inner.syncs == 0
    proxy.check_tree("tree")
    assert inner.calls[-1] == ("check_tree", "tree")
    queued = _FakeBackend(None)  # TensorRT-like: work on a stream, timed around run + synchronize
    proxy = TimingBackend(queued)
    proxy.run(C.TARGET_GRAPH, {}, {})
    assert queued.syncs == 1 and 0 <= proxy.seconds[C.TARGET_GRAPH] < 0.25


def test_n_alpha():
    assert n_alpha([0, 1, 2, 3], 4) == [0.75, 2 / 3, 0.5, 0.0]
    assert n_alpha([0, 0], 3) == [0.0, None, None]


@pytest.mark.parametrize("line, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", '{"prompt": "text"} or {"prompt_ids"'),
    ('{"prompt": "a", "prompt_ids": [1]}', '{"prompt": "text"} or {"prompt_ids"'),
    ('{"prompt_ids": []}', "non-empty list of integers"),
    ('{"prompt_ids": [1, "2"]}', "non-empty list of integers"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt_ids": [1], "n": 2}', "unknown key(s) n"),
    ('{"prompt_ids": [1, 999]}', "token id 999 is outside the vocabulary [0, 48)"),
])
def test_bench_bad_prompts_line(gqa, tmp_path, line, fragment):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt_ids": P12}) + "\n\n" + line + "\n")
    fail("bench", gqa, "--prompts", p, "--max-new-tokens", 4, expect=(f"{p}:3", fragment))


def test_bench_bad_requests(gqa, tmp_path):
    p = tmp_path / "text.jsonl"
    p.write_text(json.dumps({"prompt": "hello"}) + "\n")
    fail("bench", gqa, "--prompts", p, expect=(f"{p}:1", "needs the artifact's tokenizer", "prompt_ids"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    fail("bench", gqa, "--prompts", empty, expect=("no prompts",))
    fail("bench", gqa, "--prompts", tmp_path / "missing.jsonl", expect=("cannot read the prompts file",))
    fail("bench", gqa, "--top-k", 99, "--max-new-tokens", 4, expect=("top_k",))


def test_bench_plot_without_matplotlib(gqa, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed, even where it is
    png = tmp_path / "na.png"
    fail("bench", gqa, "--max-new-tokens", 4, "--plot", png,
         expect=("--plot needs matplotlib", "pip install matplotlib"))
    assert not png.exists()


# ---- --concurrency -------------------------------------------------------------------------------


def test_bench_concurrency_json(models, ids_file, tmp_path):
    """bench --concurrency 1,2: both levels, EAGLE and batched no-draft side by side, lossless, the documented keys;
    the figures are sane (tokens = requests x max_new, latencies within the pass, N=2 ran 2 sequences a round)."""
    art = models("gqa", max_batch=2)[2]
    out = bench_json(art, "--prompts", ids_file, "--max-new-tokens", 12, "--concurrency", "1,2", "--requests", 4)
    agg = out["aggregate"]
    assert agg["concurrency"] == 2 and agg["requests"] == 4 and agg["lossless"] is True
    assert set(agg["throughput_tokens_per_s"]) == {"eagle", "no_draft", "tuned"}
    assert agg["throughput_tokens_per_s"]["tuned"] is None and agg["batch_trees"] is None  # no table: no tuned mode
    assert set(agg["latency_s"]) == {"p50", "p95"} and 0 < agg["latency_s"]["p50"] <= agg["latency_s"]["p95"]
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 2]
    for lv in out["levels"]:
        for mode in ("eagle", "no_draft"):
            m = lv[mode]
            assert m["tokens"] == 4 * 12 and m["throughput_tokens_per_s"] > 0
            assert m["latency_s"]["p95"] <= m["wall_s"] and 0 <= m["padding"] < 1
            assert m["draft_s"] + m["target_s"] <= m["wall_s"] and m["host_ms_per_token"] >= 0
        # tau from the figures it summarises: every sequence-round commits accepted + 1 tokens, and the rounds
        # committed each request's 11 tokens after its prefill's, its last round possibly cut at the length (whole
        # in tau). A tau without the bonus, or per batched round instead of per sequence, falls outside.
        e = lv["eagle"]
        committed, seq_rounds = e["tokens"] - 4, e["rounds"] * e["mean_active"]
        assert committed <= e["tau"] * seq_rounds + 1e-6 < committed + 4 * (3 + 2)
        assert lv["no_draft"]["tau"] == 1
    assert out["levels"][0]["eagle"]["mean_active"] == 1 and out["levels"][0]["eagle"]["padding"] == 0
    assert out["levels"][1]["eagle"]["mean_active"] > 1
    fail("bench", art, "--concurrency", 3, expect=("--concurrency 3 needs an artifact exported with --max-batch 3",))
    fail("bench", art, "--requests", 3, expect=("--requests goes with --concurrency",))


# ---- --stop-at-eos: the bigram pair, whose head is always accepted (4 drafts and a bonus a round) ---------------

EOS = 2


def _starts(cycle: list[int]) -> list[int]:
    """Start tokens whose output reaches the cycle's EOS in the middle of a round (outputs 3 and 7: the prefill's token,
    then rounds of 5), so a cut round shows in the counts."""
    at = cycle.index(EOS)
    return [(at - 1 - k) % len(cycle) for k in (3, 7)]


def test_bench_stop_at_eos_and_the_reference_tau(bigram, tmp_path):
    """--stop-at-eos ends each generation at its first EOS (our no-draft and EAGLE alike); without it every run makes
    the full length. tau is 5.0 exactly both ways: every round accepts 4 drafts and is counted whole, also the last
    one that EOS (or the length) cut, as the reference counts it. A tau from the committed tokens gives less."""
    _, art, cycle = bigram["eos"]
    starts = _starts(cycle)
    p = tmp_path / "starts.jsonl"
    p.write_text("".join(json.dumps({"prompt_ids": [cycle[s]]}) + "\n" for s in starts))
    stopped = bench_json(art, "--prompts", p, "--max-new-tokens", 40, "--stop-at-eos", "--no-guard")
    ignored = bench_json(art, "--prompts", p, "--max-new-tokens", 40, "--no-guard")
    assert stopped["aggregate"]["stop_on_eos"] is True and ignored["aggregate"]["stop_on_eos"] is False
    for k, row, full in zip((3, 7), stopped["prompts"], ignored["prompts"], strict=True):
        assert row["new_tokens"] == k + 1 and full["new_tokens"] == 40  # the EOS is the (k+1)-th token
        assert row["lossless"] and full["lossless"]
        assert row["accept_lengths"] == [4] * len(row["accept_lengths"]) and row["rounds"] == -(-k // 5)
        assert row["tau"] == full["tau"] == 5.0
    assert stopped["aggregate"]["tau"] == ignored["aggregate"]["tau"] == 5.0


# ---- the peer: pure parts ------------------------------------------------------------------------------------


def test_peer_choices():
    assert pog.choose_unused_id(8, {7, 5, 3}, {6}) == 4
    assert pog.choose_unused_id(4, set()) == 3
    with pytest.raises(pog.PeerError, match="every id of the vocabulary"):
        pog.choose_unused_id(2, {0, 1})
    assert pog.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert pog.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert pog.first_divergence([1, 2, 3], [1, 2]) == 2  # the peer stopped early
    assert pog.artifact_precision({}) == "fp32"
    assert pog.artifact_precision({"quantization": {"method": "int4", "bits": 4, "block_size": 32}}) == "int4"
    assert pog.artifact_precision({"quantization": {"method": "int8", "bits": 8}}) == "fp32"
    assert pog.choose_precision({"quantization": {"bits": 4}}, "fp32") == "fp32"  # --peer-precision wins
    with pytest.raises(pog.PeerError, match="--peer-precision must be one of fp32, int4"):
        pog.choose_precision({}, "int8")


def test_mode_order_rotates_every_mode_first():
    modes = ("eagle", "no_draft", "peer")
    firsts = [mode_order(i, r, modes)[0] for r in range(3) for i in range(3)]
    assert sorted(firsts) == sorted(modes * 3)
    assert mode_order(0, 0, modes[:2]) == ("eagle", "no_draft") and mode_order(1, 0, modes[:2])[0] == "no_draft"
    assert all(sorted(mode_order(i, 1, modes)) == sorted(modes) for i in range(4))


def _run(tokens, seconds, accepts=(0,)):
    return _Run(list(tokens), len(accepts), list(accepts), 0.0, seconds, seconds / 4, seconds / 2)


def test_row_takes_medians_over_repeats_and_compares_the_peer(tmp_path):
    """3 repeats: tokens/s are medians (not means, not the first repeat), the split is the median run's, the peer's
    tokens are compared with our no-draft tokens (first divergence), and one repeat whose tokens differ is lossy."""
    from eagle_export.prompts import PromptSpec

    toks = [5, 6, 7, 8]
    runs = {"eagle": [_run(toks, 1.0, (2, 1)), _run(toks, 4.0, (2, 1)), _run(toks, 2.0, (2, 1))],
            "no_draft": [_run(toks, 2.0), _run(toks, 8.0), _run(toks, 1.0)],
            "peer": [PeerRun([5, 6, 9, 8], 0.5), PeerRun([5, 6, 9, 8], 1.0), PeerRun([5, 6, 9, 8], 4.0)]}
    row = _row(PromptSpec("p", ids=(1, 2)), [1, 2], runs)
    assert row.eagle_tok_s == 2.0 and row.no_draft_tok_s == 2.0 and row.peer_tok_s == 4.0  # 4 tokens / 2, 2, 1 s
    assert row.speedup == 1.0 and row.decode_s == 2.0 and row.draft_s == 0.5 and row.target_s == 1.0
    assert row.host_s == 0.5 and row.tau == 2.5 and row.lossless
    assert (row.peer_equal, row.peer_divergence, row.peer_new_tokens) == (False, 2, 4)
    d = row.to_dict()
    assert d["eagle_vs_peer"] == pytest.approx(0.5) and d["no_draft_vs_peer"] == pytest.approx(0.5)
    assert median_run(runs["no_draft"]).decode_s == 2.0
    runs["no_draft"][1] = _run([5, 6, 7, 0], 8.0)
    assert not _row(PromptSpec("p", ids=(1, 2)), [1, 2], runs).lossless


def test_bench_peer_bad_requests(gqa, monkeypatch, tmp_path):
    fail("bench", gqa, "--peer-precision", "int4", expect=("--peer-precision go(es) with --peer",))
    fail("bench", gqa, "--peer", "ort-genai", "--concurrency", 1,
         expect=("--peer and --stop-at-eos are not available with --url or --concurrency",))
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # as if not installed, even where it is
    fail("bench", gqa, "--peer", "ort-genai", "--max-new-tokens", 4,
         expect=("--peer ort-genai needs onnxruntime-genai", "pip install 'eagle-export[peers]'"))
    monkeypatch.undo()
    with pytest.raises(pog.PeerError, match="--peer-target .* is not a Hugging Face model folder"):
        pog.resolve_target("/anything", tmp_path)
    with pytest.raises(pog.PeerError, match="the artifact's target source"):
        pog.resolve_target(str(tmp_path / "gone"), None)
    (tmp_path / "config.json").write_text("{}")  # a model folder without a tokenizer: its builder would fail deep
    with pytest.raises(pog.PeerError, match="has no tokenizer .*copy its tokenizer files there"):
        pog.resolve_target(None, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert pog.resolve_target(None, tmp_path) == tmp_path.resolve()


# ---- the peer itself (only where onnxruntime-genai is installed: the `peers` extra, part of `test`) -----------


def test_bench_peer_ort_genai_on_the_bigram(bigram, tmp_path):
    """ORT GenAI fp32, built from the artifact's target by its own builder, makes exactly our no-draft tokens: with
    EOS ignored (it is given an id nobody generates, and runs the full length through the cycle's EOS) and with
    --stop-at-eos (it stops where we stop). The second bench reuses the built model from the cache."""
    pytest.importorskip("onnxruntime_genai")
    _, art, cycle = bigram["eos"]
    p = tmp_path / "starts.jsonl"
    p.write_text("".join(json.dumps({"prompt_ids": [cycle[s]]}) + "\n" for s in _starts(cycle)))
    cache = tmp_path / "peers"
    common = ("--prompts", p, "--peer", "ort-genai", "--peer-cache", cache, "--repeats", 2)
    out = bench_json(art, *common, "--max-new-tokens", 24)
    peer = out["aggregate"]["peer"]
    assert (peer["name"], peer["precision"], peer["equal"], peer["equal_prompts"]) == ("ort-genai", "fp32", True, 2)
    assert peer["build_s"] > 0 and [d.name for d in cache.iterdir()] == [Path(peer["model_dir"]).name]
    assert peer["eos_token_ids"] != [EOS] and peer["eos_token_ids"][0] not in cycle
    assert out["aggregate"]["repeats"] == 2
    for r in out["prompts"]:
        assert r["peer_new_tokens"] == r["new_tokens"] == 24 and r["peer_equal"] is True
        assert r["peer_first_divergence"] is None
        assert r["eagle_vs_peer"] == pytest.approx(r["eagle_tok_s"] / r["peer_tok_s"])
        assert r["no_draft_vs_peer"] == pytest.approx(r["no_draft_tok_s"] / r["peer_tok_s"])
    assert peer["eagle_vs_peer"] == pytest.approx(statistics.median(r["eagle_vs_peer"] for r in out["prompts"]))
    assert out["aggregate"]["tokens_per_s"]["peer"] == peer["tokens_per_s"] > 0

    stopped = bench_json(art, *common, "--max-new-tokens", 24, "--stop-at-eos")
    peer = stopped["aggregate"]["peer"]
    assert peer["build_s"] is None and peer["eos_token_ids"] == [EOS] and peer["equal"] is True
    assert [r["peer_new_tokens"] for r in stopped["prompts"]] == [r["new_tokens"] for r in stopped["prompts"]] == [4, 8]

    # the table says when each side ran on its own default thread count (bench_json gives both --threads 1)
    for threads, says in (((), True), (("--threads", 1), False)):
        r = cli("bench", art, *common, "--max-new-tokens", 8, *threads)
        assert r.exit_code == 0, r.output
        assert ("threads: each decoder's own default" in r.stdout) is says

    # bench runs the peer in a process of its own (ChildPeer): another pid, its failures a PeerError naming the
    # child's error, the same tokens as in ours, and the process gone after close
    import os

    child = pog.ChildPeer(pog.OrtGenaiPeer(Path(peer["model_dir"]), "fp32", 1, None))
    try:
        assert child._proc.pid != os.getpid() and child._proc.poll() is None
        with pytest.raises(pog.PeerError, match="failed in its process: .*Error"):
            child.generate([cycle[0]], 4)  # no model opened yet
        child.set_eos([EOS])
        run = child.generate([cycle[0]], 24)
        inner = pog.OrtGenaiPeer(Path(peer["model_dir"]), "fp32", 1, None)
        inner.set_eos([EOS])
        assert run.tokens == inner.generate([cycle[0]], 24).tokens and run.seconds > 0
    finally:
        child.close()
    assert child._proc.poll() is not None


def test_runs_interleaved_with_a_peer_are_spaced_by_the_settle_pause(gqa):
    """With a peer, every run (ours and the peer's) is followed by an untimed pause of SETTLE_S before the next
    starts, so a thread the last run left spinning does not take a core from the next one's timing. The peer here
    is a stand-in with the contract bench relies on: generate(ids, max_new) -> PeerRun with exactly max_new
    tokens."""
    import time

    from eagle_export.tools.commands import bench as B
    from eagle_export.tree_params import TreeParams

    spans: list[tuple[float, float]] = []

    class Peer:
        name, eos = "stand-in", [47]

        def generate(self, ids, max_new):
            t0 = time.perf_counter()
            spans.append((t0, time.perf_counter()))
            return PeerRun([5] * max_new, 1e-3)

    with B.PairedSession(gqa, prompts=None, threads=1) as s:
        real = s.run

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spans.append((t0, time.perf_counter()))

        s.run = timed
        tree = TreeParams(top_k=2, depth=2, total_tokens=4)
        s.measure(tree, 4, peer=Peer())
        assert len(spans) == 3 * len(s.specs)
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
        assert min(gaps) >= B.SETTLE_S

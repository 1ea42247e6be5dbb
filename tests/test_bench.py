"""`eagle-export bench` / tools/commands/bench.py: EAGLE against --no-draft side by side, the JSON report's fields and
ranges, prompts files (text and ids lines, malformed lines named by number), the optional --plot."""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import torch
from cli_run import cli, fail

from eagle_export import contract as C
from eagle_export.runtime.backend import Backend
from eagle_export.tools.commands.bench import TimingBackend, bench, n_alpha
from eagle_export.tools.demo import FIXTURE

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
    out = bench_json(gqa, "--prompts", ids_file, "--max-new-tokens", 16)
    agg = out["aggregate"]
    assert {"tau", "speedup", "tokens_per_s", "n_alpha", "time_split", "peak_rss_mb", "lossless", "prompts",
            "max_new_tokens", "tree"} <= set(agg)
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


def test_bench_on_the_trained_fixture_reports_its_acceptance(trained, tmp_path):
    """Acceptance that only a trained head reaches: EAGLE-1/2 on 3 of the fixture's prompts, its tuned tree. A random
    head (or drafting from the wrong features) gives tau ~1.0; the card reports 4.05 on the whole prompt set."""
    p = tmp_path / "three.jsonl"
    p.write_text("".join((FIXTURE / "prompts.jsonl").read_text().splitlines(keepends=True)[:3]))
    out = bench_json(trained("eagle1"), "--prompts", p, "--max-new-tokens", 32)
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
    assert len(agg["n_alpha"]) == 3
    assert out["prompts"][1]["prompt_tokens"] == 12
    r = cli("bench", tiny[2], "--prompts", p, "--max-new-tokens", 8, "--threads", 1)  # the readable table
    assert r.exit_code == 0, r.output
    for f in ("tau", "n-alpha", "speedup", "no-draft", "peak memory", "ru_maxrss", "lossless", "EOS ignored"):
        assert f in r.stdout


def test_bench_builtin_prompts(gqa):
    report = bench(gqa, max_new_tokens=8, threads=1)  # no tokenizer: built-in id prompts within the vocabulary
    assert len(report.rows) >= 2 and report.lossless
    d = report.to_dict()
    assert d["aggregate"]["prompts"] == len(d["prompts"])


class _FakeBackend:
    """A Backend (runtime/backend.py) that records calls; ``exec_s``: what it reports as last_exec_s."""

    name, device, host_memory, max_prefill = "fake", "cpu", True, None

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
    assert set(agg["throughput_tokens_per_s"]) == {"eagle", "no_draft"}
    assert set(agg["latency_s"]) == {"p50", "p95"} and 0 < agg["latency_s"]["p50"] <= agg["latency_s"]["p95"]
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 2]
    for lv in out["levels"]:
        for mode in ("eagle", "no_draft"):
            m = lv[mode]
            assert m["tokens"] == 4 * 12 and m["throughput_tokens_per_s"] > 0
            assert m["latency_s"]["p95"] <= m["wall_s"] and 0 <= m["padding"] < 1
            assert m["draft_s"] + m["target_s"] <= m["wall_s"] and m["host_ms_per_token"] >= 0
        assert lv["eagle"]["tau"] >= 1 and lv["no_draft"]["tau"] == 1
    assert out["levels"][0]["eagle"]["mean_active"] == 1 and out["levels"][0]["eagle"]["padding"] == 0
    assert out["levels"][1]["eagle"]["mean_active"] > 1
    fail("bench", art, "--concurrency", 3, expect=("--concurrency 3 needs an artifact exported with --max-batch 3",))
    fail("bench", art, "--requests", 3, expect=("--requests goes with --concurrency",))

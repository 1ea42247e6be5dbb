"""What does `export --draft-vocab N` save per draft level at the Llama-3.2-1B shape? Measured on ONNX Runtime CPU.

    .venv/bin/python tools/lab/draft_vocab_bench.py [--hidden 2048] [--vocab 128256] [--keep 32768]
        [--rows 1,4] [--past 256] [--threads 2] [--reps 15] [--workdir /tmp] [--quantize int4|int8]

An EAGLE-1/2 draft level is the head's one decoder layer plus the target's lm_head and a top-k over its vocabulary;
at the 1B shape the lm_head (128256 x 2048) is most of the level's weights. The draft graph does not depend on the
target's layers, so instead of exporting a whole 1B target (5 GB of fp32 weights for one graph we do not time),
this builds the head the exporter builds (``Eagle1Head``: Llama 3.2 1B geometry, 32 heads, 8 KV heads, MLP 8192,
random weights, the target's lm_head a random ``[V, H]`` Linear) and traces ``DraftStep`` with the exporter's own
``_export_graph`` and contract spec twice: as is, and after ``prune_vocab`` to ``--keep`` rows (the first ids: which
rows does not change the cost). Both are the graphs `export` writes for such a head (lean path: weights streamed into
the data file). Then one tree level (``--rows`` fed-back rows over ``--past`` cached rows, the runtime's call) is
timed on both sessions, interleaved call by call, after two warm-up calls each; best and median per graph.
``--quantize`` quantizes both graphs' MatMuls as `export --quantize` (or `--quantize-draft-only`) does the draft's
(block 32, symmetric, accuracy level 4; the lm_head included). ``--profile`` also runs each graph under ONNX
Runtime's profiler and splits its kernel time into the lm_head's MatMul and the rest (the head's layer, fc,
attention, top-k): the rest is what pruning cannot shrink.

Timings are for reading, never for pass/fail: run it where you deploy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from eagle_export import contract as C
from eagle_export.export.checkpoint.formats import EAGLE1, HeadOptions
from eagle_export.export.exporter import _export_graph
from eagle_export.export.graphs.heads import DraftStep, Eagle1Head, prune_vocab

TOP_K = 10  # the draft graph's top-k width: export's default --max-top-k


def make_head(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> Eagle1Head:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=vocab, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=8192)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    # The step graph takes its embedding rows as an input: the table is not in the graph, a 1-row stand-in will do.
    head = Eagle1Head(cfg, HeadOptions(EAGLE1, fc_bias=True), nn.Embedding(1, hidden), nn.Linear(hidden, vocab,
                                                                                                  bias=False))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.02)
    return head.eval()


def export_step(head: Eagle1Head, path: Path) -> None:
    """The draft step graph of ``head`` as `export` traces it (lean path: weights from memory, streamed)."""
    cfg = head.layers[0].self_attn.config
    hd, kv = cfg.hidden_size // cfg.num_attention_heads, cfg.num_key_value_heads
    spec = C.draft_step_spec(kv_heads=kv, head_dim=hd, hidden_size=cfg.hidden_size, feature_dim=cfg.hidden_size,
                             top_k=TOP_K, dtype="float32")
    b, t, p = 2, 3, 5
    args = (torch.zeros(b, t, cfg.hidden_size), torch.zeros(b, t - 1, cfg.hidden_size),
            torch.zeros(b, 1, cfg.hidden_size), torch.arange(p, p + t).repeat(b, 1),
            torch.ones(b, t, p + t, dtype=torch.bool), torch.zeros(b, p, kv, hd), torch.zeros(b, p, kv, hd))
    with torch.no_grad():
        _export_graph(DraftStep(head, TOP_K).eval(), args, spec, path, lean={})


def level_feeds(hidden: int, kv: int, hd: int, rows: int, past: int) -> dict[str, np.ndarray]:
    """One tree level: ``rows`` fed-back rows over ``past`` cached rows (each row sees the cache and itself)."""
    rng = np.random.default_rng(0)
    mask = np.zeros((1, rows, past + rows), bool)
    mask[0, :, :past] = True
    mask[0, np.arange(rows), past + np.arange(rows)] = True
    f32 = np.float32
    return {C.INPUT_EMBEDS: rng.standard_normal((1, rows, hidden)).astype(f32) * 0.02,
            C.DRAFT_FEATURES: np.zeros((1, 0, hidden), f32),
            C.HIDDEN_IN: rng.standard_normal((1, rows, hidden)).astype(f32),
            C.POSITION_IDS: np.full((1, rows), past, np.int64), C.ATTENTION_MASK: mask,
            C.past_key(0): rng.standard_normal((1, past, kv, hd)).astype(f32),
            C.past_value(0): rng.standard_normal((1, past, kv, hd)).astype(f32)}


def quantize_step(directory: Path, bits: int) -> None:
    """The step graph in ``directory`` quantized in place by the export's own pass (the draft alone)."""
    from eagle_export.export.quantization.artifact import QuantizeOptions, quantize_artifact_graphs

    quantize_artifact_graphs(directory, QuantizeOptions(bits=bits, lm_head=False, target=False), [C.DRAFT_GRAPH])


def session(path: Path, threads: int, profile: str | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")  # a quantized graph's, as exported
    if profile is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def kernel_split(path: Path, threads: int, feeds: dict, reps: int, prefix: Path) -> tuple[float, float]:
    """Mean kernel ms per call of the lm_head's MatMul and of every other node, from ONNX Runtime's profiler."""
    s = session(path, threads, str(prefix))
    for _ in range(2 + reps):
        s.run(None, feeds)
    events = json.loads(Path(s.end_profiling()).read_text())
    lm = rest = 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            if "lm_head" in e["name"]:
                lm += e["dur"]
            else:
                rest += e["dur"]
    calls = 2 + reps
    return lm / calls / 1e3, rest / calls / 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--keep", type=int, default=32768)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="split each graph's kernel time: lm_head and the rest")
    ap.add_argument("--quantize", choices=["none", "int4", "int8"], default="none",
                    help="quantize both draft graphs as the export does (the lm_head included)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.workdir, prefix="draft-vocab-bench-") as tmp:
        full, cut = Path(tmp) / "full" / "draft_step.onnx", Path(tmp) / "cut" / "draft_step.onnx"
        full.parent.mkdir()
        cut.parent.mkdir()
        head = make_head(a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab)
        t0 = time.perf_counter()
        export_step(head, full)
        prune_vocab(head, torch.arange(a.keep))
        export_step(head, cut)
        del head
        if a.quantize != "none":
            for d in (full.parent, cut.parent):
                quantize_step(d, int(a.quantize[3:]))
        print(f"exported both step graphs in {time.perf_counter() - t0:.0f} s: data "
              f"{(full.parent / 'draft_step.onnx.data').stat().st_size / 2**20:.0f} MiB (full) vs "
              f"{(cut.parent / 'draft_step.onnx.data').stat().st_size / 2**20:.0f} MiB (--draft-vocab {a.keep})")
        sessions = {"full": session(full, a.threads), "cut": session(cut, a.threads)}
        hd = a.hidden // a.heads
        print(f"ONNX Runtime {ort.__version__} CPU, {a.threads} threads, past {a.past} rows; ms per draft level")
        print(f"{'rows':>5} {'full best':>10} {'full med':>9} {'cut best':>9} {'cut med':>8} {'cut/full':>9}")
        for rows in (int(r) for r in a.rows.split(",")):
            feeds = level_feeds(a.hidden, a.kv_heads, hd, rows, a.past)
            times: dict[str, list[float]] = {k: [] for k in sessions}
            for s in sessions.values():
                for _ in range(2):
                    s.run(None, feeds)
            for _ in range(a.reps):
                for k, s in sessions.items():
                    t = time.perf_counter()
                    s.run(None, feeds)
                    times[k].append((time.perf_counter() - t) * 1e3)
            fb, fm = min(times["full"]), statistics.median(times["full"])
            cb, cm = min(times["cut"]), statistics.median(times["cut"])
            print(f"{rows:>5} {fb:>10.2f} {fm:>9.2f} {cb:>9.2f} {cm:>8.2f} {cm / fm:>9.2f}")
            if a.profile:
                split = {k: kernel_split(p, a.threads, feeds, a.reps, Path(tmp) / k)
                         for k, p in (("full", full), ("cut", cut))}
                (fl, fr), (cl, cr) = split["full"], split["cut"]
                print(f"      kernel ms per call: full {fl + fr:.2f} (lm_head {fl:.2f}, rest {fr:.2f}), cut "
                      f"{cl + cr:.2f} (lm_head {cl:.2f}, rest {cr:.2f}): cut/full {(cl + cr) / (fl + fr):.2f}")


if __name__ == "__main__":
    main()

"""Our target graph's call at each verify width beside onnxruntime-genai's model of the same checkpoint.

    python tools/lab/width_vs_peer.py ARTIFACT --peer-dir DIR [--widths 1,4,8,13,32] [--past 256,1024]
        [--rounds 5] [--reps 3] [--threads 2]

DIR is the model onnxruntime-genai's builder made of the artifact's target (``bench --peer`` keeps one under
``ARTIFACT/peers``). Each decoder runs alone in a fresh process per round, the two alternating (a process's other
thread pools slow a session: tools/lab/step_vs_peer.py): ours is the target graph the runtime opens (the fused one
where the artifact has one) with the runtime's session options, the peer's is its ``model.onnx`` in a plain
ONNX Runtime session with as many intra-op threads; both on preallocated caches of --past rows written in place
(the peer's past and present share one buffer, as onnxruntime-genai runs it), a causal call of W new tokens,
logits for every row (a verify reads them all). Per (past, width): the median of --reps calls after a warm one,
then the median over the rounds. A width-1 call is a plain decoding step. A program that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _run_in_place(s, b, caches: dict, present: str, past: str | None):
    """Bind every output of session ``s`` on binding ``b``: an output named ``present...`` to the cache buffer of its
    ``past...`` input (written in place; ``past`` None: none are), the rest to fresh host memory. Returns the call."""
    import onnxruntime as ort

    for o in s.get_outputs():
        if past is not None and o.name.startswith(present):
            own = caches[o.name.replace(present, past, 1)]
            b.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(own))
        else:
            b.bind_output(o.name, "cpu")
    return lambda: s.run_with_iobinding(b)


def _ours(artifact: Path, threads: int):
    from eagle_export import contract as C
    from eagle_export.manifest import load_manifest
    from eagle_export.runtime.ort_backend import DEFAULT_SPIN, OrtGraph, parse_spin, runtime_session_config

    m = load_manifest(artifact)
    name = C.graph_for("ort", "target", m.graphs)
    g = OrtGraph(artifact / m.graphs[name].file, ["CPUExecutionProvider"], threads, parse_spin(DEFAULT_SPIN)["target"],
                 runtime_session_config(m, name))
    s = g.session
    cap = m.max_seq_len
    caches = {i.name: np.zeros([1 if isinstance(d, str) else d for d in i.shape[:2]] + [cap, i.shape[3]], np.float32)
              for i in s.get_inputs() if i.name.startswith("past_")}
    fused = name == C.TARGET_FUSED_GRAPH

    def call(past: int, w: int):

        b = s.io_binding()
        mask = np.zeros((1, w, past + w), np.bool_)
        mask[0, :, :past] = True
        mask[0, :, past:] = np.tri(w, dtype=np.bool_)
        feeds = {C.INPUT_IDS: np.full((1, w), 5, np.int64), C.POSITION_IDS: np.arange(past, past + w)[None],
                 C.ATTENTION_MASK: mask, C.LOGIT_INDICES: np.arange(w)[None]}
        for k, v in feeds.items():
            b.bind_cpu_input(k, v)
        for k, v in caches.items():
            b.bind_cpu_input(k, v if fused else v[:, :, :past])
        return _run_in_place(s, b, caches, "present_", "past_" if fused else None)

    return call


def _peer(peer_dir: Path, threads: int):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    s = ort.InferenceSession(str(peer_dir / "model.onnx"), o, providers=["CPUExecutionProvider"])
    cap = 2048
    dec = json.loads((peer_dir / "genai_config.json").read_text())["model"]["decoder"]
    caches = {i.name: np.zeros([1, dec["num_key_value_heads"], cap, dec["head_size"]], np.float32)
              for i in s.get_inputs() if i.name.startswith("past_key_values")}

    def call(past: int, w: int):
        b = s.io_binding()
        b.bind_cpu_input("input_ids", np.full((1, w), 5, np.int64))
        b.bind_cpu_input("attention_mask", np.ones((1, past + w), np.int64))
        for k, v in caches.items():
            b.bind_cpu_input(k, v)
        return _run_in_place(s, b, caches, "present", "past_key_values")

    return call


def _child(a) -> None:
    make = _peer(a.peer_dir, a.threads) if a.one == "peer" else _ours(a.artifact, a.threads)
    got = {}
    for past in a.past:
        for w in a.widths:
            run = make(past, w)
            run()
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            got[f"{past}/{w}"] = statistics.median(times) * 1e3
    print(json.dumps(got))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--peer-dir", type=Path, required=True)
    ap.add_argument("--widths", default="1,4,8,13,32")
    ap.add_argument("--past", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.widths = [int(x) for x in str(a.widths).split(",")]
    a.past = [int(x) for x in str(a.past).split(",")]
    if a.one:
        _child(a)
        return 0
    runs: dict[str, list[dict]] = {"ours": [], "peer": []}
    for r in range(a.rounds):
        for who in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
            cmd = [sys.executable, __file__, str(a.artifact), "--peer-dir", str(a.peer_dir), "--widths",
                   ",".join(map(str, a.widths)), "--past", ",".join(map(str, a.past)), "--reps", str(a.reps),
                   "--threads", str(a.threads), "--one", who]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[who].append(json.loads(out))
            print(f"round {r + 1}/{a.rounds}: {who} done", file=sys.stderr, flush=True)
    print(f"{a.artifact} against {a.peer_dir}: ms per call, medians of {a.rounds} rounds (each the median of "
          f"{a.reps} calls), {a.threads} threads, each decoder alone in its process")
    print("| cached rows | new tokens | ours ms | peer ms | ours / peer | ours x our 1-token | peer x its 1-token |")
    print("|---|---|---|---|---|---|---|")
    for past in a.past:
        one = {who: statistics.median(x[f"{past}/1"] for x in runs[who]) for who in runs} if 1 in a.widths else None
        for w in a.widths:
            med = {who: statistics.median(x[f"{past}/{w}"] for x in runs[who]) for who in runs}
            rel = (f"{med['ours'] / one['ours']:.2f}x | {med['peer'] / one['peer']:.2f}x" if one else "| ")
            print(f"| {past} | {w} | {med['ours']:.1f} | {med['peer']:.1f} | {med['ours'] / med['peer']:.2f}x "
                  f"| {rel} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

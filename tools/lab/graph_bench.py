"""`python tools/lab/graph_bench.py ARTIFACT`: one target call's time per graph variant.

Times the artifact's target graphs (the standard one, and the fused one ONNX Runtime runs) on ONNX Runtime CPU for
a call of N new tokens over P cached rows, with IO binding over preallocated buffers as the runtime binds them, the
variants interleaved so a noisy machine affects them alike; prints the median of the repeats in milliseconds. The
figures of docs/bench.md ("Per call") come from it. A program that prints figures, not a test.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort

from eagle_export import contract as C
from eagle_export.dtypes import DTYPES
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.runtime.ort_backend import quantized_session_config


def session(path: Path, threads: int, spin: bool, config: dict[str, str] | None = None) -> ort.InferenceSession:
    """config: session config entries (a quantized artifact's, as the runtime sets them)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def target_call(directory: Path, graph: str, threads: int, spin: bool, past: int, new: int,
                clock=time.perf_counter):
    """A callable running one target call of ``new`` tokens over ``past`` cached rows (bound once)."""
    m = load_manifest(directory)
    s = session(directory / m.graphs[graph].file, threads, spin, quantized_session_config(m))
    return bind_target_call(s, m, graph, past, new, clock)


def bind_target_call(s: ort.InferenceSession, m: Manifest, graph: str, past: int, new: int,
                     clock=time.perf_counter):
    """``target_call`` on a session already open (the runtime's own, say): the standard graph gets ``past`` cached
    rows and its own present outputs; the fused graph one capacity-long buffer per cache, bound as both its past and
    its present (written in place), as the runtime binds it."""
    entry, t = m.graphs[graph], m.target
    dt = DTYPES[m.dtype].numpy
    b = s.io_binding()
    keep = []

    def bind_in(name, arr):
        keep.append(arr)
        b.bind_cpu_input(name, arr)

    rng = np.random.default_rng(0)
    bind_in(C.INPUT_IDS, rng.integers(0, t.vocab_size, (1, new), dtype=np.int64))
    bind_in(C.POSITION_IDS, np.arange(past, past + new, dtype=np.int64)[None])
    mask = np.ones((1, new, past + new), dtype=np.bool_)
    mask[0, :, past:] = np.tri(new, dtype=np.bool_)
    bind_in(C.ATTENTION_MASK, mask)
    bind_in(C.LOGIT_INDICES, np.arange(new, dtype=np.int64)[None])
    logits = np.zeros((1, new, t.vocab_size), np.float32)
    feats = np.zeros((1, new, t.feature_dim), dt)
    keep += [logits, feats]
    b.bind_output(C.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
    b.bind_output(C.FEATURES, "cpu", 0, dt, list(feats.shape), feats.ctypes.data)
    fused = graph == C.TARGET_FUSED_GRAPH
    for i in range(t.num_layers):
        names = ((C.past_key(i), C.present_key(i)), (C.past_value(i), C.present_value(i)))
        for past_name, present_name in names:
            if fused:
                buf = rng.standard_normal((1, t.kv_heads, entry.axes[C.CAPACITY][1], t.head_dim)).astype(dt)
                keep.append(buf)
                b.bind_cpu_input(past_name, buf)
                b.bind_output(present_name, "cpu", 0, dt, list(buf.shape), buf.ctypes.data)
            else:
                bind_in(past_name, rng.standard_normal((1, past, t.kv_heads, t.head_dim)).astype(dt))
                out = np.zeros((1, new, t.kv_heads, t.head_dim), dt)
                keep.append(out)
                b.bind_output(present_name, "cpu", 0, dt, list(out.shape), out.ctypes.data)

    def call() -> float:
        t0 = clock()
        s.run_with_iobinding(b)
        return clock() - t0

    call._keep = keep  # the bound buffers live as long as the callable
    return call


def peer_call(model_dir: Path, threads: int, spin: bool, past: int, new: int):
    """The same call on an onnxruntime-genai model folder (its builder's ``model.onnx``) as ORT GenAI runs it on
    the CPU: past and present one buffer of the context length, an attention mask over past + new, logits for
    every new row."""
    import json

    cfg = json.loads((model_dir / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    s = session(model_dir / dec["filename"], threads, spin)
    b = s.io_binding()
    rng = np.random.default_rng(0)
    keep = [rng.integers(0, cfg["vocab_size"], (1, new), dtype=np.int64), np.ones((1, past + new), np.int64)]
    b.bind_cpu_input("input_ids", keep[0])
    b.bind_cpu_input("attention_mask", keep[1])
    logits = np.zeros((1, new, cfg["vocab_size"]), np.float32)
    keep.append(logits)
    b.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
    shape = (1, dec["num_key_value_heads"], cfg["context_length"], dec["head_size"])
    for i in range(dec["num_hidden_layers"]):
        for kind in ("key", "value"):
            buf = rng.standard_normal(shape).astype(np.float32)
            keep.append(buf)
            b.bind_cpu_input(f"past_key_values.{i}.{kind}", buf)
            b.bind_output(f"present.{i}.{kind}", "cpu", 0, np.float32, list(shape), buf.ctypes.data)

    def call() -> float:
        t0 = time.perf_counter()
        s.run_with_iobinding(b)
        return time.perf_counter() - t0

    call._keep = keep
    return call


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--past", default=300, show_default=True, help="Cached rows before the call.")
@click.option("--new", "news", default="1,4,8,12,16,32", show_default=True, help="New tokens per call (list).")
@click.option("--threads", default=2, show_default=True)
@click.option("--spin/--no-spin", default=True, show_default=True, help="ONNX Runtime's intra-op thread spinning.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved rounds; each times --calls calls.")
@click.option("--calls", default=50, show_default=True)
@click.option("--clock", type=click.Choice(sorted(CLOCKS)), default="wall", show_default=True,
              help="cpu: the process's CPU time per call (with --no-spin), which a loaded machine's preemptions do not "
                   "inflate; equal to wall time for a kernel that runs on one thread.")
@click.option("--peer", "peers", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An onnxruntime-genai model folder of the same target (bench --peer builds them under "
                   "ARTIFACT/peers): timed the same way beside ours. Repeatable.")
def main(artifact: Path, past: int, news: str, threads: int, spin: bool, repeats: int, calls: int, clock: str,
         peers: tuple[Path, ...]) -> None:
    m = load_manifest(artifact)
    graphs = [g for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH) if g in m.graphs]
    sizes = [int(x) for x in news.split(",")]
    callers = {(g, n): target_call(artifact, g, threads, spin, past, n, CLOCKS[clock]) for g in graphs for n in sizes}
    for p in peers:
        graphs.append(p.name)
        callers.update({(p.name, n): peer_call(p, threads, spin, past, n) for n in sizes})
    times: dict[tuple, list[float]] = {k: [] for k in callers}
    for c in callers.values():
        for _ in range(3):
            c()
    for _ in range(repeats):
        for k, c in callers.items():
            times[k].append(statistics.median(c() for _ in range(calls)))
    print(f"{artifact}: target call, {past} cached rows, {threads} threads, spin {'on' if spin else 'off'}, "
          f"{clock} clock, median ms of {repeats} interleaved rounds x {calls} calls")
    width = max(22, *(len(g) + 1 for g in graphs))
    print(f"{'new tokens':>10} " + " ".join(f"{g:>{width}}" for g in graphs))
    for n in sizes:
        print(f"{n:>10} " + " ".join(f"{statistics.median(times[g, n]) * 1e3:>{width}.3f}" for g in graphs))


if __name__ == "__main__":
    main()

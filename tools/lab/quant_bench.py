"""Measure ONNX Runtime's CPU MatMulNBits (weight-only int4/int8) against a float MatMul, per row count.

    python tools/lab/quant_bench.py [--threads 2] [--rows 1,4,8,13,16,32] [--repeats 5]

Why: a 13-token EAGLE verify should cost no more than 2x a 1-token step on the quantized target (issue 22), and
which kernel MatMulNBits takes depends on bits, block size and accuracy_level (0/1: float A, dequantized weights;
4: A quantized to int8 per block, integer dot products). This program times each setting on Llama-3.2-1B's
projection shapes (K=2048 -> N=2048 (q, o), 512 (k, v), 8192 (gate, up); K=8192 -> N=2048 (down)) at each row
count M, one single-node graph per shape and setting (built with export/quantization/matmuls.py), with
``intra_op_num_threads``
threads. Every repeat visits every (shape, M, setting) once, in turn (interleaved); a visit times single calls for
``--budget-ms`` and keeps their minimum (``--per-visit median`` for their median), and the figures are medians of
those over repeats. The minimum is the default because on a shared machine a call that lost its cores (two spinning
intra-op threads, one of them descheduled) costs tens of milliseconds more, and that is the machine, not the kernel.

It prints one table per shape, then a 1B decoder layer's MatMul time (2 q/o + 2 k/v + 2 gate/up + 1 down) per M with
the ratio to M=1: the verify/step ratio the MatMuls alone give. Timings are for reading, not pass/fail: run it
where you deploy (the machine may be shared).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import click
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eagle_export.export.quantization.matmuls import quantize_matmuls

LLAMA_1B_SHAPES = ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048))
# (K, N) -> how many of that projection one Llama-3.2-1B decoder layer has (q+o, k+v, gate+up, down).
LAYER_COUNTS = {(2048, 2048): 2, (2048, 512): 2, (2048, 8192): 2, (8192, 2048): 1}


@dataclass(frozen=True)
class Setting:
    bits: int | None  # None: the float MatMul
    block_size: int = 0
    accuracy_level: int = 0

    @property
    def label(self) -> str:
        return "float" if self.bits is None else f"int{self.bits} b{self.block_size} a{self.accuracy_level}"


def _matmul_model(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    t = TensorProto.FLOAT if w.dtype == np.float32 else TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="proj/MatMul")], "proj",
        [helper.make_tensor_value_info("x", t, [1, "m", k])],
        [helper.make_tensor_value_info("y", t, [1, "m", n])],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _session(model: onnx.ModelProto, threads: int, spin: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _sessions(shape: tuple[int, int], settings: list[Setting], threads: int, seed: int,
              dtype: type, spin: bool) -> dict[Setting, object]:
    """One session per setting for one (K, N); each (bits, block size) is quantized once."""
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(dtype)
    out = {}
    quantized: dict[tuple[int, int], onnx.ModelProto] = {}
    for s in settings:
        if s.bits is None:
            out[s] = _session(_matmul_model(w), threads, spin)
            continue
        key = (s.bits, s.block_size)
        if key not in quantized:
            m = _matmul_model(w)
            quantize_matmuls(m, s.bits, s.block_size, symmetric=True, accuracy_level=0, form="nbits", predicate=None)
            quantized[key] = m
        m = onnx.ModelProto()
        m.CopyFrom(quantized[key])
        for a in m.graph.node[0].attribute:
            if a.name == "accuracy_level":
                a.i = s.accuracy_level
        out[s] = _session(m, threads, spin)
    return out


def _time_call(sess, x: np.ndarray, budget_s: float, stat, clock) -> float:
    """Seconds per call: ``stat`` (min or median) of calls timed one by one with ``clock`` for about budget_s of
    wall time (at least 3 calls), after a warm-up call."""
    feed = {"x": x}
    sess.run(None, feed)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = clock()
        sess.run(None, feed)
        times.append(clock() - t0)
    return stat(times)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from e


@click.command()
@click.option("--threads", default=2, show_default=True, help="ONNX Runtime intra-op threads.")
@click.option("--rows", default="1,4,8,13,16,32", show_default=True, callback=lambda c, p, v: _ints(v),
              help="Row counts M (tokens per call).")
@click.option("--bits", "bits_list", default="4,8", show_default=True, callback=lambda c, p, v: _ints(v))
@click.option("--block-sizes", default="32,64,128", show_default=True, callback=lambda c, p, v: _ints(v))
@click.option("--levels", default="0,1,4", show_default=True, callback=lambda c, p, v: _ints(v),
              help="MatMulNBits accuracy_level values.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved repeats; figures are their medians.")
@click.option("--budget-ms", default=30.0, show_default=True, help="Time spent per measurement.")
@click.option("--shapes", default="", help="K:N pairs, comma-separated (default: Llama-3.2-1B's four).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Activations, float weights and scales.")
@click.option("--per-visit", type=click.Choice(["min", "median"]), default="min", show_default=True,
              help="What a visit keeps of its calls: min (a preempted call only adds time, so on a shared machine the "
                   "fastest call is the kernel's cost) or median.")
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="wall: elapsed time, ONNX Runtime's threads spinning (its default). cpu: the process's CPU time per "
                   "call (all threads), spinning off so waiting threads burn none: on a loaded machine the work a "
                   "call does, which a preemption does not inflate.")
def main(threads: int, rows: tuple[int, ...], bits_list: tuple[int, ...], block_sizes: tuple[int, ...],
         levels: tuple[int, ...], repeats: int, budget_ms: float, shapes: str, dtype: str, per_visit: str,
         clock: str) -> None:
    """Time MatMulNBits settings against a float MatMul on ONNX Runtime CPU (medians of interleaved repeats)."""
    import onnxruntime as ort

    shape_list = (tuple(tuple(int(v) for v in p.split(":")) for p in shapes.split(",")) if shapes
                  else LLAMA_1B_SHAPES)
    settings = [Setting(None)] + [Setting(b, bs, a) for b, bs, a in itertools.product(bits_list, block_sizes, levels)]
    np_dtype = np.float32 if dtype == "fp32" else np.float16
    stat = min if per_visit == "min" else statistics.median
    click.echo(f"onnxruntime {ort.__version__}, {dtype}, {threads} intra-op threads, {clock} clock, "
               f"{repeats} interleaved repeats, "
               f"{budget_ms:.0f} ms per visit ({per_visit} of its calls); "
               f"building {len(settings) * len(shape_list)} sessions ...")
    spin = clock == "wall"
    clock_fn = time.perf_counter if clock == "wall" else time.process_time
    sessions = {shape: _sessions(shape, settings, threads, i, np_dtype, spin) for i, shape in enumerate(shape_list)}
    inputs = {(shape, m): np.random.default_rng(m).standard_normal((1, m, shape[0])).astype(np_dtype)
              for shape in shape_list for m in rows}
    samples: dict[tuple, list[float]] = {}
    for r in range(repeats):
        t0 = time.perf_counter()
        for shape, m, s in itertools.product(shape_list, rows, settings):
            samples.setdefault((shape, m, s), []).append(
                _time_call(sessions[shape][s], inputs[(shape, m)], budget_ms / 1000, stat, clock_fn))
        click.echo(f"repeat {r + 1}/{repeats} in {time.perf_counter() - t0:.0f} s")
    med = {key: statistics.median(v) * 1000 for key, v in samples.items()}

    width = max(len(s.label) for s in settings)
    head = f"{'setting':<{width}} " + " ".join(f"{'M=' + str(m):>8}" for m in rows)
    for shape in shape_list:
        click.echo(f"\nK={shape[0]} N={shape[1]}: {clock} ms per call (median over repeats of each visit's "
                   f"{per_visit})")
        click.echo(head)
        for s in settings:
            click.echo(f"{s.label:<{width}} " + " ".join(f"{med[(shape, m, s)]:8.3f}" for m in rows))

    if set(shape_list) == set(LAYER_COUNTS) and 1 in rows:
        click.echo(f"\n1B decoder layer, MatMuls only (2 q/o + 2 k/v + 2 gate/up + 1 down): {clock} ms, ratio to M=1, "
                   "speed-up over the float MatMul at M=1 and M=13")
        click.echo(head + f" {'13/1':>6} {'16/1':>6} {'x@1':>6} {'x@13':>6}")
        layer = {(m, s): sum(c * med[(shape, m, s)] for shape, c in LAYER_COUNTS.items())
                 for m in rows for s in settings}
        base = settings[0]
        for s in settings:
            ratios = " ".join(f"{layer[(m, s)] / layer[(1, s)]:6.2f}" if m in rows else f"{'-':>6}" for m in (13, 16))
            click.echo(f"{s.label:<{width}} " + " ".join(f"{layer[(m, s)]:8.3f}" for m in rows)
                       + f" {ratios} {layer[(1, base)] / layer[(1, s)]:6.2f}"
                       + (f" {layer[(13, base)] / layer[(13, s)]:6.2f}" if 13 in rows else f" {'-':>6}"))


if __name__ == "__main__":
    main()

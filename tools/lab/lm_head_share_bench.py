"""Should the EAGLE-1/2 draft graph share the target's lm_head or carry its own copy? Measured on ONNX Runtime CPU.

    python tools/lab/lm_head_share_bench.py [--hidden 2048] [--vocab 128256] [--dtype fp32]
        [--rows 1,4,16] [--reps 10] [--workdir /tmp]

An EAGLE-1/2 draft step ends with the target's lm_head and a top-k over the whole vocabulary. This program builds
that tail alone as two tiny ONNX graphs of one shape, ``logits = MatMul(hidden [1, n, H], W [H, V])`` then
``TopK(k=8)`` over the last axis (with a Cast to float first for fp16, as the draft graph's ``.float()``):

- **copy**: ``W`` is an initializer in an external data file, at a 64 KiB-aligned offset as the exporter writes it,
  so ONNX Runtime maps it and may pre-pack it for its MatMul kernel;
- **share**: ``W`` is a graph input, bound (IO binding, by address: no copy) to a read-only ``np.memmap`` of that
  same data file, as a runtime sharing the target's tensor would bind it.

Each runs in its own child process, so resident memory is attributable: ``VmRSS`` split into anonymous (heap:
cannot be reclaimed) and file-backed (mapped pages of the data file: page cache, reclaimable), read from
``/proc/self/status`` after the imports, after creating the session (and, for share, binding the mapping) and after
the calls, plus the peak (``VmHWM``). The calls are timed side by side: for each row count the parent asks the two
children in turn for one call, ``--reps`` times, after two warm-up calls each, and reports the best of each. Both
must give the same top-k ids (same weights), which is checked.

The data file (the size of ``W``) is written under ``--workdir`` and deleted at the end. Timings are for reading,
never for pass/fail (the machine may be shared): run it where you deploy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

TOP_K = 8  # the draft graph's top-k (the default tree's widest branching is below it)
OPSET = 17  # eagle_export.export.exporter.OPSET (not imported: it pulls in torch, which the children must not load)
DTYPES = {"fp32": np.float32, "fp16": np.float16}
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
KINDS = ("copy", "share")
W_NAME, HIDDEN, VALUES, IDS = "lm_head_t", "hidden", "values", "ids"


def memory_status() -> dict[str, int]:
    """This process's resident memory in bytes (``/proc/self/status``: psutil may not be installed)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(rest.split()[0]) * 1024
    return out


@dataclass(frozen=True)
class Shape:
    hidden: int
    vocab: int
    dtype: str

    @property
    def np_dtype(self) -> type:
        return DTYPES[self.dtype]

    @property
    def w_bytes(self) -> int:
        return self.hidden * self.vocab * np.dtype(self.np_dtype).itemsize


def write_data_file(path: Path, shape: Shape, offset: int, seed: int = 0) -> None:
    """``offset`` bytes of zeros (the tensors before it in a real data file), then W [H, V], written in slabs of
    rows so the parent never holds it whole."""
    rng = np.random.default_rng(seed)
    slab = max(1, (64 << 20) // (shape.vocab * 4))
    with open(path, "wb") as f:
        f.write(b"\0" * offset)
        for r in range(0, shape.hidden, slab):
            rows = min(slab, shape.hidden - r)
            x = rng.standard_normal((rows, shape.vocab), dtype=np.float32) * 0.02
            f.write(x.astype(shape.np_dtype).tobytes())


def build_graphs(workdir: Path, data_name: str, shape: Shape, offset: int) -> dict[str, Path]:
    """The copy and share graphs (see the module docstring), saved beside the data file."""
    import onnx
    from onnx import TensorProto, helper

    elem = TensorProto.FLOAT if shape.dtype == "fp32" else TensorProto.FLOAT16
    hidden = helper.make_tensor_value_info(HIDDEN, elem, [1, "rows", shape.hidden])
    outputs = [helper.make_tensor_value_info(VALUES, TensorProto.FLOAT, [1, "rows", TOP_K]),
               helper.make_tensor_value_info(IDS, TensorProto.INT64, [1, "rows", TOP_K])]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [TOP_K])
    nodes = [helper.make_node("MatMul", [HIDDEN, W_NAME], ["logits"])]
    logits = "logits"
    if shape.dtype != "fp32":
        nodes.append(helper.make_node("Cast", ["logits"], ["logits_f"], to=TensorProto.FLOAT))
        logits = "logits_f"
    nodes.append(helper.make_node("TopK", [logits, "k"], [VALUES, IDS], axis=-1, largest=1, sorted=1))

    w = TensorProto(name=W_NAME, data_type=elem, dims=[shape.hidden, shape.vocab])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(shape.w_bytes))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    w_input = helper.make_tensor_value_info(W_NAME, elem, [shape.hidden, shape.vocab])
    graphs = {"copy": helper.make_graph(nodes, "lm_head_copy", [hidden], outputs, initializer=[k, w]),
              "share": helper.make_graph(nodes, "lm_head_share", [hidden, w_input], outputs, initializer=[k])}
    paths = {}
    for kind, graph in graphs.items():
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        paths[kind] = workdir / f"{kind}.onnx"
        onnx.save(model, str(paths[kind]))  # the initializer stays external: data_location is already set
    return paths


def _bind(binding, name: str, arr: np.ndarray, output: bool = False) -> None:
    """Bind a host array by address (ONNX Runtime reads or writes it in place)."""
    args = (name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    (binding.bind_output if output else binding.bind_input)(*args)


def child(kind: str, model: str, data: str, offset: int, shape: Shape, threads: int, conn) -> None:
    """One session of ``kind``: report memory at each stage, then run one call per request until told to stop."""
    mem = {"imports": memory_status()}
    opts = ort.SessionOptions()  # as runtime/ort_backend.py sets them
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    t0 = time.perf_counter()
    session = ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    w = None
    if kind == "share":
        w = np.memmap(data, dtype=shape.np_dtype, mode="r", offset=offset, shape=(shape.hidden, shape.vocab))
        _bind(binding, W_NAME, w)
    create_s = time.perf_counter() - t0
    mem["created"] = memory_status()
    conn.send(("ready", create_s, mem))
    rng = np.random.default_rng(1)
    bound_rows = None
    ids_first: dict[int, np.ndarray] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        if msg[0] == "memory":
            conn.send(memory_status())
            continue
        rows = msg[1]
        if rows != bound_rows:
            # Fresh host arrays per row count, the same values in both children (same seed sequence).
            h = (rng.standard_normal((1, rows, shape.hidden), dtype=np.float32)).astype(shape.np_dtype)
            vals = np.empty((1, rows, TOP_K), np.float32)
            ids = np.empty((1, rows, TOP_K), np.int64)
            _bind(binding, HIDDEN, h)
            _bind(binding, VALUES, vals, output=True)
            _bind(binding, IDS, ids, output=True)
            bound_rows = rows
        t = time.perf_counter()
        session.run_with_iobinding(binding)
        dt = time.perf_counter() - t
        if rows not in ids_first:
            ids_first[rows] = ids.copy()
            conn.send((dt, ids_first[rows]))
        else:
            conn.send((dt, None))
    del session, binding, w
    conn.close()


@dataclass
class Row:
    rows: int
    best_ms: dict[str, float]
    same_ids: bool


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


@dataclass
class Measurement:
    shape: Shape
    threads: int
    rows: list[Row]
    create_s: dict[str, float]  # per kind
    memory: dict[str, dict[str, dict[str, int]]]  # per kind, per stage (imports, created, after calls)


def measure(shape: Shape, rows: list[int], reps: int, workdir: Path, threads: int = 0) -> Measurement:
    """Write the data file and both graphs into a fresh directory under ``workdir``, time and measure both
    sessions (see the module docstring), and remove the directory again, whatever happens."""
    from eagle_export.export.data.datafile import ALIGN_LARGE  # the exporter's alignment for large tensors

    offset = ALIGN_LARGE  # W is not the first tensor in a real data file; any ALIGN_LARGE multiple is the same
    tmp = Path(tempfile.mkdtemp(prefix="lm_head_share_", dir=workdir))
    procs = []
    try:
        data = tmp / "weights.data"
        t = time.perf_counter()
        print(f"writing W [{shape.hidden}, {shape.vocab}] {shape.dtype} ({_gib(shape.w_bytes)} GiB) to {data} ...",
              file=sys.stderr, flush=True)
        write_data_file(data, shape, offset)
        print(f"  written in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        paths = build_graphs(tmp, data.name, shape, offset)
        ctx = mp.get_context("spawn")  # a fresh interpreter: only numpy and onnxruntime loaded, no torch
        conns, memory, create_s = {}, {}, {}
        for kind in KINDS:  # created one after the other, so neither's creation competes with the other's
            parent, child_end = ctx.Pipe()
            p = ctx.Process(target=child, args=(kind, str(paths[kind]), str(data), offset, shape, threads, child_end))
            p.start()
            procs.append(p)
            msg = parent.recv()
            conns[kind], create_s[kind], memory[kind] = parent, msg[1], msg[2]
            print(f"  {kind}: session created in {create_s[kind]:.2f} s", file=sys.stderr, flush=True)
        results = []
        for n in rows:
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            ids: dict[str, np.ndarray] = {}
            for i in range(reps + 2):
                for kind in KINDS:
                    conns[kind].send(("run", n))
                    dt, first = conns[kind].recv()
                    if first is not None:
                        ids[kind] = first
                    if i >= 2:
                        times[kind].append(dt)
            results.append(Row(n, {k: min(v) * 1e3 for k, v in times.items()},
                               bool(np.array_equal(ids["copy"], ids["share"]))))
            print(f"  rows {n}: done", file=sys.stderr, flush=True)
        for kind in KINDS:
            conns[kind].send(("memory",))
            memory[kind]["after calls"] = conns[kind].recv()
            conns[kind].send(("quit",))
        return Measurement(shape, threads, results, create_s, memory)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def report(m: Measurement) -> str:
    """The two tables (markdown), with a heading line."""
    shape = m.shape
    lines = [f"lm_head [{shape.hidden}, {shape.vocab}] {shape.dtype}: W = {_gib(shape.w_bytes)} GiB; "
             f"onnxruntime {ort.__version__}, {m.threads or 'default'} threads; best of the timed calls",
             "| rows | copy ms/call | share ms/call | share / copy | same top-k ids |", "|---|---|---|---|---|"]
    for r in m.rows:
        c, s = r.best_ms["copy"], r.best_ms["share"]
        lines.append(f"| {r.rows} | {c:.2f} | {s:.2f} | {s / c:.2f} | {'yes' if r.same_ids else 'NO'} |")
    lines += ["", "| graph | session create s | RSS GiB (anon + file): after imports | after create | after calls "
              "| peak RSS GiB |", "|---|---|---|---|---|---|"]
    for kind in KINDS:
        mem = m.memory[kind]
        cells = " | ".join(f"{_gib(x['VmRSS'])} ({_gib(x['RssAnon'])} + {_gib(x['RssFile'])})"
                           for x in (mem["imports"], mem["created"], mem["after calls"]))
        lines.append(f"| {kind} | {m.create_s[kind]:.2f} | {cells} | {_gib(mem['after calls']['VmHWM'])} |")
    return "\n".join(lines)


def _rows(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows takes comma-separated positive integers, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows takes comma-separated positive integers, got {text!r}")
    return rows


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/lab/lm_head_share_bench.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=_at_least(1), default=2048, help="H (default 2048: Llama-3.2-1B)")
    p.add_argument("--vocab", type=_at_least(1), default=128256, help="V (default 128256: Llama 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rows", type=_rows, default=[1, 4, 16], help="rows per call, comma-separated (default 1,4,16)")
    p.add_argument("--reps", type=_at_least(1), default=10, help="timed calls per graph and row count (default 10)")
    p.add_argument("--threads", type=_at_least(0), default=0, help="intra-op threads (default: ONNX Runtime's choice)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the data file is written (deleted at the end)")
    args = p.parse_args(argv)
    if not args.workdir.is_dir():
        p.error(f"--workdir {args.workdir} is not a directory")
    m = measure(Shape(args.hidden, args.vocab, args.dtype), args.rows, args.reps, args.workdir, args.threads)
    print(report(m))
    if not all(r.same_ids for r in m.rows):  # same weights, same inputs: a binding is wrong, the figures mean nothing
        print("error: the copy and share graphs disagree on the top-k ids", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

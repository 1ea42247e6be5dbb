"""`python tools/lab/tree_call_bench.py ARTIFACT[@TOP_K/DEPTH] ...`: one draft tree call's time, artifacts side by side.

Times the draft tree graph of each artifact on ONNX Runtime CPU for one round's call: ``--context`` accepted rows over
``--past`` cached rows, then the tree grown in the same call. A current artifact's graph for TOP_K is cut to DEPTH as
the runtime cuts it (runtime/tree_graph.py); an artifact of contract 5 (one ``draft_tree`` graph, its tree fixed at
export) runs as it is. The sessions are interleaved, ``--calls`` calls per turn, so a noisy machine affects them
alike; prints the medians of wall and process CPU time and each one's ratio to the first. Sessions pre-pack their
weights (the runtime shares a float chain's weights unpacked instead: docs/runtime.md, "Draft weights in memory").
The figures of docs/bench.md ("A quantized draft on a float target") come from it. A program that prints figures,
not a test.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np
import onnx
import onnxruntime as ort

from eagle_export import contract as C
from eagle_export.dtypes import DTYPES
from eagle_export.runtime.tree_graph import cut


def parse(spec: str) -> tuple[Path, int | None, int | None]:
    """``ARTIFACT[@TOP_K/DEPTH]`` -> (directory, top_k, depth)."""
    path, _, tree = spec.partition("@")
    if not tree:
        return Path(path), None, None
    try:
        k, d = (int(x) for x in tree.split("/"))
    except ValueError:
        raise click.BadParameter(f"{spec!r}: the tree is TOP_K/DEPTH, e.g. {path}@1/6") from None
    return Path(path), k, d


def tree_model(directory: Path, raw: dict, top_k: int | None, depth: int | None) -> tuple[onnx.ModelProto, dict]:
    """The graph a round with this tree runs (cut to ``depth``), and its manifest spec."""
    # The raw manifest, not load_manifest and C.tree_graphs: the runtime refuses a contract-5 manifest, which this
    # program also times.
    graphs = raw["graphs"]
    per_k = {e["axes"][C.TREE_TOP_K][0]: (n, e["axes"][C.TREE_DEPTH][1]) for n, e in graphs.items()
             if n.startswith(f"{C.DRAFT_TREE_GRAPH}_k") and C.parse_tree_call(n) is None}
    if per_k:
        if top_k is None or top_k not in per_k:
            raise click.BadParameter(f"{directory}: name a tree, ARTIFACT@TOP_K/DEPTH, with TOP_K one of "
                                     f"{sorted(per_k)}")
        name, most = per_k[top_k]
        model = onnx.load(str(directory / graphs[name]["file"]), load_external_data=False)
        return cut(model, top_k, depth or most, most), graphs[name]["spec"]
    if C.DRAFT_TREE_GRAPH not in graphs:
        raise click.BadParameter(f"{directory} has no draft tree graph")
    entry = graphs[C.DRAFT_TREE_GRAPH]  # contract 5: the export's tree, fixed
    return onnx.load(str(directory / entry["file"]), load_external_data=False), entry["spec"]


def feeds(spec: dict, dtype: np.dtype, context: int, past: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One round's inputs: ``context`` rows after ``past`` cached ones, causal, the last row's tree grown."""
    axes = {"batch": 1, "new_tokens": context, "past_len": past, "total_len": past + context}
    out = {}
    for t in spec["inputs"]:
        shape = [axes[d] if isinstance(d, str) else d for d in t["shape"]]
        name = t["name"]
        if name == "position_ids":
            out[name] = np.arange(past, past + context, dtype=np.int64)[None]
        elif name == "attention_mask":
            out[name] = np.tril(np.ones((context, past + context), bool), past)[None]
        elif name == "last_row":
            out[name] = np.array([context - 1], np.int64)
        else:
            out[name] = (rng.standard_normal(shape) * 0.3).astype(dtype)
    return out


@click.command()
@click.argument("specs", nargs=-1, required=True)
@click.option("--context", default=3, show_default=True, help="Accepted rows the call's context pass takes.")
@click.option("--past", default=300, show_default=True, help="Cached rows before the call.")
@click.option("--threads", default=2, show_default=True)
@click.option("--spin/--no-spin", default=False, show_default=True, help="ONNX Runtime's intra-op thread spinning.")
@click.option("--repeats", default=9, show_default=True, help="Interleaved turns; each times --calls calls.")
@click.option("--calls", default=100, show_default=True)
def main(specs: tuple[str, ...], context: int, past: int, threads: int, spin: bool, repeats: int, calls: int) -> None:
    runs = {}
    rng = np.random.default_rng(0)
    for spec in specs:
        directory, top_k, depth = parse(spec)
        raw = json.loads((directory / "manifest.json").read_text())
        model, gspec = tree_model(directory, raw, top_k, depth)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        q = raw.get("quantization")
        if q:
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(q["accuracy_level"]))
        tmp = directory / f".tree_call_bench_{time.monotonic_ns()}.onnx"  # beside its data files
        try:
            onnx.save_model(model, str(tmp))
            session = ort.InferenceSession(str(tmp), opts, providers=["CPUExecutionProvider"])
        finally:
            tmp.unlink(missing_ok=True)
        inputs = feeds(gspec, DTYPES[raw["dtype"]].numpy, context, past, rng)
        binding = session.io_binding()
        for name, value in inputs.items():
            binding.bind_cpu_input(name, value)
        for o in session.get_outputs():
            binding.bind_output(o.name, "cpu")
        for _ in range(20):  # warm-up
            session.run_with_iobinding(binding)
        runs[spec] = (session, binding, inputs, [], [])
    for _ in range(repeats):
        for session, binding, _inputs, wall, cpu in runs.values():
            w, c = time.perf_counter(), time.process_time()
            for _ in range(calls):
                session.run_with_iobinding(binding)
            wall.append(1e3 * (time.perf_counter() - w) / calls)
            cpu.append(1e3 * (time.process_time() - c) / calls)
    click.echo(f"one draft tree call: {context} context rows over {past} cached, {threads} threads, spin "
               f"{'on' if spin else 'off'}, medians of {repeats} interleaved turns of {calls} calls")
    base_w, base_c = (statistics.median(runs[specs[0]][i]) for i in (3, 4))
    for spec, (*_, wall, cpu) in runs.items():
        w, c = statistics.median(wall), statistics.median(cpu)
        click.echo(f"{spec:>48}  wall {w:7.3f} ms ({w / base_w:.2f}x)  cpu {c:7.3f} ms ({c / base_c:.2f}x)")


if __name__ == "__main__":
    main()

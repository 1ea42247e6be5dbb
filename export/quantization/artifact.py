"""`export --quantize int4|int8`: the artifact's graphs with weight-only block-quantized MatMul weights.

Runs on a finished (float) export directory before its manifest is written, and leaves the same files:

- the standard target graph (and the draft graph with ``draft``), which TensorRT builds (``C.ENGINE_GRAPHS``), in
  the ``qdq`` form (opset 21 ``DequantizeLinear -> MatMul``): TensorRT-RTX builds it when symmetric; ONNX Runtime
  fuses it into ``MatMulNBits`` at load, at the accuracy level the runtime sets from the manifest;
- the draft tree graph (ONNX Runtime only; with ``draft``) in the ``nbits`` form, its weights shared again with the
  step and target graphs' data files where they are the same bytes;
- the fused target graph (ONNX Runtime only) in the ``nbits`` form (``MatMulNBits`` written directly), its packed
  QKV weight quantized as one matrix (block-wise along K, so the same numbers as quantizing q, k, v apart), and
  its attention given two rows on a one-row call (export/graphs/fused.py ``pad_one_row_attention``: a plain decoding
  step then computes its row bit for bit as a verify does, which accuracy level 4's int8 activations need).

Streamed: each weight is read (plain file reads, no memory maps: export/data/datafile.py), quantized and appended to
its graph's new data file before the next one is read, so memory holds one float weight and its quantized form,
never a graph's worth (the fused graph's packed QKV is concatenated one layer at a time, when it is quantized). The
float tensors a graph keeps (the embedding, norms, an unquantized lm_head) still point where the float export put
them, at their new offsets in the data files this pass rewrites: the fused graph keeps sharing the standard graph's,
the draft tree graph the step and target graphs'. Every data file is replaced only when all graphs are written,
because the later graphs read their float weights from the earlier graphs' old data files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from eagle_export import contract as C
from eagle_export.export.data.datafile import DataWriter, Files, external, set_external
from eagle_export.export.graphs.fused import pad_one_row_attention
from eagle_export.export.quantization.matmuls import (
    ACCURACY_LEVELS,
    BITS,
    MatMulSite,
    QuantizeError,
    check_settings,
    quantize_matmuls,
)
from eagle_export.manifest import QuantizationInfo
from eagle_export.tree_params import TreeParams, candidate_count

INLINE_MAX = 1024  # initializers up to this many bytes stay inside the .onnx file, as the exporter leaves them
# Block 32, symmetric: what the peer's int4 builder uses, and what TensorRT-RTX builds. The accuracy level is
# chosen for verify widths (tools/lab/results.md, "Weight-only quantization: kernel choice").
DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class QuantizeOptions:
    """`export --quantize`'s settings: bits 4 or 8, block size along K, symmetric (no zero points), ONNX Runtime's
    accuracy level for MatMulNBits, whether the target's lm_head is quantized (``lm_head``, as onnxruntime-genai's
    int4 builder does: at the Llama-3.2-1B shape a float lm_head is 262M weights read every step, more bytes than
    the int4 decoder layers) and whether the draft graphs are (``draft``: their MatMuls and lm_head; by default, as a
    float draft level costs a third of an int4 step at the 1B shape and a quantized one a tenth, with the fixture's
    acceptance unchanged: docs/bench.md, "The speedup each size can reach")."""

    bits: int
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    draft: bool = True
    lm_head: bool = True
    # Keep a branching default tree at an accuracy level that rounds the activations (``exact_default_tree``).
    inexact_trees: bool = False
    target: bool = True

    def check(self) -> None:
        """One-line errors for settings neither MatMulNBits nor DequantizeLinear can take."""
        if self.bits not in BITS:
            raise QuantizeError(f"--quantize must be int4 or int8, got int{self.bits}")
        b = self.block_size
        if not (16 <= b <= 256 and b & (b - 1) == 0):
            raise QuantizeError(f"--quantize-block-size must be a power of 2 from 16 to 256, got {b}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantizeError(f"--quantize-accuracy-level must be one of {', '.join(map(str, ACCURACY_LEVELS))}, "
                                f"got {self.accuracy_level}")
        check_settings(self.bits, self.block_size, self.accuracy_level)  # the pass's own rules, the same
        if not (self.target or self.draft):
            raise QuantizeError("quantizing neither the target nor the draft: nothing to quantize")


def exact_default_tree(tree: TreeParams, options: QuantizeOptions | None) -> TreeParams:
    """The artifact's default tree: ``tree``, except on a quantized export at an accuracy level that rounds the
    activations (2 and up; 4 quantizes them to int8), where a branching tree (top_k > 1) becomes the chain of its
    depth (top_k 1, at most depth + 1 nodes) unless ``options.inexact_trees``.

    Why: a verify row attends to its ancestors' columns with the other branches' columns masked between them, and
    ONNX Runtime's attention sums a row's softmax by vector lane, so the same path verified in a branching tree and
    decoded token by token differs in its last bits; level 4 turns such bits into int8 rounding flips that grow from
    layer to layer, and EAGLE then differs from plain decoding at near-ties (tools/lab/results.md, "Why quantized EAGLE
    diverged"). A chain's accepted path sits in consecutive columns, as plain decoding's does, and is computed bit
    for bit alike (with the fused graph's one-row padding), so EAGLE stays exact by default; branching trees remain
    available per request and to `tune --inexact-trees`, which report the divergences they cause."""
    if (options is None or not options.target or options.inexact_trees or options.accuracy_level <= 1
            or tree.top_k == 1):  # see QuantizationInfo.rounds_activations
        return tree
    return TreeParams(1, tree.depth, min(tree.total_tokens, candidate_count(1, tree.depth)))


def defer_weight_concats(model: onnx.ModelProto) -> dict[str, tuple[int, list[TensorProto]]]:
    """Replace each ``Concat`` of 2-D float initializers (the fused graph's packed QKV) by an initializer standing
    for its result, so the packed MatMul's weight is an initializer the pass can quantize; drop the inputs no other
    node reads. The new initializer holds no data: returns, by its name, the Concat's axis and its parts, which
    ``_Graph.load`` concatenates when the weight is quantized (one at a time)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    deferred: dict[str, tuple[int, list[TensorProto]]] = {}
    keep = []
    for node in g.node:
        ws = [inits.get(x) for x in node.input]
        if (node.op_type != "Concat" or not ws or any(w is None or len(w.dims) != 2 for w in ws)
                or len({w.data_type for w in ws}) != 1):
            keep.append(node)
            continue
        axis = next(a.i for a in node.attribute if a.name == "axis")
        axis = axis % 2
        dims = list(ws[0].dims)
        dims[axis] = sum(int(w.dims[axis]) for w in ws)
        deferred[node.output[0]] = (axis, [_copy(w) for w in ws])
        t = TensorProto(name=node.output[0], data_type=ws[0].data_type, dims=dims)
        g.initializer.append(t)
        inits[t.name] = t
    del g.node[:]
    g.node.extend(keep)
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    kept = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
    return deferred


def _copy(t: TensorProto) -> TensorProto:
    out = TensorProto()
    out.CopyFrom(t)
    return out


def inline_identity_weights(model: onnx.ModelProto) -> int:
    """Let every node read an initializer itself where it reads it through an ``Identity`` (torch.onnx exports a
    weight used several times, as the draft tree graph's unrolled levels use the head's, once, and the other uses
    through Identity nodes), so each MatMul by a weight shows it as its weight; drop those Identity nodes. Returns
    how many."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    outputs = {o.name for o in g.output}
    alias = {n.output[0]: n.input[0] for n in g.node
             if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in outputs}
    if not alias:
        return 0
    keep = [n for n in g.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for n in keep:
        for i, x in enumerate(n.input):
            if x in alias:
                n.input[i] = alias[x]
    del g.node[:]
    g.node.extend(keep)
    return len(alias)


class _Graph:
    """One graph of the directory being rewritten: its model (no data loaded), and its new data file, written as the
    pass goes and renamed into place by ``publish``."""

    def __init__(self, directory: Path, name: str):
        self.path = directory / f"{name}.onnx"
        self.model = onnx.load(str(self.path), load_external_data=False)
        self.data_name = self.path.name + ".data"
        self.tmp = directory / (self.data_name + ".tmp")
        self.out = DataWriter(self.tmp)
        self.written: set[str] = set()  # initializers already in the new file
        self.moved: dict[int, int] = {}  # old offset -> new offset of what the old data file's tensors kept
        self.deferred: dict[str, tuple[int, list[TensorProto]]] = {}

    def load(self, files: Files, t: TensorProto) -> np.ndarray:
        """A float weight's values from the data files as they were before this pass (a packed one concatenated)."""
        if t.name in self.deferred:
            axis, parts = self.deferred[t.name]
            return np.concatenate([files.array(p) for p in parts], axis=axis)
        return files.array(t)

    def store(self, t: TensorProto) -> None:
        """Move a new initializer's bytes to the new data file."""
        self.out.store(t, self.data_name)
        self.written.add(t.name)

    def finish(self, files: Files, rewritten: dict[str, dict[int, int]]) -> None:
        """Place what the graph keeps: its own data file's tensors copied into the new one; a tensor of a data file
        an earlier graph rewrote, pointed at its new offset there (copied here when that graph dropped it);
        everything else (inline ones over INLINE_MAX moved out) left where it is."""
        copied: dict[tuple[str, int], int] = {}
        for t in self.model.graph.initializer:
            if t.name in self.written:
                continue
            if t.name in self.deferred:  # a packed weight left float: its bytes, made now
                values = self.load(files, t)
                t.raw_data = np.ascontiguousarray(values).tobytes()
                del values
                self.store(t)
                continue
            ext = external(t)
            if ext is None:
                if t.HasField("raw_data") and len(t.raw_data) > INLINE_MAX:
                    self.store(t)
                continue
            loc, off, n = ext["location"], int(ext.get("offset", 0)), int(ext["length"])
            if loc in rewritten and off in rewritten[loc]:
                set_external(t, loc, rewritten[loc][off], n)
            elif loc == self.data_name or loc in rewritten:
                # Bytes several initializers share (stored once by the export) are copied once.
                key = (loc, off)
                if key not in copied:
                    copied[key] = self.out.copy(files, loc, off, n)
                    if loc == self.data_name:
                        self.moved[off] = copied[key]
                set_external(t, self.data_name, copied[key], n)
        self.out.__exit__(None, None, None)

    def publish(self) -> None:
        """Rename the new data file into place (removed, with the old one, when the graph keeps nothing there) and
        save the graph."""
        old = self.tmp.with_name(self.data_name)
        if self.out.offset:
            os.replace(self.tmp, old)
        else:
            self.tmp.unlink()
            if old.exists():
                old.unlink()
        onnx.save_model(self.model, str(self.path))


def _repoint(path: Path, rewritten: dict[str, dict[int, int]]) -> None:
    """Point ``path``'s initializers that lie in a rewritten data file at their new offsets (saved only if any)."""
    model = onnx.load(str(path), load_external_data=False)
    changed = False
    for t in model.graph.initializer:
        ext = external(t)
        if ext is None or ext["location"] not in rewritten:
            continue
        off = int(ext.get("offset", 0))
        moved = rewritten[ext["location"]]
        if off not in moved:
            raise QuantizeError(f"{path.name}: {t.name} reads a weight of {ext['location']} that quantization dropped")
        set_external(t, ext["location"], moved[off], int(ext["length"]))
        changed = True
    if changed:
        onnx.save_model(model, str(path))


TARGETS = (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH)


def _not_lm_head(site: MatMulSite) -> bool:
    return "lm_head" not in site.node and "lm_head" not in site.weight


def quantize_artifact_graphs(directory: Path, options: QuantizeOptions, graphs: list[str]) -> QuantizationInfo:
    """Quantize, in place, the graphs of an export directory (``graphs``: the names written there) as the module
    docstring says; returns the manifest's record of it."""
    options.check()
    target_predicate = None if options.lm_head else _not_lm_head
    forms: dict[str, str] = {}
    counts: dict[str, int] = {}
    # Standard graphs first: the fused target graph and the draft tree graph point at what they keep of those.
    todo = [g for g in (C.TARGET_GRAPH,) if g in graphs and options.target] + ([C.DRAFT_GRAPH] if options.draft else [])
    todo += [g for g in graphs if (g == C.TARGET_FUSED_GRAPH and options.target) or C.is_tree_graph(g)]
    rewritten: dict[str, dict[int, int]] = {}  # data file -> old offset -> new offset, of the files rewritten so far
    one_row_scratch = False
    done: list[_Graph] = []
    with Files(directory) as files:  # the data files as the float export left them, until every graph is written
        try:
            for name in todo:
                g = _Graph(directory, name)
                done.append(g)
                form = "qdq" if name in C.ENGINE_GRAPHS else "nbits"
                tree = C.is_tree_graph(name)
                quantize = not tree or options.draft
                if quantize:
                    if name == C.TARGET_FUSED_GRAPH:
                        g.deferred = defer_weight_concats(g.model)
                    if tree:
                        inline_identity_weights(g.model)
                    report = quantize_matmuls(g.model, options.bits, options.block_size, options.symmetric,
                                              accuracy_level=options.accuracy_level, form=form,
                                              predicate=target_predicate if name in TARGETS else None,
                                              load=lambda t, g=g: g.load(files, t), store=g.store)
                    if not report.quantized and not tree:
                        raise QuantizeError(f"graph {name} has no MatMul by a weight initializer to quantize")
                    forms[name], counts[name] = form, len(report.quantized)
                    if name == C.TARGET_FUSED_GRAPH:  # a plain step's row computed as a verify computes it
                        one_row_scratch = pad_one_row_attention(g.model) > 0
                g.finish(files, rewritten)
                rewritten[g.data_name] = g.moved
        except BaseException:
            for g in done:
                g.out.__exit__(None, None, None)
                g.tmp.unlink(missing_ok=True)
            raise
    for g in done:
        g.publish()
    for name in set(graphs) - set(todo):  # a graph this pass left as it is, pointed at the rewritten files
        _repoint(directory / f"{name}.onnx", rewritten)
    for name in forms:
        onnx.checker.check_model(str(directory / f"{name}.onnx"))
    for name in graphs:
        if C.is_tree_graph(name) and name not in forms:
            onnx.checker.check_model(str(directory / f"{name}.onnx"))
    return QuantizationInfo(method=f"int{options.bits}", bits=options.bits, block_size=options.block_size,
                            symmetric=options.symmetric, accuracy_level=options.accuracy_level, draft=options.draft,
                            lm_head=options.lm_head, graphs=forms, matmuls=counts, one_row_scratch=one_row_scratch,
                            target=options.target)

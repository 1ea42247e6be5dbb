"""`export --quantize int4|int8`: the artifact's graphs with weight-only block-quantized MatMul weights.

Runs on a finished (float) export directory before its manifest is written, and leaves the same files:

- the standard target graph (and the draft graph with ``draft``), which TensorRT builds (``C.ENGINE_GRAPHS``), in
  the ``qdq`` form (opset 21 ``DequantizeLinear -> MatMul``): TensorRT-RTX builds it when symmetric; ONNX Runtime
  fuses it into ``MatMulNBits`` at load, at the accuracy level the runtime sets from the manifest;
- the draft tree graph (ONNX Runtime only; with ``draft``) in the ``nbits`` form, its weights shared again with the
  step and target graphs' data files where they are the same bytes;
- the fused target graph (ONNX Runtime only) in the ``nbits`` form (``MatMulNBits`` written directly), its packed
  QKV weight quantized as one matrix (block-wise along K, so the same numbers as quantizing q, k, v apart).

The new tensors go to the graphs' data files (rewritten, the replaced float weights dropped), and the fused graph
then shares what it holds byte for byte with the standard graph again (the embedding, norms, an unquantized lm_head).
Memory: one graph's quantized weights plus one float weight at a time.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from eagle_export import contract as C
from eagle_export.manifest import QuantizationInfo

from .quantize import ACCURACY_LEVELS, BITS, MatMulSite, QuantizeError, check_settings, quantize_matmuls
from .shared_data import share_weights
from .weights import ALIGN_LARGE, ALIGN_LARGE_FROM, ALIGN_SMALL

INLINE_MAX = 1024  # initializers up to this many bytes stay inside the .onnx file, as the exporter leaves them
# Block 32, symmetric: what the peer's int4 builder uses, and what TensorRT-RTX builds. The accuracy level is
# chosen for verify widths (docs/scale.md, "Weight-only quantization: kernel choice").
DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class QuantizeOptions:
    """`export --quantize`'s settings: bits 4 or 8, block size along K, symmetric (no zero points), ONNX Runtime's
    accuracy level for MatMulNBits, and whether the draft graph and the lm_heads are quantized too."""

    bits: int
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    draft: bool = False

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


def _external(t: TensorProto) -> dict[str, str] | None:
    if t.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in t.external_data}


def fold_weight_concats(model: onnx.ModelProto, base_dir: Path) -> int:
    """Replace each ``Concat`` of 2-D float initializers (the fused graph's packed QKV) by one initializer holding
    the result, so the packed MatMul's weight is an initializer the pass can quantize; drop the inputs no other
    node reads. Returns the Concats folded."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    folded, keep = 0, []
    for node in g.node:
        ws = [inits.get(x) for x in node.input]
        if (node.op_type != "Concat" or not ws or any(w is None or len(w.dims) != 2 for w in ws)
                or len({w.data_type for w in ws}) != 1):
            keep.append(node)
            continue
        axis = next(a.i for a in node.attribute if a.name == "axis")
        packed = np.concatenate([numpy_helper.to_array(w, str(base_dir)) for w in ws], axis=axis)
        t = numpy_helper.from_array(packed, node.output[0])
        g.initializer.append(t)
        inits[t.name] = t
        folded += 1
    del g.node[:]
    g.node.extend(keep)
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    kept = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
    return folded


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


def write_data(model: onnx.ModelProto, graph_path: Path) -> None:
    """Save ``model`` as ``graph_path`` with every initializer over INLINE_MAX bytes in ``<graph>.onnx.data``
    (rewritten: read from wherever it lies now, the file itself included, then renamed into place)."""
    directory = graph_path.parent
    data_name = graph_path.name + ".data"
    tmp = directory / (data_name + ".tmp")
    maps: dict[str, mmap.mmap] = {}
    files = []
    offset = 0
    try:
        with open(tmp, "wb") as out:
            for t in model.graph.initializer:
                ext = _external(t)
                if ext is not None:
                    loc = ext["location"]
                    if loc not in maps:
                        f = open(directory / loc, "rb")
                        files.append(f)
                        maps[loc] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    off, n = int(ext.get("offset", 0)), int(ext["length"])
                    data = maps[loc][off:off + n]
                elif t.HasField("raw_data") and len(t.raw_data) > INLINE_MAX:
                    data = t.raw_data
                else:
                    continue
                n = len(data)
                align = ALIGN_LARGE if n >= ALIGN_LARGE_FROM else ALIGN_SMALL
                pad = -offset % align
                out.write(b"\0" * pad)
                offset += pad
                out.write(data)
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                del t.external_data[:]
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(n))):
                    e = t.external_data.add()
                    e.key, e.value = k, v
                offset += n
    finally:
        for m in maps.values():
            m.close()
        for f in files:
            f.close()
    os.replace(tmp, directory / data_name)
    onnx.save_model(model, str(graph_path))


def _not_lm_head(site: MatMulSite) -> bool:
    return "lm_head" not in site.node and "lm_head" not in site.weight


def quantize_artifact_graphs(directory: Path, options: QuantizeOptions, graphs: list[str]) -> QuantizationInfo:
    """Quantize, in place, the graphs of an export directory (``graphs``: the names written there) as the module
    docstring says; returns the manifest's record of it."""
    options.check()
    predicate = None if options.draft else _not_lm_head
    forms: dict[str, str] = {}
    counts: dict[str, int] = {}
    tree = C.DRAFT_TREE_GRAPH in graphs
    if tree:  # it reads the step graph's and the target graph's data files: a copy of its own first
        path = directory / f"{C.DRAFT_TREE_GRAPH}.onnx"
        model = onnx.load(str(path), load_external_data=False)
        if options.draft:  # ONNX Runtime only: MatMulNBits written directly
            inline_identity_weights(model)
            report = quantize_matmuls(model, options.bits, options.block_size, options.symmetric,
                                      accuracy_level=options.accuracy_level, form="nbits", predicate=predicate,
                                      base_dir=directory)
            forms[C.DRAFT_TREE_GRAPH], counts[C.DRAFT_TREE_GRAPH] = "nbits", len(report.quantized)
        write_data(model, path)
        del model
    todo = [g for g in (C.TARGET_FUSED_GRAPH, C.TARGET_GRAPH) if g in graphs]
    if options.draft:
        todo.append(C.DRAFT_GRAPH)
    for name in todo:  # the fused graph first: it still reads float weights from the standard graph's data file
        path = directory / f"{name}.onnx"
        model = onnx.load(str(path), load_external_data=False)
        form = "nbits" if name == C.TARGET_FUSED_GRAPH else "qdq"
        if form == "nbits":
            fold_weight_concats(model, directory)
        report = quantize_matmuls(model, options.bits, options.block_size, options.symmetric,
                                  accuracy_level=options.accuracy_level, form=form, predicate=predicate,
                                  base_dir=directory)
        if not report.quantized:
            raise QuantizeError(f"graph {name} has no MatMul by a weight initializer to quantize")
        write_data(model, path)
        del model
        forms[name], counts[name] = form, len(report.quantized)
    if C.TARGET_FUSED_GRAPH in forms:
        share_weights(directory / f"{C.TARGET_FUSED_GRAPH}.onnx", directory / f"{C.TARGET_GRAPH}.onnx")
    if tree:  # stored once again: what it holds byte for byte like the step graph or the target graph
        path = directory / f"{C.DRAFT_TREE_GRAPH}.onnx"
        share_weights(path, directory / f"{C.DRAFT_GRAPH}.onnx")
        if (directory / f"{path.name}.data").exists():
            share_weights(path, directory / f"{C.TARGET_GRAPH}.onnx")
        onnx.checker.check_model(str(path))
    for name in forms:
        onnx.checker.check_model(str(directory / f"{name}.onnx"))
    return QuantizationInfo(method=f"int{options.bits}", bits=options.bits, block_size=options.block_size,
                            symmetric=options.symmetric, accuracy_level=options.accuracy_level, draft=options.draft,
                            lm_head=options.draft, graphs=forms, matmuls=counts)

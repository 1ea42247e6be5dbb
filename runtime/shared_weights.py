"""One host copy of the draft weights for the draft sessions that compute from them as stored: the chain tree graphs.

The draft step graph and the draft tree graphs (one per top_k, each cut to a round's depth) read the same draft head:
the export stores each weight once and points every graph's initializer at it (``export/data/shared_data.py``), but
an ONNX Runtime session loads its initializers for itself, and on the CPU its MatMul and Gemm kernels pre-pack each
constant weight into a private buffer, so every open draft session held a copy of the head. ONNX Runtime shares
initializers between sessions through ``SessionOptions.add_initializer`` (the caller owns the memory and keeps it
alive while the sessions live), but not their pre-packed forms: its ``PrepackedWeightsContainer`` is in the C API
only. Sharing therefore means computing from the weights as stored, with pre-packing off (``SHARED_CONFIG``), and
that pays only where a MatMul takes one row: there MLAS's one-row kernel reads the weight as it is and is no slower
(0.73x the pre-packed time for a 1024 x 32000 product), while at 2 to 64 rows it is 1.4-2.4x slower (docs/runtime.md,
"Draft weights in memory"). A chain's tree graph (top_k 1) runs its levels one row at a time; the step graph and the
wider trees do not, and keep their pre-packed copies.

``SharedWeights`` maps each data file once (read-only, the page cache's pages) and hands every sharing session the
same ``OrtValue`` per stored tensor, keyed by (file, offset, length, type, shape) whatever the graph names it. A
tree graph also computes some weights from stored ones (a lean export's reads ``fc`` through a ``Transpose``, the step
graph's layout being the other one, and makes q, k and v one matrix with ``Reshape``, ``Concat`` and ``Transpose``),
which ONNX Runtime would fold into new initializers in every session (and the folding's scratch stays in its
allocator): ``prepare`` computes each once for all sessions, and where the artifact stores exactly those bytes it is
that stored tensor.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

# The session config of a session that computes from shared weights: without it, each MatMul and Gemm pre-packs its
# own copy of the weight and the sharing saves nothing.
SHARED_CONFIG = {"session.disable_prepacking": "1"}

# Types shared: what a float draft graph's weights and tables are stored as (others are left to ONNX Runtime).
_NUMPY = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.INT64: np.int64}
_ONNX = {v: k for k, v in _NUMPY.items()}
_ONNX_BY_NAME = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(int64)": onnx.TensorProto.INT64}
# Nodes over stored tensors alone that ``SharedWeights.prepare`` computes once for every session.
_FOLD = ("Transpose", "Concat", "Reshape")

Key = tuple[str, int, int, int, tuple[int, ...]]  # (file, offset, length, ONNX type, shape)


class SharedWeights:
    """Read-only mappings of an artifact's data files, and one ``OrtValue`` per stored tensor over them."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._maps: dict[str, mmap.mmap | None] = {}
        self._values: dict[Key | tuple, ort.OrtValue] = {}
        self._stored: dict[tuple[int, tuple[int, ...]], list[Key]] = {}  # (type, shape) -> tensors known

    def index(self, model: onnx.ModelProto) -> None:
        """Know ``model``'s stored tensors, as candidates for a transposed weight another graph asks for."""
        for init in model.graph.initializer:
            key = _key(init)
            if key is not None and key not in self._stored.setdefault((key[3], key[4]), []):
                self._stored[key[3], key[4]].append(key)

    def prepare(self, model: onnx.ModelProto) -> tuple[dict[str, ort.OrtValue], bool]:
        """The shared values ``model``'s session takes (initializer name -> value), after taking out of ``model``
        (in place) what ONNX Runtime would fold per session (``_fold``). Returns them and whether ``model`` changed."""
        self.index(model)
        out = self._fold(model)
        changed = bool(out)
        for init in model.graph.initializer:
            key = None if init.name in out else _key(init)
            value = None if key is None else self._value(key)
            if value is not None:
                out[init.name] = value
        return out, changed

    def _fold(self, model: onnx.ModelProto) -> dict[str, ort.OrtValue]:
        """Replace the ``Transpose``/``Concat``/``Reshape`` nodes that compute from stored tensors alone (a tree
        graph's q, k and v as one matrix, a matrix in the other layout) by shared values, computed once for every
        session; in place. Returns the values by name (each a node output, now an initializer of the graph)."""
        g = model.graph
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
            return {}  # a subgraph may read a folded value: not looked into, left to ONNX Runtime
        inits = {t.name: t for t in g.initializer}
        outputs = {o.name for o in g.output}
        plan: dict[str, tuple] = {}  # folded output -> (key, node)
        sources: dict[str, tuple] = {}

        for node in g.node:  # a Constant node's small tensor is an inline constant too (the shapes Reshape takes)
            if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                inits.setdefault(node.output[0], node.attribute[0].t)

        def source(name: str):
            if name in plan:
                return plan[name][0]
            if name not in sources:
                t = inits.get(name)
                key = None if t is None else _key(t)
                if t is not None and key is None and t.data_location != onnx.TensorProto.EXTERNAL and \
                        int(np.prod(t.dims, dtype=np.int64)) <= 64:  # a small inline constant: a shape
                    arr = numpy_helper.to_array(t)
                    key = ("inline", arr.dtype.str, arr.shape, arr.tobytes())
                sources[name] = key
            return sources[name]

        for node in g.node:
            if node.op_type not in _FOLD or len(node.output) != 1 or node.output[0] in outputs:
                continue
            keys = [source(x) for x in node.input]
            if not keys or None in keys or all(k[0] == "inline" for k in keys):
                continue
            attrs = tuple((a.name, tuple(a.ints) if a.ints else a.i) for a in node.attribute)
            plan[node.output[0]] = (("fold", node.op_type, attrs, *keys), node)
        if not plan:
            return {}
        used = {x for node in g.node if not (node.output and node.output[0] in plan) for x in node.input} | outputs
        wanted = [name for name in plan if name in used]
        made: dict[str, ort.OrtValue] = {}
        for name in wanted:
            value = self._folded(plan[name][0])
            if value is None:
                return {}  # left to ONNX Runtime as it is
            made[name] = value
        holders = []
        for name in wanted:
            holder = self._placeholder(name, made[name])
            if holder is None:
                return {}
            holders.append(holder)
        keep = [node for node in g.node if not (node.output and node.output[0] in plan)]
        del g.node[:]
        g.node.extend(keep)
        needed = {x for node in keep for x in node.input} | outputs
        kept = [t for t in g.initializer if t.name in needed] + holders
        del g.initializer[:]
        g.initializer.extend(kept)
        vis = [v for v in g.value_info if v.name not in plan]
        del g.value_info[:]
        g.value_info.extend(vis)
        return made

    def _folded(self, key: tuple) -> ort.OrtValue | None:
        """The shared value of folded ``key``: a stored tensor with exactly its bytes, else one array for all."""
        if key in self._values:
            return self._values[key]
        arr = self._evaluate(key)
        if arr is None:
            return None
        value = None
        for other in self._stored.get((_ONNX.get(arr.dtype.type), arr.shape), []):
            cand = self._array(other)
            if cand is not None and np.array_equal(cand, arr):
                value = self._value(other)
                break
        if value is None:
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
        self._values[key] = value
        return value

    def _evaluate(self, key: tuple) -> np.ndarray | None:
        if key[0] == "inline":
            return np.frombuffer(key[3], dtype=np.dtype(key[1])).reshape(key[2])
        if key[0] != "fold":
            return self._array(key)
        _, op, attrs, *args = key
        ins = [self._evaluate(k) for k in args]
        if any(x is None for x in ins):
            return None
        attr = dict(attrs)
        if op == "Transpose":
            return np.transpose(ins[0], attr.get("perm") or None)
        if op == "Concat":
            return np.concatenate(ins, axis=attr["axis"])
        if op == "Reshape" and len(ins) == 2 and not attr.get("allowzero", 0):
            shape = [ins[0].shape[i] if int(d) == 0 else int(d) for i, d in enumerate(ins[1].tolist())]
            return ins[0].reshape(shape)
        return None

    def _placeholder(self, name: str, value: ort.OrtValue) -> onnx.TensorProto | None:
        """An initializer entry for a folded value, which the session replaces with the value: a stored range of
        its length (ONNX Runtime wants each initializer's data to be valid for its shape)."""
        shape = value.shape()
        elem = _ONNX_BY_NAME.get(value.data_type())
        if elem is None:
            return None
        nbytes = np.dtype(_NUMPY[elem]).itemsize * int(np.prod(shape, dtype=np.int64))
        for file, data in self._maps.items():
            if data is not None and len(data) >= nbytes:
                t = onnx.TensorProto()
                t.name, t.data_type, t.data_location = name, elem, onnx.TensorProto.EXTERNAL
                t.dims[:] = list(shape)
                for k, v in (("location", file), ("offset", "0"), ("length", str(nbytes))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
                return t
        return None

    def _value(self, key: Key) -> ort.OrtValue | None:
        value = self._values.get(key)
        if value is None:
            array = self._array(key)
            if array is None:
                return None
            value = self._values[key] = ort.OrtValue.ortvalue_from_numpy(array)  # no copy on the CPU
        return value

    def _array(self, key: Key) -> np.ndarray | None:
        """The stored tensor as a read-only array over the file's mapping (None: not a tensor this can map)."""
        file, offset, length, onnx_type, shape = key
        dtype = np.dtype(_NUMPY[onnx_type])
        if offset % dtype.itemsize or length != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            return None
        data = self._map(file)
        if data is None or offset + length > len(data):
            return None  # ONNX Runtime reports a short file itself, naming it
        return np.frombuffer(data, dtype=dtype, count=length // dtype.itemsize, offset=offset).reshape(shape)

    def _map(self, file: str) -> mmap.mmap | None:
        if file not in self._maps:
            path = self.directory / file
            self._maps[file] = None
            if Path(file).name == file and path.is_file() and path.stat().st_size > 0:
                with path.open("rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[file]


def _key(init: onnx.TensorProto) -> Key | None:
    if init.data_location != onnx.TensorProto.EXTERNAL or init.data_type not in _NUMPY:
        return None
    info = {e.key: e.value for e in init.external_data}
    if "location" not in info or "length" not in info:
        return None
    return info["location"], int(info.get("offset", 0)), int(info["length"]), init.data_type, tuple(init.dims)

"""Weight-only block quantization (int4 / int8) of an ONNX graph's MatMul weights.

Graph-agnostic: any ``MatMul(x, W)`` whose ``W`` is a 2-D float initializer (fp32 or fp16, inline or external data)
can be replaced, whichever exporter built the graph. Two forms of the same numbers:

- ``form="nbits"``: ONNX Runtime's ``com.microsoft.MatMulNBits`` (its CPU kernels: MLAS SQNBit GEMM).
- ``form="qdq"``: ``DequantizeLinear`` (opset 21, ``block_size`` attribute, axis 0) -> ``MatMul``, the standard-op
  form TensorRT builds for weight-only block quantization.

Quantization is block-wise along K (the reduction axis, rows of ``W``): each run of ``block_size`` rows of a column
shares one scale (and one zero point when asymmetric). ``W' = (q - zero_point) * scale``.

- symmetric: ``scale = max|w| / (2^(bits-1) - 1)``, signed codes in ``[-(2^(bits-1)-1), 2^(bits-1)-1]`` and no
  zero point (MatMulNBits stores ``q + 2^(bits-1)`` and uses its default zero point ``2^(bits-1)``).
- asymmetric: the block's range ``[min(w, 0), max(w, 0)]`` over ``2^bits - 1`` steps, unsigned codes, a rounded
  zero point.

Both keep ``|W - W'| <= scale / 2`` per element (the grid covers the block's range to within half a step).

MatMulNBits layout (ONNX Runtime's ContribOperators.md, checked by running ORT 1.31.1 in tests/test_quantize.py):
``B`` uint8 ``[N, n_blocks, block_size * bits / 8]``, codes of one column along K, low nibble first for 4 bits;
``scales`` ``[N, n_blocks]`` in A's dtype; ``zero_points`` uint8 ``[N, ceil(n_blocks * bits / 8)]``, packed like
``B`` (default ``2^(bits-1)`` when absent). K that is not a multiple of ``block_size`` is padded with zero rows.

Settings (measured in tools/lab/results.md, "Weight-only quantization: kernel choice"):

- ONNX Runtime CPU: ``form="nbits"``, bits 4, block 32, ``accuracy_level=4`` (the defaults). Level 4 is the only fast
  kernel (3.2-3.4x a float MatMul for one token at Llama-3.2-1B's shapes; levels 0/1 are slower than float); int8 is
  slower than int4 at every row count. A float16 graph works as well (MatMulNBits takes fp16 A natively).
- TensorRT: ``form="qdq"``, bits 4, ``symmetric=True`` (TensorRT-RTX 1.7 refuses UINT4/UINT8 weights with a zero
  point); it builds the whole target graph so (tests/test_quantize.py).

Level 4 quantizes each input row to int8, so a last-bit difference in that row (a kernel that computes one row
otherwise than several, an attention that sums a tree row's columns otherwise than a step's) can move the output
by a whole step: what makes quantized EAGLE token-exact anyway is in tools/lab/results.md ("Why quantized EAGLE
diverged"): export/graphs/fused.py ``pad_one_row_attention``, quantize_artifact.py ``exact_default_tree``, and the
runtime's ``runtime_session_config``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eagle_export.errors import EagleExportError

MS_DOMAIN = "com.microsoft"
QDQ_OPSET = 21  # DequantizeLinear with block_size and int4/uint4 (opset 21)
FORMS = ("nbits", "qdq")
BITS = (4, 8)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
CHUNK_ELEMENTS = 1 << 18  # weight elements quantized at a time (a float64 band of 2 MiB: stays in the CPU's cache)
FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


class QuantizeError(EagleExportError):
    """Bad quantization settings, or a graph the pass cannot quantize as asked."""


def check_settings(bits: int, block_size: int, accuracy_level: int = 0, form: str = "nbits") -> None:
    """One-line errors for settings MatMulNBits / DequantizeLinear cannot take."""
    if bits not in BITS:
        raise QuantizeError(f"bits must be one of {BITS}, got {bits}")
    if not (16 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        raise QuantizeError(f"block_size must be a power of 2 from 16 to 256, got {block_size}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise QuantizeError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")
    if form not in FORMS:
        raise QuantizeError(f"form must be one of {FORMS}, got {form!r}")


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight ``W [K, N]`` quantized block-wise along K, in MatMulNBits layout, with its dequantized float."""

    bits: int
    block_size: int
    symmetric: bool
    k: int
    n: int
    codes: np.ndarray  # uint8 [N, n_blocks * block_size]: unsigned codes (signed + 2^(bits-1) when symmetric)
    scales: np.ndarray  # [N, n_blocks], float32 or float16 (the weight's dtype)
    zero_points: np.ndarray | None  # uint8 [N, n_blocks] unpacked; None when symmetric (MatMulNBits' default)

    @property
    def n_blocks(self) -> int:
        return self.scales.shape[1]

    @property
    def dequantized(self) -> np.ndarray:
        """float32 [K, N]: ``(q - zero_point) * scale``, what a kernel reconstructs (the exact parity reference).
        Computed on each access (it is as large as the float weight)."""
        q = self.codes.reshape(self.n, self.n_blocks, self.block_size).astype(np.float32)
        zp = (np.float32(1 << (self.bits - 1)) if self.zero_points is None
              else self.zero_points.astype(np.float32)[..., None])
        deq = (q - zp) * self.scales.astype(np.float32)[..., None]
        return np.ascontiguousarray(deq.reshape(self.n, -1)[:, : self.k].T)

    @property
    def packed(self) -> np.ndarray:
        """MatMulNBits ``B``: uint8 [N, n_blocks, block_size * bits / 8]."""
        return pack_along_last(self.codes, self.bits).reshape(self.n, self.n_blocks, self.block_size * self.bits // 8)

    @property
    def packed_zero_points(self) -> np.ndarray | None:
        """MatMulNBits ``zero_points``: uint8 [N, ceil(n_blocks * bits / 8)], or None when symmetric."""
        return None if self.zero_points is None else pack_along_last(self.zero_points, self.bits)

    def qdq_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """DequantizeLinear's (x [K, N], x_scale [n_blocks, N], x_zero_point [n_blocks, N] or None).

        x is int8 holding signed codes (symmetric, stored as INT4/INT8) or uint8 holding unsigned ones (asymmetric,
        stored as UINT4/UINT8)."""
        x = transpose(self.codes)[: self.k]
        if self.symmetric:
            x = signed_codes(x, self.bits)
        zp = None if self.zero_points is None else transpose(self.zero_points)
        return x, transpose(self.scales), zp


def signed_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned symmetric codes (q + 2^(bits-1)) as the signed int8 values DequantizeLinear's INT4/INT8 hold."""
    return (codes - np.uint8(1 << (bits - 1))).view(np.int8)  # uint8 arithmetic wraps: 5 - 8 -> 253, int8 -3


def pack_along_last(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., L] -> bytes [..., ceil(L * bits / 8)]: 8 bits as they are; 4 bits two to a byte, the first
    in the low nibble (an odd count is padded with 0)."""
    values = np.asarray(values, dtype=np.uint8)
    if bits == 8:
        return values.copy()
    if values.shape[-1] % 2 == 0 and values.flags.c_contiguous and np.little_endian:
        pairs = values.view(np.uint16)  # each pair in one 16-bit word, the first in its low byte: one pass, not four
        return ((pairs & 0x000F) | ((pairs >> 4) & 0x00F0)).astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def _scale_for(span: np.ndarray, steps: int, dtype: type) -> np.ndarray:
    """span / steps rounded to the stored dtype, never below the exact value (so no code needs clamping), and 1 for
    an all-zero block (its codes are then the zero point, W' = 0)."""
    exact = span.astype(np.float64) / steps
    stored = exact.astype(dtype)
    low = stored.astype(np.float64) < exact
    stored[low] = np.nextafter(stored[low], dtype(np.inf))
    stored[span == 0] = 1
    return stored


def transpose(a: np.ndarray, tile: int = 64) -> np.ndarray:
    """``a.T`` made contiguous, a band of ``tile`` rows at a time: numpy's whole-array copy of a transposed uint8
    matrix is about 6x slower (its cache misses), which made the transposes a large share of a quantizing export."""
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)
    for i in range(0, rows, tile):
        out[:, i:i + tile] = a[i:i + tile].T
    return out


def quantize_weight(w: np.ndarray, bits: int = 4, block_size: int = 32, symmetric: bool = True) -> QuantizedWeight:
    """Quantize ``W [K, N]`` (used as ``x @ W``) block-wise along K.

    The scales keep W's dtype (float32, or float16 for a float16 W, as MatMulNBits wants them in A's dtype); codes are
    chosen against the stored scale, so ``dequantized`` is exactly what a kernel reconstructs. W is processed in
    bands of whole blocks of rows (about CHUNK_ELEMENTS elements, at least one block), each in a float64 buffer that
    is reused: every operation runs in place on contiguous rows, and the working memory stays small even for an
    lm_head."""
    check_settings(bits, block_size)
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype not in (np.float32, np.float16):
        raise QuantizeError(f"weight must be a 2-D float32/float16 array, got {w.dtype} {list(w.shape)}")
    codes, scales, zero_points = quantize_rows(w, bits, block_size, symmetric)
    k, n = w.shape
    return QuantizedWeight(bits, block_size, symmetric, k, n, transpose(codes), transpose(scales),
                           None if zero_points is None else transpose(zero_points))


def quantize_rows(w: np.ndarray, bits: int, block_size: int, symmetric: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """W [K, N] -> (unsigned codes uint8 [n_blocks * block_size, N] (K padded with zero rows), scales [n_blocks, N]
    in W's dtype, zero points uint8 [n_blocks, N] or None when symmetric): the layout DequantizeLinear takes, and
    the transpose of MatMulNBits'. The arithmetic is float64 element by element, so any banding gives the same
    numbers."""
    k, n = w.shape
    n_blocks = -(-k // block_size)
    band = max(1, CHUNK_ELEMENTS // max(1, block_size * n))  # blocks of rows per band
    dtype = w.dtype.type
    codes = np.empty((n_blocks * block_size, n), np.uint8)
    scales = np.empty((n_blocks, n), w.dtype)
    zero_points = None if symmetric else np.empty((n_blocks, n), np.uint8)
    buf = np.empty((min(band, n_blocks) * block_size, n), np.float64)
    for b0 in range(0, n_blocks, band):
        b1 = min(n_blocks, b0 + band)
        r0, r1 = b0 * block_size, b1 * block_size
        t = buf[:r1 - r0]
        if r1 > k:  # the last band of a K that is not a multiple of block_size: padded with zero rows
            t[:] = 0
            t[:k - r0] = w[r0:k]
        else:
            t[:] = w[r0:r1]
        blocks = t.reshape(b1 - b0, block_size, n)
        if symmetric:
            qmax = (1 << (bits - 1)) - 1
            span = np.abs(blocks).max(axis=1)
            _check_finite(span)
            s = _scale_for(span, qmax, dtype)
            np.divide(blocks, s.astype(np.float64)[:, None, :], out=blocks)
            np.rint(blocks, out=blocks)
            np.clip(blocks, -qmax, qmax, out=blocks)
            blocks += 1 << (bits - 1)
        else:
            qmax = (1 << bits) - 1
            lo = np.minimum(blocks.min(axis=1), 0.0)
            hi = np.maximum(blocks.max(axis=1), 0.0)
            _check_finite(hi - lo)
            s = _scale_for(hi - lo, qmax, dtype)
            s64 = s.astype(np.float64)
            zp = np.clip(np.rint(-lo / s64), 0, qmax).astype(np.uint8)
            zero_points[b0:b1] = zp
            np.divide(blocks, s64[:, None, :], out=blocks)
            np.rint(blocks, out=blocks)
            blocks += zp[:, None, :]
            np.clip(blocks, 0, qmax, out=blocks)
        scales[b0:b1] = s
        codes[r0:r1] = t
    return codes, scales, zero_points


def _check_finite(span: np.ndarray) -> None:
    """A block's span is inf or nan exactly when one of its values is."""
    if not np.isfinite(span).all():
        raise QuantizeError("weight has non-finite values (inf or nan): it cannot be quantized")


# ---------------------------------------------------------------------------------------------------------------
# The graph pass


@dataclass(frozen=True)
class MatMulSite:
    """A candidate: a MatMul node and its 2-D float initializer weight [K, N]."""

    node: str  # the node's name (e.g. "/mlp/gate_proj/MatMul")
    weight: str  # the initializer's name
    k: int
    n: int


def skip_lm_head(site: MatMulSite) -> bool:
    """The default predicate: every candidate except the output projection (node or weight named lm_head)."""
    return "lm_head" not in site.node and "lm_head" not in site.weight


@dataclass
class QuantizeReport:
    """What ``quantize_matmuls`` did."""

    quantized: list[MatMulSite] = field(default_factory=list)
    skipped: list[MatMulSite] = field(default_factory=list)  # candidates the predicate declined
    float_bytes: int = 0  # the replaced weights, at their float dtype
    quantized_bytes: int = 0  # what replaced them (codes, scales, zero points)


def _to_tensor(name: str, array: np.ndarray, data_type: int | None = None) -> TensorProto:
    """An initializer; data_type INT4/UINT4 packs the (int8/uint8) values two to a byte, first in the low nibble."""
    if data_type in (TensorProto.INT4, TensorProto.UINT4):
        raw = pack_along_last(array.reshape(-1).view(np.uint8), 4).tobytes()
        return helper.make_tensor(name, data_type, list(array.shape), raw, raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _load_weight(t: TensorProto, base_dir: str | Path | None) -> np.ndarray:
    if t.data_location == TensorProto.EXTERNAL and base_dir is None:
        raise QuantizeError(f"initializer {t.name} has external data: pass base_dir (the .onnx file's folder)")
    return numpy_helper.to_array(t, base_dir=str(base_dir) if base_dir is not None else "")


def _ensure_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for imp in model.opset_import:
        if imp.domain == domain:
            imp.version = max(imp.version, version)
            return
    model.opset_import.append(helper.make_opsetid(domain, version))


def _default_opset(model: onnx.ModelProto) -> int:
    return next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), 0)


def quantize_matmuls(model: onnx.ModelProto, bits: int = 4, block_size: int = 32, symmetric: bool = True,
                     accuracy_level: int = 4, form: str = "nbits",
                     predicate: Callable[[MatMulSite], bool] | None = skip_lm_head,
                     base_dir: str | Path | None = None,
                     load: Callable[[TensorProto], np.ndarray] | None = None,
                     store: Callable[[TensorProto], None] | None = None) -> QuantizeReport:
    """Replace, in place, every ``MatMul(x, W)`` of the main graph whose W is a 2-D fp32/fp16 initializer, or the
    ``Transpose`` (perm 1, 0) of one, and that ``predicate`` accepts (None: all) by its quantized form; returns what
    was done. The transposed case is a tied lm_head (``MatMul(x, Transpose(embed_tokens.weight))``): its quantized
    weight is a copy of the transpose, named ``<weight>_T...``; the embedding stays float for the Gather that reads it,
    and the Transpose goes once nothing reads it (ONNX Runtime would otherwise fold it into a second float copy).

    - form "nbits": ``MatMulNBits(x, B, scales[, zero_points])`` with ``accuracy_level`` (ONNX Runtime only). The
      default 4 is ONNX Runtime's only fast CPU kernel (0 and 1 are slower than a float MatMul: tools/lab/results.md,
      "Weight-only quantization: kernel choice"); it quantizes A to int8, so it is not exact against W' (use 0 or 1
      for a parity check).
    - form "qdq": ``MatMul(x, DequantizeLinear(q, scale[, zero_point], axis=0, block_size))``; q is INT4/INT8
      (symmetric) or UINT4/UINT8 with a zero point (asymmetric). A graph below opset 21 is converted to opset 21
      first (onnx.version_converter; external data stays where it is). ``accuracy_level`` is not used: ONNX
      Runtime fuses this form into MatMulNBits at its session config ``session.qdq_matmulnbits_accuracy_level``
      (default 4). TensorRT-RTX 1.7 builds the symmetric form (INT4/INT8) and refuses UINT4/UINT8 weights.

    A weight shared by several MatMuls is quantized once; a weight other nodes also read keeps its float copy.
    base_dir: the folder of the .onnx file, for external-data initializers (their float data is read from there;
    the new tensors are stored inline, so the caller saves the model with external data when it is large).
    load: reads a weight initializer's values instead (base_dir unused); store: called on each new initializer
    before it joins the graph (e.g. moving its bytes to a data file), so no graph's quantized tensors are ever all
    in memory at once (export/quantization/artifact.py streams them so).
    """
    check_settings(bits, block_size, accuracy_level, form)
    graph = model.graph
    if form == "qdq" and _default_opset(model) < QDQ_OPSET:
        from onnx import version_converter

        # The converter copies external-data initializers as references (their bytes are not read), so a large
        # graph converts without its weights in memory.
        try:
            converted = version_converter.convert_version(model, QDQ_OPSET)
        except Exception as e:  # the converter raises bare RuntimeErrors
            raise QuantizeError(f"could not convert the graph to opset {QDQ_OPSET} for the qdq form: {e}") from e
        model.CopyFrom(converted)
        graph = model.graph

    inits = {t.name: t for t in graph.initializer}
    # Transpose (perm 1, 0) outputs of 2-D float initializers: output name -> the initializer
    transposed = {n.output[0]: inits[n.input[0]] for n in graph.node
                  if n.op_type == "Transpose" and n.domain in ("", "ai.onnx") and n.input[0] in inits
                  and len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].data_type in FLOAT_TYPES
                  and [list(a.ints) for a in n.attribute if a.name == "perm"] in ([[1, 0]], [])}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for out in graph.output:
        readers[out.name] = readers.get(out.name, 0) + 1

    report = QuantizeReport()
    done: dict[str, dict[str, str]] = {}  # weight -> the new initializers' names, by role
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        matmul = node.op_type == "MatMul" and node.domain in ("", "ai.onnx")
        w = inits.get(node.input[1]) if matmul else None
        t = transposed.get(node.input[1]) if matmul and w is None else None
        if t is not None:  # the weight is t's transpose: [K, N] = t.dims reversed
            site = MatMulSite(node.name, t.name, int(t.dims[1]), int(t.dims[0]))
            key = f"{t.name}_T"
        elif w is None or len(w.dims) != 2 or w.data_type not in FLOAT_TYPES:
            new_nodes.append(node)
            continue
        else:
            site = MatMulSite(node.name, w.name, int(w.dims[0]), int(w.dims[1]))
            key = w.name
        if predicate is not None and not predicate(site):
            report.skipped.append(site)
            new_nodes.append(node)
            continue
        readers[node.input[1]] -= 1
        if key not in done:
            src = t if t is not None else w
            values = load(src) if load is not None else _load_weight(src, base_dir)
            if t is not None:
                values = np.ascontiguousarray(values.T)
            tensors = _quantized_tensors(values, bits, block_size, symmetric, key, form)
            del values
            report.float_bytes += site.k * site.n * np.dtype(FLOAT_TYPES[src.data_type]).itemsize
            report.quantized_bytes += sum(len(q.raw_data) for q in tensors.values())
            for q in tensors.values():
                if store is not None:
                    store(q)
                graph.initializer.append(q)
            done[key] = {role: q.name for role, q in tensors.items()}
            del tensors
        report.quantized.append(site)
        new_nodes.extend(_replacement(node, site, done[key], bits, block_size, accuracy_level, form))

    # A Transpose nothing reads any more goes, and with it its read of the initializer.
    gone = {id(n) for n in new_nodes if n.op_type == "Transpose" and n.output[0] in transposed
            and readers.get(n.output[0], 0) == 0}
    for n in new_nodes:
        if id(n) in gone:
            readers[n.input[0]] -= 1
    del graph.node[:]
    graph.node.extend(n for n in new_nodes if id(n) not in gone)
    quantized_sources = set(done) | {t.name for t in transposed.values() if f"{t.name}_T" in done}
    unused = {name for name in quantized_sources if name in inits and readers.get(name, 0) == 0}
    kept = [t for t in graph.initializer if t.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if report.quantized:
        if form == "nbits":
            _ensure_opset(model, MS_DOMAIN, 1)
        else:
            _ensure_opset(model, "", QDQ_OPSET)
    return report


def _quantized_tensors(w: np.ndarray, bits: int, block_size: int, symmetric: bool, base: str,
                       form: str) -> dict[str, TensorProto]:
    """W's quantized initializers by their input role, named after the float weight ``base``: the numbers of
    ``quantize_weight``, laid out for the form without a round trip through QuantizedWeight's [N, K] codes (qdq
    takes quantize_rows' [K, N] layout as it is)."""
    check_settings(bits, block_size)
    if w.ndim != 2 or w.dtype not in (np.float32, np.float16):
        raise QuantizeError(f"weight must be a 2-D float32/float16 array, got {w.dtype} {list(w.shape)}")
    k, n = w.shape
    codes, scales, zp = quantize_rows(w, bits, block_size, symmetric)
    out = {}
    if form == "nbits":
        n_blocks = scales.shape[0]
        packed = pack_along_last(transpose(codes), bits).reshape(n, n_blocks, block_size * bits // 8)
        del codes
        out["B"] = _to_tensor(f"{base}_Q{bits}", packed)
        del packed
        out["scales"] = _to_tensor(f"{base}_scales", transpose(scales))
        if zp is not None:
            out["zero_points"] = _to_tensor(f"{base}_zero_points", pack_along_last(transpose(zp), bits))
        return out
    x = codes[:k]
    if symmetric:
        x = signed_codes(x, bits)
    four = bits == 4
    x_type = (TensorProto.INT4 if symmetric else TensorProto.UINT4) if four else None
    out["x"] = _to_tensor(f"{base}_Q{bits}", x, x_type)
    del x, codes
    out["x_scale"] = _to_tensor(f"{base}_scale", scales)
    if zp is not None:
        out["x_zero_point"] = _to_tensor(f"{base}_zero_point", zp, TensorProto.UINT4 if four else None)
    return out


def _replacement(node: onnx.NodeProto, site: MatMulSite, names: dict[str, str], bits: int, block_size: int,
                 accuracy_level: int, form: str) -> list[onnx.NodeProto]:
    name = node.name or f"{site.weight}_matmul"
    if form == "nbits":
        inputs = [node.input[0], names["B"], names["scales"]] + ([names["zero_points"]] if "zero_points" in names
                                                                 else [])
        return [helper.make_node("MatMulNBits", inputs, list(node.output), name=f"{name}_Q{bits}", domain=MS_DOMAIN,
                                 K=site.k, N=site.n, bits=bits, block_size=block_size,
                                 accuracy_level=accuracy_level)]
    deq_out = f"{name}_DequantizeLinear_output"
    inputs = [names["x"], names["x_scale"]] + ([names["x_zero_point"]] if "x_zero_point" in names else [])
    return [helper.make_node("DequantizeLinear", inputs, [deq_out], name=f"{name}_DequantizeLinear", axis=0,
                             block_size=block_size),
            helper.make_node("MatMul", [node.input[0], deq_out], list(node.output), name=name)]

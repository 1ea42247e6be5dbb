"""Weight-only int4/int8 quantization (export/quantization/matmuls.py): the MatMulNBits layout ONNX Runtime reads, the
DequantizeLinear form, the error bound, the graph pass on a real exported target, and TensorRT-RTX's build of it.

Parity reference: ``x @ W'`` with W' the dequantized weights quantize_weight returns (what a correct kernel
reconstructs), or the same graph with its weights replaced by W'. At accuracy_level 0 (float A) ONNX Runtime's
kernels agree with it to float rounding; a wrong layout (nibble order, zero point, block order) is off by whole
quantization steps.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from eagle_export import contract as C
from eagle_export.export.quantization.matmuls import (
    MatMulSite,
    QuantizeError,
    pack_along_last,
    quantize_matmuls,
    quantize_weight,
)
from eagle_export.manifest import load_manifest

ORT_IR_VERSION = 10  # ONNX Runtime 1.31 reads IR <= 11; onnx 1.23's helper would write a newer one
RTOL = 1e-4  # fp32: max |y - ref| / max |ref|
RTOL_FP16 = 3e-3  # fp16 outputs round at 2^-11 relative

# (block_size, K, N): odd N, K a multiple of the block, and one K that is not (80 = 2.5 blocks of 32: padded).
SHAPES = [(16, 64, 7), (32, 128, 33), (128, 256, 5), (32, 80, 9)]


def _np(dtype: str):
    return np.float32 if dtype == "fp32" else np.float16


def _matmul_model(w: np.ndarray, opset: int = 21) -> onnx.ModelProto:
    t = TensorProto.FLOAT if w.dtype == np.float32 else TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="proj/MatMul")], "g",
        [helper.make_tensor_value_info("x", t, [1, "m", w.shape[0]])],
        [helper.make_tensor_value_info("y", t, [1, "m", w.shape[1]])],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ORT_IR_VERSION)


def _nbits_model(k: int, n: int, bits: int, block_size: int, b: np.ndarray, scales: np.ndarray,
                 zero_points: np.ndarray | None, dtype=np.float32) -> onnx.ModelProto:
    """A MatMulNBits graph written by hand from the given arrays (to feed it deliberately wrong layouts)."""
    t = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["x", "B", "scales"]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "zp"))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block_size, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", t, [1, "m", k])],
                              [helper.make_tensor_value_info("y", t, [1, "m", n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=ORT_IR_VERSION)


def _session(model: onnx.ModelProto, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, config: dict | None = None,
             optimized: Path | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    y, ref = y.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def _weight(k: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)) * rng.uniform(0.01, 1.0, size=(1, n))  # columns of different scales
    w[: min(k, 16), 0] = 0.0  # an all-zero block (scale 1, every code at the zero point)
    w[k // 2, n // 2] = 12.0  # an outlier: its block's scale is large, the others' are not
    return w.astype(dtype)


def _run_ref(model: onnx.ModelProto, w_deq: np.ndarray, m: int = 13, **session) -> tuple[float, np.ndarray]:
    k = w_deq.shape[0]
    dtype = model.graph.input[0].type.tensor_type.elem_type
    x = np.random.default_rng(1).standard_normal((1, m, k)).astype(np.float32 if dtype == TensorProto.FLOAT
                                                                      else np.float16)
    y = _session(model, **session).run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ w_deq.astype(np.float64)
    return _rel_err(y, ref), y


# ---------------------------------------------------------------------------------------------------------------
# One weight: layout and numbers


@pytest.mark.parametrize("block_size, k, n", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_matmulnbits_equals_dequantized(dtype, bits, symmetric, block_size, k, n):
    """ORT's MatMulNBits (CPU; fp16 A runs natively, no Cast is inserted) computes x @ W' with the arrays
    quantize_weight packs, at accuracy_level 0."""
    w = _weight(k, n, _np(dtype))
    q = quantize_weight(w, bits, block_size, symmetric)
    assert q.packed.shape == (n, -(-k // block_size), block_size * bits // 8) and q.packed.dtype == np.uint8
    assert q.scales.shape == (n, -(-k // block_size)) and q.scales.dtype == w.dtype
    if symmetric:
        assert q.packed_zero_points is None
    else:
        assert q.packed_zero_points.shape == (n, -(-q.n_blocks * bits // 8))
    model = _matmul_model(w)
    report = quantize_matmuls(model, bits, block_size, symmetric, accuracy_level=0, form="nbits", predicate=None)
    assert [s.weight for s in report.quantized] == ["W"] and [i.name for i in model.graph.initializer] != ["W"]
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    with tempfile.TemporaryDirectory() as tmp:  # after ORT's optimisation too: no Cast around an fp16 MatMulNBits
        _session(model, optimized=Path(tmp) / "opt.onnx")
        assert [node.op_type for node in onnx.load(Path(tmp) / "opt.onnx").graph.node] == ["MatMulNBits"]
    err, _ = _run_ref(model, q.dequantized)
    assert err < (RTOL if dtype == "fp32" else RTOL_FP16), err
    # the quantization is not the identity: W' differs from W by up to half a step
    assert np.abs(q.dequantized - w.astype(np.float32)).max() > 0


@pytest.mark.parametrize("block_size, k, n", SHAPES[1:3])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qdq_form_equals_dequantized(dtype, bits, symmetric, block_size, k, n):
    """DequantizeLinear (opset 21, blocked, axis 0) -> MatMul computes x @ W' both as written (no optimisation) and
    as ORT's full optimisation rewrites it (into MatMulNBits, here kept at accuracy level 0)."""
    w = _weight(k, n, _np(dtype), seed=2)
    q = quantize_weight(w, bits, block_size, symmetric)
    model = _matmul_model(w, opset=17)  # below 21: the pass converts the graph
    quantize_matmuls(model, bits, block_size, symmetric, form="qdq", predicate=None)
    assert [node.op_type for node in model.graph.node] == ["DequantizeLinear", "MatMul"]
    names = {t.name: t for t in model.graph.initializer}
    x_type = names[f"W_Q{bits}"].data_type
    want = {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4, (8, True): TensorProto.INT8,
            (8, False): TensorProto.UINT8}[(bits, symmetric)]
    assert x_type == want and ("W_zero_point" in names) == (not symmetric)
    tol = RTOL if dtype == "fp32" else RTOL_FP16
    for session in ({"level": ort.GraphOptimizationLevel.ORT_DISABLE_ALL},
                    {"config": {"session.qdq_matmulnbits_accuracy_level": "0"}}):
        err, _ = _run_ref(model, q.dequantized, **session)
        assert err < tol, (session, err)


@pytest.mark.parametrize("bits", [4, 8])
def test_ort_fuses_the_qdq_form_into_matmulnbits(bits, tmp_path):
    """ORT 1.31.1 CPU at ORT_ENABLE_ALL rewrites DequantizeLinear -> MatMul into one MatMulNBits, at its default
    accuracy level 4 (session config session.qdq_matmulnbits_accuracy_level), for int4 and int8; an fp16 graph gets
    Casts around it (the fused node computes in fp32)."""
    for dtype in (np.float32, np.float16):
        model = _matmul_model(_weight(128, 24, dtype))
        quantize_matmuls(model, bits, 32, True, form="qdq", predicate=None)
        _session(model, optimized=tmp_path / "opt.onnx")
        opt = onnx.load(tmp_path / "opt.onnx")
        ops = sorted(n.op_type for n in opt.graph.node)
        assert ops == (["MatMulNBits"] if dtype == np.float32 else ["Cast", "Cast", "MatMulNBits"]), ops
        node = next(n for n in opt.graph.node if n.op_type == "MatMulNBits")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == bits and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4


def test_accuracy_level_4_is_close_not_exact():
    """The default accuracy level 4 (the fast CPU kernel: A quantized to int8 per block) is within about 1% of
    x @ W' but not at float rounding: a parity check against W' needs level 0 or 1, or a wider tolerance."""
    w = _weight(256, 96, np.float32, seed=6)
    q = quantize_weight(w, 4, 32)
    model = _matmul_model(w)
    node_levels = []
    for level in (None, 1):
        m = _copy(model)
        quantize_matmuls(m, 4, 32, predicate=None, **({} if level is None else {"accuracy_level": level}))
        node_levels.append(helper.get_attribute_value(
            next(a for a in m.graph.node[0].attribute if a.name == "accuracy_level")))
        err, _ = _run_ref(m, q.dequantized)
        if level is None:
            assert 1e-4 < err < 2e-2, err
        else:
            assert err < RTOL, err
    assert node_levels == [4, 1]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_error_within_half_a_step(dtype, bits, symmetric):
    """|W - W'| <= scale / 2 per element, for every block (the grid covers each block's range), and the codes stay
    in range: symmetric uses [-(2^(b-1) - 1), 2^(b-1) - 1] + 2^(b-1), so code 0 never occurs."""
    block = 32
    w = _weight(200, 19, _np(dtype), seed=3)
    q = quantize_weight(w, bits, block, symmetric)
    step = np.repeat(q.scales.astype(np.float64), block, axis=1)[:, : q.k].T  # [K, N]
    err = np.abs(w.astype(np.float64) - q.dequantized.astype(np.float64))
    assert (err <= step / 2 * (1 + 1e-6)).all(), float((err / step).max())
    assert (err > step / 4).any()  # a bound that is met with room would not test much: errors do reach it
    assert q.codes.max() <= (1 << bits) - 1
    if symmetric:
        assert q.codes.min() >= 1 and q.zero_points is None
    assert q.dequantized[:16, 0].tolist() == [0.0] * 16  # the all-zero block stays zero


def test_packing_order():
    """Codes along K, two per byte, the first in the low nibble; zero points packed the same way per column."""
    assert pack_along_last(np.array([[1, 2, 3, 4, 5]], np.uint8), 4).tolist() == [[0x21, 0x43, 0x05]]
    assert pack_along_last(np.array([[1, 200]], np.uint8), 8).tolist() == [[1, 200]]


@pytest.mark.parametrize("bug", ["nibbles swapped", "zero point off by one", "blocks reversed"])
def test_parity_catches_layout_bugs(bug):
    """The parity check above is sharp: the same arrays with a planted layout bug are off by far more than RTOL."""
    k, n, block = 128, 20, 32
    q = quantize_weight(_weight(k, n, np.float32, seed=4), 4, block, symmetric=False)
    b, zp = q.packed, q.packed_zero_points
    if bug == "nibbles swapped":
        b = ((b & 0x0F) << 4) | (b >> 4)
    elif bug == "zero point off by one":
        zp = pack_along_last(np.clip(q.zero_points.astype(int) + 1, 0, 15).astype(np.uint8), 4)
    else:
        b = b[:, ::-1].copy()
    good, _ = _run_ref(_nbits_model(k, n, 4, block, q.packed, q.scales, q.packed_zero_points), q.dequantized)
    bad, _ = _run_ref(_nbits_model(k, n, 4, block, b, q.scales, zp), q.dequantized)
    assert good < RTOL and bad > 100 * RTOL, (good, bad)


def test_bad_settings_fail_clearly():
    w = np.ones((64, 8), np.float32)
    for kwargs, msg in (({"bits": 3}, "bits must be one of"), ({"block_size": 48}, "power of 2 from 16 to 256"),
                        ({"block_size": 8}, "power of 2 from 16 to 256")):
        with pytest.raises(QuantizeError, match=msg):
            quantize_weight(w, **kwargs)
    with pytest.raises(QuantizeError, match="2-D float32/float16"):
        quantize_weight(np.ones((4, 4, 4), np.float32))
    with pytest.raises(QuantizeError, match="non-finite"):
        quantize_weight(np.full((32, 2), np.inf, np.float32))
    with pytest.raises(QuantizeError, match="form must be one of"):
        quantize_matmuls(_matmul_model(w), form="gptq")
    with pytest.raises(QuantizeError, match="accuracy_level must be one of"):
        quantize_matmuls(_matmul_model(w), accuracy_level=5)


def test_shared_and_reused_weights():
    """A weight read by two MatMuls is quantized once; one also read by another node keeps its float copy."""
    w = _weight(64, 16, np.float32)
    t = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="m1"),
             helper.make_node("MatMul", ["x", "W"], ["b"], name="m2"),
             helper.make_node("MatMul", ["x", "V"], ["c"], name="m3"),
             helper.make_node("Transpose", ["V"], ["vt"], name="t")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, [2, 64])],
                              [helper.make_tensor_value_info(o, t, None) for o in ("a", "b", "c", "vt")],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w * 2, "V")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=ORT_IR_VERSION)
    report = quantize_matmuls(model, 4, 32, predicate=None)
    names = sorted(i.name for i in model.graph.initializer)
    assert names == ["V", "V_Q4", "V_scales", "W_Q4", "W_scales"], names
    assert [s.node for s in report.quantized] == ["m1", "m2", "m3"]
    assert report.float_bytes == 2 * 64 * 16 * 4 and report.quantized_bytes == 2 * (16 * 2 * 16 + 16 * 2 * 4)
    out = _session(model).run(None, {"x": np.ones((2, 64), np.float32)})
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[3], (w * 2).T)


# ---------------------------------------------------------------------------------------------------------------
# The pass on a real exported target graph


def _target_feed(manifest, past: int = 5, new: int = 7, seed: int = 0) -> dict[str, np.ndarray]:
    t = manifest.target
    rng = np.random.default_rng(seed)
    dtype = np.dtype(manifest.dtype)
    mask = np.ones((1, new, past + new), bool)
    mask[0, :, past:] = np.tril(np.ones((new, new), bool))
    feed = {C.INPUT_IDS: rng.integers(0, t.vocab_size, (1, new)),
            C.POSITION_IDS: np.arange(past, past + new, dtype=np.int64)[None],
            C.ATTENTION_MASK: mask,
            C.LOGIT_INDICES: np.arange(new, dtype=np.int64)[None]}
    for name in C.past_names(t.num_layers):
        feed[name] = rng.standard_normal((1, past, t.kv_heads, t.head_dim)).astype(dtype)
    return feed


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _with_weights(model: onnx.ModelProto, base_dir: Path, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` with its external data loaded and the named initializers replaced (same dtype)."""
    ref = _copy(model)
    onnx.load_external_data_for_model(ref, str(base_dir))
    for i, t in enumerate(ref.graph.initializer):
        if t.name in weights:
            dtype = numpy_helper.to_array(t).dtype
            ref.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights[t.name].astype(dtype), t.name))
    return ref


@pytest.fixture(scope="module")
def target_graph(models):
    """(manifest, artifact dir, target_verify ModelProto without its external data) of the small engine model."""
    from conftest import ENGINE_MODEL

    def get(dtype: str = "fp32"):
        art = models(dtype=dtype, **ENGINE_MODEL)[2]
        m = load_manifest(art)
        return m, art, onnx.load(art / m.graphs[C.TARGET_GRAPH].file, load_external_data=False)

    return get


@pytest.mark.parametrize("form, bits, symmetric, dtype", [("nbits", 4, True, "fp32"), ("nbits", 8, False, "fp32"),
                                                          ("qdq", 4, False, "fp32"), ("nbits", 4, True, "fp16")])
def test_target_graph_equals_its_dequantized_twin(target_graph, form, bits, symmetric, dtype):
    """The pass on an exported target (external data): every projection but lm_head quantized (the default
    predicate), and every output (logits, features, present K/V) equal to the same graph holding W'."""
    manifest, art, model = target_graph(dtype)
    original = _copy(model)
    layers = manifest.target.num_layers
    with pytest.raises(QuantizeError, match="external data: pass base_dir"):
        quantize_matmuls(_copy(model), bits, 32, symmetric, form="nbits")
    report = quantize_matmuls(model, bits, 32, symmetric, accuracy_level=0, form=form, base_dir=art)
    assert len(report.quantized) == 7 * layers  # q k v o gate up down
    assert [s.node for s in report.skipped] == ["/lm_head/MatMul"]
    op = "MatMulNBits" if form == "nbits" else "DequantizeLinear"
    assert sum(n.op_type == op for n in model.graph.node) == 7 * layers
    assert report.quantized_bytes < report.float_bytes / (3 if bits == 4 else 1.5)

    weights = {}
    for site in report.quantized:
        t = next(i for i in original.graph.initializer if i.name == site.weight)
        weights[site.weight] = quantize_weight(numpy_helper.to_array(t, str(art)), bits, 32, symmetric).dequantized
    ref = _with_weights(original, art, weights)
    plain = _with_weights(original, art, {})
    feed = _target_feed(manifest)
    onnx.load_external_data_for_model(model, str(art))  # the weights left in float (embedding, norms, lm_head)
    config = {"session.qdq_matmulnbits_accuracy_level": "0"}
    got = _session(model, config=config).run(None, feed)
    want = _session(ref).run(None, feed)
    unquantized = _session(plain).run(None, feed)
    tol = RTOL if dtype == "fp32" else 2e-2
    names = [o.name for o in model.graph.output]
    for name, g, w in zip(names, got, want, strict=True):
        assert _rel_err(g, w) < tol, (name, _rel_err(g, w))
    drift = _rel_err(got[0], unquantized[0])
    assert drift > 10 * tol, drift  # the quantization changed the logits: the twin is not the float graph


def test_predicate_chooses_by_name(target_graph):
    """The predicate sees each candidate's node and weight names and shape; lm_head is quantized when asked."""
    manifest, art, model = target_graph()
    seen: list[MatMulSite] = []

    def only_mlp_and_head(site: MatMulSite) -> bool:
        seen.append(site)
        return "/mlp/" in site.node or "lm_head" in site.node

    report = quantize_matmuls(model, 4, 32, predicate=only_mlp_and_head, base_dir=art)
    assert len(seen) == 7 * manifest.target.num_layers + 1
    head = next(s for s in report.quantized if "lm_head" in s.node)
    assert (head.k, head.n) == (manifest.target.hidden_size, manifest.target.vocab_size)
    assert len(report.quantized) == 3 * manifest.target.num_layers + 1


# ---------------------------------------------------------------------------------------------------------------
# TensorRT-RTX builds the qdq form (ahead of time, no GPU)


def test_tensorrt_rtx_builds_the_qdq_target(target_graph, tmp_path):
    """The qdq form of the whole target (opset 21, INT4 blocked DequantizeLinear -> MatMul) parses into a strongly
    typed network that keeps each weight as an INT4 constant feeding a dequantize layer, and TensorRT-RTX 1.7
    builds it with the artifact's profiles. Asymmetric (UINT4 with a zero point) is refused by its parser."""
    from eagle_export.engines import builder as B
    from eagle_export.engines.libs import load_lib, make_logger
    from eagle_export.engines.profiles import graph_profiles, resolve_options
    from eagle_export.errors import EngineError

    lib = load_lib("tensorrt-rtx")
    trt = lib.module
    manifest, art, model = target_graph()
    entry = manifest.graphs[C.TARGET_GRAPH]
    profiles = graph_profiles(manifest, C.TARGET_GRAPH, resolve_options(manifest))
    asym = _copy(model)
    report = quantize_matmuls(model, 4, 32, True, form="qdq", base_dir=art)
    onnx.load_external_data_for_model(model, str(art))  # the float weights left stay in the artifact's data file
    path = tmp_path / "target_int4.onnx"
    onnx.save(model, path)

    logger = make_logger(lib)
    net = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(net, logger).parse_from_file(str(path))
    layers = [net.get_layer(i) for i in range(net.num_layers)]
    int4_dq = [layer for layer in layers if layer.type == trt.LayerType.DEQUANTIZE
               and layer.get_input(0).dtype == trt.DataType.INT4]
    assert len(int4_dq) == len(report.quantized)

    built = B.build_graph(lib, path, C.TARGET_GRAPH, entry.spec, profiles)
    assert len(built.data) > 100_000 and [p.name for p in built.profiles] == ["prefill", "verify"]

    quantize_matmuls(asym, 4, 32, False, form="qdq", base_dir=art)
    onnx.load_external_data_for_model(asym, str(art))
    onnx.save(asym, tmp_path / "target_uint4.onnx")
    with pytest.raises(EngineError, match="could not parse graph target_verify.*\n.*Failed to import initializer"):
        B.build_graph(lib, tmp_path / "target_uint4.onnx", C.TARGET_GRAPH, entry.spec, profiles)


def test_external_weights_of_a_saved_graph(tmp_path):
    """A graph saved with external data quantizes from its folder (base_dir), as an artifact's does."""
    w = _weight(64, 16, np.float32)
    model = _matmul_model(w)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    loaded = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    assert loaded.graph.initializer[0].data_location == TensorProto.EXTERNAL
    quantize_matmuls(loaded, 4, 16, accuracy_level=0, predicate=None, base_dir=tmp_path)
    err, _ = _run_ref(loaded, quantize_weight(w, 4, 16).dequantized)
    assert err < RTOL


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_chunked_columns_equal_one_pass(monkeypatch, symmetric):
    """Large weights are quantized a few columns at a time (bounded memory): the result is the same arrays."""
    from eagle_export.export.quantization import matmuls as Q

    w = _weight(96, 37, np.float32, seed=5)
    whole = quantize_weight(w, 4, 32, symmetric)
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 96 * 5)  # 5 columns per chunk, the last one shorter
    chunked = quantize_weight(w, 4, 32, symmetric)
    np.testing.assert_array_equal(chunked.codes, whole.codes)
    np.testing.assert_array_equal(chunked.scales, whole.scales)
    np.testing.assert_array_equal(chunked.dequantized, whole.dequantized)
    if not symmetric:
        np.testing.assert_array_equal(chunked.zero_points, whole.zero_points)

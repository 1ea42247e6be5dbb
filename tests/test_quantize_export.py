"""`export --quantize`: the artifact's graphs with int4/int8 weights, the manifest's record of it, the runtime's
losslessness on it (EAGLE == the same artifact's --no-draft), the errors for bad settings, and TensorRT-RTX's build.

The quantizer's numbers (kernels equal to the dequantized weights) are tests/test_quantize.py's; here the wiring."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from eagle_export import contract as C
from eagle_export.cli import main
from eagle_export.errors import EagleExportError, EngineError, ManifestError
from eagle_export.export.quantization.artifact import QuantizeOptions
from eagle_export.manifest import MANIFEST_NAME, Manifest, check_manifest, load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.bench import peer as pog
from eagle_export.tree_params import TreeLimits, TreeParams

SMALL = dict(preset="mha", max_seq_len=64, limits=TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12))
INT4_ALL = QuantizeOptions(bits=4, draft=True)  # target, draft head and lm_heads; symmetric, block 32, level 4
INT8_ASYM = QuantizeOptions(bits=8, block_size=16, symmetric=False, draft=False)  # --quantize-float-draft


@pytest.fixture(scope="module")
def int4(models):
    return models(**SMALL, quantize=INT4_ALL)


@pytest.fixture(scope="module")
def int8(models):
    return models(**SMALL, quantize=INT8_ASYM)


def _ops(path) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _float_matmul_weights(path) -> list[str]:
    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    return [n.name for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def test_quantized_artifact_graphs_and_manifest(models, int4, int8):
    """Every projection of the three graphs is quantized in the form its backend runs; the manifest says how (and
    the peer bench reads int4 from it); the artifact is smaller than the float one; the draft's embedding table,
    read raw by the runtime, stays float."""
    art = int4[2]
    m = load_manifest(art)
    q = m.quantization
    layers = m.target.num_layers
    assert (q.method, q.bits, q.block_size, q.symmetric, q.accuracy_level, q.draft, q.lm_head) == (
        "int4", 4, 32, True, 4, True, True)
    trees = C.tree_graphs(m.graphs)
    assert trees and q.graphs == {C.TARGET_FUSED_GRAPH: "nbits", C.TARGET_GRAPH: "qdq", C.DRAFT_GRAPH: "qdq",
                                  **{name: "nbits" for name, _ in trees.values()}}
    # standard: q k v o gate up down + lm_head; fused: packed qkv, o, gate, up, down + lm_head
    assert q.matmuls[C.TARGET_GRAPH] == 7 * layers + 1 and q.matmuls[C.TARGET_FUSED_GRAPH] == 5 * layers + 1
    fused = _ops(art / f"{C.TARGET_FUSED_GRAPH}.onnx")
    assert fused["MatMulNBits"] == q.matmuls[C.TARGET_FUSED_GRAPH] and "DequantizeLinear" not in fused
    assert _ops(art / f"{C.TARGET_GRAPH}.onnx")["DequantizeLinear"] == q.matmuls[C.TARGET_GRAPH]
    assert _ops(art / f"{C.DRAFT_GRAPH}.onnx")["DequantizeLinear"] == q.matmuls[C.DRAFT_GRAPH] >= 8
    # the draft tree graphs (ONNX Runtime only) as MatMulNBits: the step graph's projections once per level (q, k and
    # v as one), no Gemm left with a float weight, and their weights still stored once where they are the same bytes
    # as another graph's (the float embedding)
    for name, depth in trees.values():
        tree = _ops(art / f"{name}.onnx")
        assert tree["MatMulNBits"] == q.matmuls[name] >= (q.matmuls[C.DRAFT_GRAPH] - 2) * (depth + 1), name
        assert "Gemm" not in tree, name
    for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH, C.DRAFT_GRAPH, *(name for name, _ in trees.values())):
        assert _float_matmul_weights(art / f"{g}.onnx") == []
    raw = json.loads((art / MANIFEST_NAME).read_text())
    assert Manifest.from_dict(raw).to_dict() == raw
    assert pog.artifact_precision(raw) == "int4"
    assert pog.artifact_precision(json.loads((int8[2] / MANIFEST_NAME).read_text())) == "fp32"
    plain = models(**SMALL)[2]
    size = {a: sum(f.stat().st_size for f in a.glob("*.data")) for a in (art, plain)}
    assert size[art] < 0.6 * size[plain], size
    assert m.draft_embedding.dtype == "float32" and m.draft_embedding.shared
    assert m.weights_label() == "int4 target and draft"  # what bench's first line says
    # int8 asymmetric, target only: zero points, the target's lm_head quantized (the default), the draft graphs
    # float, the lm_head they read included
    assert load_manifest(int8[2]).weights_label() == "int8 target, float32 draft"
    q8 = load_manifest(int8[2]).quantization
    assert (q8.bits, q8.symmetric, q8.draft, q8.lm_head, set(q8.graphs)) == (
        8, False, False, True, {C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH})  # the tree graphs stay float
    assert q8.matmuls[C.TARGET_GRAPH] == 7 * layers + 1
    for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH):
        assert _float_matmul_weights(int8[2] / f"{g}.onnx") == [], g
    draft_float = _float_matmul_weights(int8[2] / f"{C.DRAFT_GRAPH}.onnx")
    assert len(draft_float) >= 8 and any("lm_head" in n for n in draft_float)


def test_float_lm_head_keeps_the_targets_lm_head_float(models):
    """--quantize-float-lm-head: every projection of the target quantized but its lm_head, which stays a float
    MatMul; the manifest says so."""
    art = models(**SMALL, quantize=QuantizeOptions(bits=4, lm_head=False, draft=False))[2]
    q = load_manifest(art).quantization
    layers = load_manifest(art).target.num_layers
    assert (q.lm_head, q.draft) == (False, False)
    assert q.matmuls[C.TARGET_GRAPH] == 7 * layers and q.matmuls[C.TARGET_FUSED_GRAPH] == 5 * layers
    for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH):
        names = _float_matmul_weights(art / f"{g}.onnx")
        assert len(names) == 1 and "lm_head" in names[0], (g, names)


@pytest.mark.parametrize("which", ["int4", "int8"])
def test_quantized_artifact_is_lossless(request, models, which):
    """Lossless on a quantized artifact means its EAGLE tokens equal its own --no-draft greedy tokens (both on the
    fused graph ONNX Runtime runs, at the artifact's accuracy level). The quantization changed the model: some
    prompt's tokens differ from the float artifact's."""
    art = request.getfixturevalue(which)[2]
    rt = EagleRuntime.open(art, threads=1)
    plain_rt = EagleRuntime.open(models(**SMALL)[2], threads=1)
    rng = np.random.default_rng(3)
    differs = False
    for _ in range(4):
        prompt = rng.integers(3, 48, int(rng.integers(2, 12))).tolist()
        eagle = rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False)
        plain = rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=False, stop_on_eos=False)
        assert eagle.tokens == plain.tokens, prompt
        assert eagle.stats.rounds < 24  # drafts were accepted: the verify ran wide
        differs |= plain.tokens != plain_rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=False,
                                                     stop_on_eos=False).tokens
    assert differs


def test_bad_quantize_settings_fail_in_one_line(tiny, tmp_path):
    target, draft, _ = tiny
    runner = CliRunner()
    base = ["export", "--target", str(target), "--draft", str(draft), "--quiet"]
    cases = [(["--quantize", "int4", "--quantize-block-size", "48"], "--quantize-block-size must be a power of 2"),
             (["--quantize", "int4", "--quantize-accuracy-level", "5"], "--quantize-accuracy-level must be one of"),
             (["--quantize-draft"], "--quantize-draft needs --quantize int4 or int8"),
             (["--quantize-float-draft"], "--quantize-float-draft needs --quantize"),
             (["--quantize-asymmetric"], "--quantize-asymmetric needs --quantize"),
             (["--quantize-float-lm-head"], "--quantize-float-lm-head needs --quantize"),
             (["--quantize", "int4", "--dtype", "bf16"], "--quantize takes --dtype fp32 or fp16"),
             (["--quantize", "int4", "--quantize-draft-only", "int8"], "--quantize-draft-only takes --quantize none"),
             (["--quantize-draft-only", "int8", "--quantize-float-draft"], "--quantize-float-draft needs")]
    for i, (extra, msg) in enumerate(cases):
        res = runner.invoke(main, [*base, "--out", str(tmp_path / f"o{i}"), *extra])
        assert res.exit_code != 0 and msg in res.output, (extra, res.output)
        assert "Traceback" not in res.output and not (tmp_path / f"o{i}").exists()


def test_the_draft_is_quantized_by_default_and_float_draft_keeps_it_float(tiny, tmp_path):
    """`export --quantize int4` quantizes the draft graphs too (their MatMuls and the lm_head they read);
    `--quantize-float-draft` keeps them float, the target quantized either way. The manifest says which."""
    target, draft, _ = tiny
    runner = CliRunner()
    for extra, quantized in (([], True), (["--quantize-float-draft"], False)):
        out = tmp_path / ("float" if extra else "default")
        res = runner.invoke(main, ["export", "--target", str(target), "--draft", str(draft), "--out", str(out),
                                   "--quiet", "--quantize", "int4", *extra])
        assert res.exit_code == 0, res.output
        m = load_manifest(out)
        assert m.quantization.draft is quantized
        draft_float = _float_matmul_weights(out / f"{C.DRAFT_GRAPH}.onnx")
        assert (draft_float == []) is quantized, draft_float
        assert _float_matmul_weights(out / f"{C.TARGET_FUSED_GRAPH}.onnx") == []


def test_quantize_draft_only_keeps_the_target_float_and_its_tokens(models):
    """`export --quantize-draft-only int4`: the draft graphs quantized, the target graphs the float export's bytes,
    the default tree left branching (a float target is exact on any tree), EAGLE's tokens the float target's own
    greedy tokens with drafts accepted, the peer bench comparing with fp32, and validate passing (the EAGLE-1/2
    head's reference gets its own dequantized lm_head while the target's stays float)."""
    from eagle_export.tools.commands.validate import validate

    float_art = models(**SMALL)[2]
    art = models(**SMALL, quantize=QuantizeOptions(bits=4, lm_head=False, target=False))[2]
    m = load_manifest(art)
    q = m.quantization
    assert not q.target and q.draft and not q.rounds_activations
    assert m.weights_label() == "float32 target, int4 draft" and load_manifest(float_art).weights_label() == "float32"
    assert set(q.graphs) == {C.DRAFT_GRAPH, *(name for name, _ in C.tree_graphs(m.graphs).values())}
    assert m.tree_defaults == load_manifest(float_art).tree_defaults and m.tree_defaults.top_k > 1
    for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH):
        assert not {"MatMulNBits", "DequantizeLinear"} & set(_ops(art / f"{g}.onnx")), g
        assert (art / f"{g}.onnx").read_bytes() == (float_art / f"{g}.onnx").read_bytes(), g
    data = f"{C.TARGET_GRAPH}.onnx.data"
    assert (art / data).read_bytes() == (float_art / data).read_bytes()
    assert _float_matmul_weights(art / f"{C.DRAFT_GRAPH}.onnx") == []
    raw = json.loads((art / MANIFEST_NAME).read_text())
    assert pog.artifact_precision(raw) == "fp32"
    raw["quantization"]["graphs"][C.TARGET_GRAPH] = "qdq"  # a record that contradicts itself
    with pytest.raises(ManifestError, match="quantization.target is false .* quantizes a target graph"):
        check_manifest(Manifest.from_dict(raw))
    rt, float_rt = EagleRuntime.open(art, threads=1), EagleRuntime.open(float_art, threads=1)
    rng = np.random.default_rng(5)
    for _ in range(3):
        prompt = rng.integers(3, 48, int(rng.integers(2, 12))).tolist()
        eagle = rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False)
        plain = float_rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=False, stop_on_eos=False)
        assert eagle.tokens == plain.tokens, prompt
        assert eagle.stats.rounds < 24
    report = validate(art, prompts=2, max_new_tokens=10, threads=1)
    assert report.passed, report.format()
    assert "quantization int4 (the draft alone;" in report.format()
    with pytest.raises(EagleExportError, match="--against-library compares .* this artifact's draft is quantized"):
        validate(art, prompts=0, threads=1, against_library=True)


def test_asymmetric_artifact_refuses_a_tensorrt_build(int8):
    """TensorRT-RTX refuses weights with zero points (tests/test_quantize.py shows its parser's error): `build`
    says so in one line before loading any TensorRT, naming the fix."""
    from eagle_export.engines.builder import build_engines

    with pytest.raises(EngineError, match=r"int8 asymmetric \(zero points\).*--quantize-symmetric"):
        build_engines(int8[2], progress=False)
    assert not load_manifest(int8[2]).engines


def test_quantize_options_check():
    with pytest.raises(EagleExportError, match="--quantize must be int4 or int8, got int2"):
        QuantizeOptions(bits=2).check()
    QuantizeOptions(bits=8, block_size=256, accuracy_level=0).check()


# ---------------------------------------------------------------------------------------------------------------
# validate on a quantized artifact


def test_validate_quantized_artifact(int4):
    """Every graph equals the PyTorch model holding the dequantized weights at the float tolerances (on the parity
    copy), greedy and EAGLE match it, the artifact is lossless at its own settings, and the drift against the
    unquantized model is reported."""
    from eagle_export.tools.commands.validate import validate

    report = validate(int4[2], prompts=2, max_new_tokens=10, threads=1)
    assert report.passed, report.format()
    trees = {name for name, _ in C.tree_graphs(load_manifest(int4[2]).graphs).values()}
    assert trees and set(report.graphs) == {C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH, C.DRAFT_GRAPH, *trees}
    q = report.quantization
    assert q.settings["method"] == "int4" and q.parity_level == 1
    assert q.lossless_prompts == 2 and q.lossless_tokens == 20
    assert q.positions > 20 and 0 <= q.top1_agreement < 1 and q.mean_kl > 1e-4  # int4 moved the distributions
    assert "drift vs the unquantized model" in report.format()
    assert report.to_dict()["quantization"]["drift_vs_unquantized"]["positions"] == q.positions
    # A one-row call computes its row bit for bit as the first of a wider call does (the fused graph's padding).
    assert q.one_row_diff == 0.0 and "computes its row as a verify does (fused graph, bit for bit): yes" in \
        report.format()


def test_a_tied_lm_head_is_quantized_as_a_copy_of_the_embeddings_transpose(models):
    """A tied target's lm_head is MatMul(x, Transpose(embed_tokens.weight)): the export quantizes a copy of the
    transpose and drops the Transpose (ONNX Runtime would fold it into a second float copy), the embedding stays
    float for the Gather and the draft's table, and validate passes against the dequantized copy; EAGLE stays
    equal to the artifact's --no-draft."""
    from eagle_export.tools.commands.validate import validate

    art = models(**{**SMALL, "preset": "tied"}, quantize=QuantizeOptions(bits=4))[2]
    m = load_manifest(art)
    layers = m.target.num_layers
    assert m.quantization.matmuls[C.TARGET_GRAPH] == 7 * layers + 1
    assert m.quantization.matmuls[C.TARGET_FUSED_GRAPH] == 5 * layers + 1
    for g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH):
        model = onnx.load(str(art / f"{g}.onnx"), load_external_data=False)
        readers = [n.op_type for n in model.graph.node if "embed_tokens.weight" in n.input]
        assert readers == ["Gather"] and _float_matmul_weights(art / f"{g}.onnx") == [], (g, readers)
        inits = {t.name: t for t in model.graph.initializer}
        assert inits["embed_tokens.weight"].data_type == onnx.TensorProto.FLOAT
    assert m.draft_embedding.dtype == "float32"
    report = validate(art, prompts=2, max_new_tokens=10, threads=1)
    assert report.passed, report.format()


def test_validate_with_only_the_targets_lm_head_quantized(int8):
    """int8, the target's lm_head quantized and the draft graphs float: the EAGLE-1/2 head reads the target's lm_head,
    so its reference keeps a float copy of it (with the dequantized one the draft's rounds would differ from the
    oracle's)."""
    from eagle_export.tools.commands.validate import validate

    report = validate(int8[2], prompts=2, max_new_tokens=10, threads=1)
    assert report.passed, report.format()


def test_drift_of_the_float_model_is_zero(models):
    """The drift measure itself: the float artifact against its own float model agrees everywhere."""
    from eagle_export.export.checkpoint.loaders import load_target
    from eagle_export.tools.commands.validate.quant import QuantReport, measure_drift

    art = models(**SMALL)[2]
    m = load_manifest(art)
    lm = load_target(m.target.source, progress=False).model
    report = QuantReport({})
    measure_drift(art, m, lm, [[5, 9, 3, 7, 1, 22, 30], [4, 4, 4]], 1, report)
    assert report.positions == 10 and report.top1_agreement == 1.0 and report.mean_kl < 1e-6


def test_validate_fails_a_wrong_scale(int4, tmp_path):
    """A planted quantization bug: one block scale 1.5x too large in the standard graph (qdq) and one in the fused
    graph (MatMulNBits). validate compares with weights rebuilt from the checkpoint, so both graphs fail and the
    draft graph, untouched, passes."""
    import shutil

    from onnx import numpy_helper

    from eagle_export.tools.commands.validate import validate

    art = tmp_path / "art"
    shutil.copytree(int4[2], art)
    for graph, suffix in ((C.TARGET_GRAPH, "_scale"), (C.TARGET_FUSED_GRAPH, "_scales")):
        path = art / f"{graph}.onnx"
        model = onnx.load(str(path), load_external_data=False)
        t = next(i for i in model.graph.initializer if i.name.endswith(suffix))
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t, str(art)) * np.float32(1.5), t.name))
        onnx.save_model(model, str(path))
    report = validate(art, prompts=0, threads=1)
    assert not report.passed
    assert not report.graphs[C.TARGET_GRAPH].passed and not report.graphs[C.TARGET_FUSED_GRAPH].passed
    assert report.graphs[C.DRAFT_GRAPH].passed


def _fold_concats_in_memory(model: onnx.ModelProto) -> None:
    """The fused graph's packed QKV as one float initializer, made whole in memory (what the pass streams)."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    keep = []
    for n in g.node:
        if n.op_type == "Concat" and all(x in inits and len(inits[x].dims) == 2 for x in n.input):
            axis = next(a.i for a in n.attribute if a.name == "axis")
            parts = [numpy_helper.to_array(inits[x]) for x in n.input]
            g.initializer.append(numpy_helper.from_array(np.concatenate(parts, axis=axis), n.output[0]))
        else:
            keep.append(n)
    del g.node[:]
    g.node.extend(keep)
    read = {x for n in g.node for x in n.input}
    kept = [t for t in g.initializer if t.name in read]  # the parts no other node reads go
    del g.initializer[:]
    g.initializer.extend(kept)


@pytest.mark.parametrize("draft, lm_head", [(True, True), (False, True), (False, False)],
                         ids=["with-draft", "target-only", "float-lm-head"])
def test_streamed_pass_writes_the_graph_pass_tensors(models, tmp_path, draft, lm_head):
    """`export --quantize` streams each weight to its graph's new data file and re-points the float tensors a graph
    keeps at their new offsets (export/quantization/artifact.py). Every graph it leaves holds the same nodes and, tensor
    by tensor, the same bytes as the graph pass run in memory on the float graph (quantize_matmuls, the packed QKV
    concatenated whole); the graphs it does not quantize read the same float bytes as before."""
    import shutil

    from eagle_export.export.graphs.fused import pad_one_row_attention
    from eagle_export.export.quantization.artifact import inline_identity_weights, quantize_artifact_graphs
    from eagle_export.export.quantization.matmuls import quantize_matmuls, skip_lm_head

    float_art = models(**SMALL)[2]
    work = tmp_path / "art"
    shutil.copytree(float_art, work)
    trees = [name for name, _ in C.tree_graphs(load_manifest(work).graphs).values()]
    graphs = [g for g in (C.TARGET_GRAPH, C.DRAFT_GRAPH, C.TARGET_FUSED_GRAPH, *trees)
              if (work / f"{g}.onnx").is_file()]
    assert C.TARGET_FUSED_GRAPH in graphs and trees and set(trees) <= set(graphs)
    quantize_artifact_graphs(work, QuantizeOptions(bits=4, draft=draft, lm_head=lm_head), graphs)
    for g in graphs:
        ref = onnx.load(str(float_art / f"{g}.onnx"))  # with its data
        if draft or not (g == C.DRAFT_GRAPH or C.is_tree_graph(g)):
            if g == C.TARGET_FUSED_GRAPH:
                _fold_concats_in_memory(ref)
            if C.is_tree_graph(g):
                inline_identity_weights(ref)
            quantize_matmuls(ref, 4, 32, True, accuracy_level=4, form="qdq" if g in C.ENGINE_GRAPHS else "nbits",
                             predicate=skip_lm_head if g in (C.TARGET_GRAPH, C.TARGET_FUSED_GRAPH) and not lm_head
                             else None)
            if g == C.TARGET_FUSED_GRAPH:
                pad_one_row_attention(ref)
        got = onnx.load(str(work / f"{g}.onnx"))
        assert [n.SerializeToString() for n in got.graph.node] == [n.SerializeToString() for n in ref.graph.node], g
        tensors = {t.name: (t.data_type, list(t.dims), t.raw_data) for t in got.graph.initializer}
        assert tensors == {t.name: (t.data_type, list(t.dims), t.raw_data) for t in ref.graph.initializer}, g


def test_quantized_tree_graph_grows_the_quantized_step_graphs_trees(int4):
    """The int4 artifact's draft tree graph (MatMulNBits written directly) against its draft step graph
    (DequantizeLinear -> MatMul, fused by ONNX Runtime at the manifest's accuracy level), round by round: the same
    verify trees and the same acceptance, in one draft call a round. Greedy tokens alone cannot show a draft that
    drifts (the target corrects it)."""
    art = int4[2]
    m = load_manifest(art)
    one = EagleRuntime.open(art, threads=1)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False)
    assert one.backend.tree_graph == C.DRAFT_TREE_GRAPH and levels.backend.tree_graph is None
    rng = np.random.default_rng(5)
    rounds = accepted = 0
    # the export's default (a chain: quantized exports narrow it) and a branching tree
    for tree in (m.tree_defaults, TreeParams(top_k=2, depth=2, total_tokens=6)):
        for _ in range(4):
            prompt = rng.integers(3, 48, int(rng.integers(2, 30))).tolist()
            got, got_trees = _traced(one, prompt, tree)
            want, want_trees = _traced(levels, prompt, tree)
            assert got.tokens == want.tokens
            assert got_trees == want_trees, (tree, prompt)  # round by round: tree tokens, parents, accepted path
            assert got.stats.draft_forwards == got.stats.rounds < want.stats.draft_forwards
            rounds += got.stats.rounds
            accepted += sum(got.stats.accept_lengths)
    assert accepted >= 8, f"{accepted} draft tokens accepted in {rounds} rounds: multi-token commits barely compared"


def _traced(rt: EagleRuntime, prompt: list[int], tree: TreeParams):
    trees: list[tuple] = []

    def keep(vt, acc):
        trees.append((vt.tokens.tolist(), vt.parents.tolist(), acc.indices.tolist()))

    return rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False, tree=tree, on_round=keep), trees

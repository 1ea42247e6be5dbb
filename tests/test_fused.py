"""The fused target graph (graph contract 4: GroupQueryAttention writing a whole-buffer cache in place) against
transformers' own models, brute force over tree paths; its cache writes; its weights stored once; the runtime's
choice of graph and its commit of accepted rows.

The lossless suites (test_lossless, test_batched, test_sampling_lossless, ...) run the fused graph too: every
artifact whose head_dim is a multiple of 16 (the mha, qwen2, qwen3, tied presets and the fixture) runs it on
ONNX Runtime; the gqa, headdim and mistral presets (head_dim 8 or 24) run the standard graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from model_table import EAGLE3_MODELS

from eagle_export import contract as C
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.kv_cache import FusedKVCache
from eagle_export.runtime.tree import VerifyTree
from eagle_export.tools.commands.validate.graphs import FusedAsStandard

TOL = 1e-4


def hf_model(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def feed(m, ids, pos, mask, rows, past):
    out = {C.INPUT_IDS: np.asarray(ids, np.int64)[None], C.POSITION_IDS: np.asarray(pos, np.int64)[None],
           C.ATTENTION_MASK: mask[None], C.LOGIT_INDICES: np.asarray(rows, np.int64)[None]}
    out.update(zip(C.past_names(m.target.num_layers), past, strict=True))
    return out


@pytest.mark.parametrize("preset, kw", [
    *[pytest.param(p, {}, id=p) for p in ("mha", "qwen2", "qwen3", "tied", "llama3rope")],
    pytest.param(*EAGLE3_MODELS["qwen3-d2t-ownembed"], id="qwen3-eagle3"),
])
def test_fused_graph_equals_transformers_on_every_tree_path(models, preset, kw):
    """Prefill a prompt through the fused graph, then verify a random tree over that cache: each row's logits (and
    EAGLE-3 features) equal transformers' forward over the prompt plus that node's root-to-node path. Catches a
    wrong tree bias, wrong positions (rotary inside the operator), a cache read at the wrong rows, a wrong packed
    QKV, and any write outside the call's rows (the buffers are checked around them)."""
    target_dir, _, art = models(preset, **kw)
    m = load_manifest(art)
    assert C.TARGET_FUSED_GRAPH in m.graphs
    run = FusedAsStandard(art / m.graphs[C.TARGET_FUSED_GRAPH].file, m)
    lm = hf_model(target_dir)
    t = m.target
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, t.vocab_size, 9)
    empty = [np.zeros((1, 0, t.kv_heads, t.head_dim), np.float32) for _ in range(2 * t.num_layers)]
    n = len(prompt)
    out, touched = run(feed(m, prompt, np.arange(n), np.tri(n, dtype=bool), np.arange(n), empty))
    assert not touched
    with torch.no_grad():
        ref = lm(torch.tensor(prompt)[None], output_hidden_states=True)
    assert np.abs(out[C.LOGITS][0] - ref.logits[0].numpy()).max() < TOL
    past = [out[name] for name in C.present_names(t.num_layers)]

    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    tokens = rng.integers(0, t.vocab_size, len(parents))
    vt = VerifyTree.from_parents(tokens, parents)
    T = len(parents)
    mask = np.concatenate([np.ones((T, n), bool), vt.mask], axis=1)
    out, touched = run(feed(m, vt.tokens, n + vt.depths, mask, np.arange(T), past))
    assert not touched
    for i in range(T):
        path, j = [], i
        while j >= 0:
            path.append(int(vt.tokens[j]))
            j = int(vt.parents[j])
        seq = torch.tensor(np.concatenate([prompt, path[::-1]]))[None]
        with torch.no_grad():
            r = lm(seq, output_hidden_states=True)
        assert np.abs(out[C.LOGITS][0, i] - r.logits[0, -1].numpy()).max() < TOL, f"node {i}"
        if t.feature_layers is not None:
            want = torch.cat([r.hidden_states[k][0, -1] for k in t.feature_layers]).numpy()
            assert np.abs(out[C.FEATURES][0, i] - want).max() < TOL, f"features of node {i}"


def test_fused_artifact_stores_each_weight_once_and_packs_qkv(models):
    """The fused graph points at the standard graph's weights (its own data holds no matrix), and each attention
    reads one packed QKV MatMul (key and value inputs empty)."""
    _, _, art = models("mha")
    m = load_manifest(art)
    g = onnx.load(str(art / m.graphs[C.TARGET_FUSED_GRAPH].file), load_external_data=False)
    locations = {e.value for i in g.graph.initializer for e in i.external_data if e.key == "location"}
    assert locations == {f"{C.TARGET_GRAPH}.onnx.data"}
    gqa = [n for n in g.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == m.target.num_layers
    assert all(n.input[1] == "" and n.input[2] == "" for n in gqa)
    assert not (art / f"{C.TARGET_FUSED_GRAPH}.onnx.data").exists()


def test_runtime_runs_the_fused_graph_where_the_operator_supports_the_target(models):
    """ONNX Runtime runs the fused target graph (and loads no standard target session); a head_dim the operator
    does not take (8) has no fused graph and runs the standard one. (The step graph opens when first run.)"""
    _, _, art = models("mha")
    rt = EagleRuntime.open(art)
    tree = rt.manifest.tree_defaults
    tree_call = C.tree_call(tree.top_k, tree.depth)  # the default tree's draft tree graph, cut to its depth
    assert rt.generator.fused and set(rt.backend.graphs) == {C.TARGET_FUSED_GRAPH, tree_call}
    _, _, art = models("gqa")
    assert C.TARGET_FUSED_GRAPH not in load_manifest(art).graphs
    rt = EagleRuntime.open(art)
    assert not rt.generator.fused and set(rt.backend.graphs) == {C.TARGET_GRAPH, tree_call}


# What a fused call computes besides its layers: the embedding and first norm, the mask as a bias, the cache
# lengths, and the gather of the rows whose logits are asked for. 16 nodes, each run on every call.
CALL_NODES = 16


def _ort_optimized_ops(path) -> list[str]:
    """Op types of a graph as ONNX Runtime's CPU provider runs it (all optimisations, written back out)."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = f"{tmp}/optimized.onnx"
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        g = onnx.load(f"{tmp}/optimized.onnx", load_external_data=False).graph
        return [n.op_type for n in g.node], [n.op_type for n in g.node if "logits" in n.output]


def test_fused_call_runs_no_shape_arithmetic(models):
    """Outside its layers a fused call runs a handful of nodes: a traced ``expand`` to a traced size (or a width
    read from a tensor's shape) adds a Shape/Concat/Reshape/Equal/Where chain that ONNX Runtime runs on every call,
    and a float32 ``.float()`` a Cast onto the logits that it does not remove; on a one-millisecond step each such
    node costs about 1%."""
    _, _, art = models("mha")
    m = load_manifest(art)
    ops, logits_from = _ort_optimized_ops(art / m.graphs[C.TARGET_FUSED_GRAPH].file)
    layer_ops = {"MatMul", "FusedMatMul", "Gemm", "GroupQueryAttention", "SkipSimplifiedLayerNormalization",
                 "Mul", "Sigmoid", "QuickGelu"}
    per_call = [op for op in ops if op not in layer_ops]
    assert ops.count("GroupQueryAttention") == m.target.num_layers
    assert not {"Reshape", "Equal", "ConstantOfShape", "Concat"} & set(per_call), sorted(per_call)
    assert len(per_call) <= CALL_NODES, sorted(per_call)
    assert logits_from != ["Cast"], "a float32 graph casts its logits to float32"


@pytest.mark.parametrize("past", [11, 14])
@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2, 5], [0, 1, 4, 5, 9], [0], [0, 3]])
def test_fused_cache_commit_moves_the_accepted_rows(rows, past):
    """commit(slot, L, past + rows) leaves slot's rows [L, L + n) = the rows the verify wrote at past + rows, every
    other slot and the committed rows untouched. Catches runs copied from the wrong offset, a skipped run, and
    moving another slot's rows."""
    cache = FusedKVCache(2, 2, 4, 40, torch.float32, 3, lambda shape, dt: torch.zeros(shape, dtype=dt))
    rng = np.random.default_rng(0)
    cache._all.copy_(torch.from_numpy(rng.standard_normal(tuple(cache._all.shape)).astype(np.float32)))
    before = cache._all.clone()
    L = 11  # past > L: a batch's common past above this slot's committed rows
    cache.commit(1, L, np.asarray(rows) + past)
    after = cache._all
    want = before.clone()
    want[:, 1, :, L:L + len(rows)] = before[:, 1, :, [past + r for r in rows]]
    assert torch.equal(after, want)

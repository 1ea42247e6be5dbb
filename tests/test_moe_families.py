"""Qwen3-MoE, gpt-oss and Llama 4 text targets (export/graphs/families.py), tiny random models with the published
configs'
structure (tools/testing/tiny_models presets): greedy EAGLE on ONNX Runtime equals transformers' greedy generate,
with prompts of 3-5x gpt-oss's sliding window and Llama 4's attention chunk; routed experts touch only the selected
experts, which hold every one the call's tokens picked (TopK in the standard graph, which TensorRT-RTX builds and
whose TensorRT path, emulated, is lossless too; NonZero only in the fused graph); MLA and hybrid linear-attention
targets are refused by name.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import onnx
import pytest
import torch
from reference import Comparison, GreedyReference

from eagle_export import contract as C
from eagle_export.engines.builder import BuildOptions, build_engines
from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.loaders import load_target
from eagle_export.export.graphs.families import STATIC, UNION, layer_mlp, moe_forward, moe_kind, select_experts
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.testing.tiny_models import make_tiny_target
from eagle_export.tools.testing.trt_emulator import emulated_runtime
from eagle_export.tree_params import TreeLimits, TreeParams

NEW_TOKENS = 32
WINDOW = 8  # the gpt_oss preset's sliding_window and the llama4 preset's attention_chunk_size
TREES = (TreeParams(top_k=1, depth=5, total_tokens=5), TreeParams(top_k=4, depth=3, total_tokens=10))

# name -> (preset, ModelFactory keywords, fused graph expected, MoE layers of the 3- or 4-layer target)
FAMILIES = {
    "qwen3_moe-eagle3": ("qwen3_moe", dict(eagle3=True, draft_vocab=32), True, 2),
    "qwen3_moe-eagle1": ("qwen3_moe", dict(fc_bias=True), True, 2),
    "gpt_oss-eagle3": ("gpt_oss", dict(eagle3=True, draft_vocab=32), False, 4),
    "llama4-eagle3": ("llama4", dict(eagle3=True), False, 2),
}


def expert_selections(path) -> tuple[int, int]:
    """(NonZero nodes, TopK nodes whose K the graph computes) of an ONNX graph: the routed-expert selections,
    UNION's and STATIC's (a router's TopK has a constant K)."""
    g = onnx.load(str(path), load_external_data=False).graph
    const = {i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    return (sum(n.op_type == "NonZero" for n in g.node),
            sum(n.op_type == "TopK" and n.input[1] not in const for n in g.node))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_lossless_past_the_window(models, name):
    """Prompts of 3x and 5x the window then 32 new tokens, a chain and a tree, plus no-draft
    decoding: token for token transformers' greedy generate. Catches a window or chunk left out of the mask (or
    off by one), sinks ignored, a wrong routing (top-k, normalisation, sigmoid input scale), a wrong expert
    layout (gpt-oss's interleaved gate/up, clamp, biases), Llama 4's rotary pairs, NoPE, QK norm or temperature.
    The artifact's graphs: the fused one only where GroupQueryAttention expresses the target (Qwen3-MoE), which
    selects the hit experts exactly (one NonZero per MoE layer); the standard graph, which TensorRT builds and
    ONNX Runtime runs for gpt-oss and Llama 4, selects them with a TopK of a shape-computed K and has no NonZero
    (TensorRT-RTX 1.7.1's parser has none)."""
    preset, kw, fused, moe_layers = FAMILIES[name]
    target, _, art = models(preset, **kw)
    m = load_manifest(art)
    assert (C.TARGET_FUSED_GRAPH in m.graphs) == fused
    assert expert_selections(art / m.graphs[C.TARGET_GRAPH].file) == (0, moe_layers)
    if fused:
        assert expert_selections(art / m.graphs[C.TARGET_FUSED_GRAPH].file) == (moe_layers, 0)
    rt = EagleRuntime.open(art, threads=1, guard=False)  # a random head: the guard would stop drafting
    ref = GreedyReference(target)
    cmp = Comparison()
    accepted = 0
    rng = np.random.default_rng(0)
    for n in (3 * WINDOW, 5 * WINDOW):
        prompt = rng.integers(3, m.target.vocab_size, n).tolist()
        want = ref.generate(prompt, NEW_TOKENS)
        res = rt.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, use_draft=False, stop_on_eos=False)
        ref.compare(prompt, res.tokens, want, cmp, "no-draft")
        for tree in TREES:
            res = rt.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, tree=tree, stop_on_eos=False)
            ref.compare(prompt, res.tokens, want, cmp, f"tree {tree}")
            accepted += sum(res.stats.accept_lengths)
    print(f"\n{name}: {cmp.tokens} tokens compared, {cmp.ties} ties, {accepted} draft tokens accepted")
    assert not cmp.failures, "\n".join(cmp.failures[:5])
    assert cmp.ties == 0
    assert cmp.tokens == 6 * NEW_TOKENS
    assert accepted > 0


def _picks(mlp, kind: str, x: torch.Tensor) -> torch.Tensor:
    """The experts each token of x picks [N, top_k], from the router's logits as transformers ranks them (gpt-oss's
    router has a bias)."""
    router = mlp.gate if kind == "qwen3_moe" else mlp.router
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), router.weight,
                                        router.bias if kind == "gpt_oss" else None)
    return torch.topk(logits, router.top_k, dim=-1).indices


@pytest.mark.parametrize("selection", [STATIC, UNION])
@pytest.mark.parametrize("preset", ["qwen3_moe", "gpt_oss", "llama4"])
def test_moe_computes_only_the_selected_experts(tmp_path, preset, selection):
    """For 1, 2 (picking 2 x top_k distinct experts) and 5 tokens: the selection holds every picked expert and is
    exactly top_k experts for one token; STATIC's is min(tokens x top_k, experts) (UNION's the picked ones). The
    experts outside the selection are poisoned with NaN, the selected ones no token picked with 1e3: the block's
    output still equals transformers' (on the clean weights) and is finite. A formulation that computed every
    expert (dense, weights multiplied by zero routing) would be NaN: the cost follows the selection. A STATIC K
    too small at 2 tokens drops a picked expert; a selected unpicked expert whose output (or gpt-oss's bias) is not
    weighted to zero adds its 1e3-scale output; K over the expert count fails in TopK."""
    t = load_target(make_tiny_target(tmp_path / "t", preset, with_tokenizer=False, vocab_size=48))
    layer = next(la for la in t.model.model.layers if moe_kind(layer_mlp(la)) is not None)
    mlp = layer_mlp(layer)
    kind = moe_kind(mlp)
    n_exp, top_k = mlp.experts.gate_up_proj.shape[0], (mlp.gate if kind == "qwen3_moe" else mlp.router).top_k
    for n in (1, 2, 5):
        with torch.no_grad():
            for seed in range(100):  # 2 tokens: inputs whose picks are all distinct, so a K of 2 x top_k is tight
                x = torch.randn(1, n, t.config.hidden_size, generator=torch.Generator().manual_seed(seed))
                idx = _picks(mlp, kind, x)
                picked = set(idx.flatten().tolist())
                if n != 2 or len(picked) == n * top_k:
                    break
            assert n != 2 or len(picked) == n * top_k
            sel = select_experts(idx, n_exp, selection).tolist()
            assert picked <= set(sel) and len(sel) == len(set(sel))
            assert len(sel) == (min(n * top_k, n_exp) if selection == STATIC else len(picked))
            want = mlp(x)  # transformers' block on the clean weights (Llama 4's runs every expert)
            want = want[0] if isinstance(want, tuple) else want
            saved = {k: v.clone() for k, v in mlp.experts.state_dict().items()}
            outside = [e for e in range(n_exp) if e not in sel]
            idle = [e for e in sel if e not in picked]
            assert n > 1 or not idle
            for p in mlp.experts.parameters():
                p[outside] = float("nan")
                p[idle] = 1e3
            got = moe_forward(mlp, kind, x, selection)
            mlp.experts.load_state_dict(saved)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.reshape(want.shape), want, atol=1e-5, rtol=1e-5)


def test_static_selection_graph_computes_k_from_each_call(tmp_path):
    """STATIC's selection exported alone (traced at 3 tokens) and run by ONNX Runtime at 1-6 tokens of top-2 picks
    over 8 experts: every picked expert ascending, then the lowest unpicked ones, min(tokens x 2, 8) in all, as
    eager torch gives. Catches a K the trace froze, a K from the token count alone (drops picked experts at
    2-3 tokens), a K not capped at the expert count (TopK fails), an unpicked expert ranked before a picked one."""
    import onnxruntime as ort

    class Select(torch.nn.Module):
        def forward(self, idx):
            return select_experts(idx, 8)

    path = tmp_path / "select.onnx"
    with warnings.catch_warnings():  # the eager forward's K, traced at 3 tokens; the symbolic emits it from shapes
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(Select(), (torch.tensor([[0, 1], [2, 3], [4, 5]]),), str(path), dynamo=False,
                          opset_version=17, input_names=["idx"], output_names=["sel"], dynamic_axes={"idx": {0: "n"}})
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for n in range(1, 7):
        for _ in range(10):
            idx = np.stack([rng.choice(8, 2, replace=False) for _ in range(n)])
            hit = sorted(set(idx.flatten().tolist()))
            want = (hit + [e for e in range(8) if e not in hit])[:min(2 * n, 8)]
            assert sess.run(None, {"idx": idx})[0].tolist() == want
            assert select_experts(torch.from_numpy(idx), 8).tolist() == want


ENGINE_TREE = TreeParams(top_k=4, depth=3, total_tokens=12)  # the engines' largest verify (13 tokens)
ENGINE_CHAIN = TreeParams(top_k=1, depth=3, total_tokens=3)


@pytest.mark.parametrize("preset", ["qwen3_moe", "gpt_oss", "llama4"])
def test_moe_engines_build_with_tensorrt_rtx_and_are_lossless(models, tmp_path, preset):
    """TensorRT-RTX builds both graphs of each MoE family (its parser has no NonZero: the standard graph selects
    experts with TopK), and the TensorRT backend, emulated on the CPU (tools/testing/trt_emulator.py runs the
    engines' source graphs with ONNX Runtime under TensorRT's rules), is token for token transformers' greedy on a
    prompt of 3x the window (prefilled in 16-token chunks), with a tree, a chain and no draft: the standard graph's
    K follows each call's shape (1-token steps, 4- and 13-token verifies, 16-token chunks). For Qwen3-MoE this is
    the only run of its standard graph (ONNX Runtime runs the fused one)."""
    target, _, src = models(preset, eagle3=True, draft_vocab=32, max_seq_len=64,
                            limits=TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12))
    art = shutil.copytree(src, tmp_path / "art")
    m = build_engines(art, BuildOptions(engine_lib="tensorrt-rtx", max_prefill=16), progress=False)
    assert m.engines is not None and set(m.engines.graphs) == {*C.ENGINE_GRAPHS, C.tree_call(4, 3)}
    assert expert_selections(art / m.graphs[C.TARGET_GRAPH].file)[0] == 0
    rt = emulated_runtime(art)
    ref = GreedyReference(target)
    cmp = Comparison()
    prompt = np.random.default_rng(1).integers(3, m.target.vocab_size, 3 * WINDOW).tolist()
    want = ref.generate(prompt, 20)
    for tree in (ENGINE_TREE, ENGINE_CHAIN, None):
        got = rt.generate(prompt_ids=prompt, max_new_tokens=20, tree=tree, use_draft=tree is not None,
                          stop_on_eos=False)
        ref.compare(prompt, got.tokens, want, cmp, f"tree {tree}")
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.ties == 0 and cmp.tokens == 3 * 20
    used = {(g, a[C.NEW_TOKENS]) for g, _, a in rt.backend.emulator.executions if g == C.TARGET_GRAPH}
    assert {(C.TARGET_GRAPH, w) for w in (1, 4, 13, 16)} <= used, sorted(used)


@pytest.mark.parametrize("config, words", [
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, ["DeepSeek V3", "latent KV cache"]),
    ({"model_type": "kimi_k2", "kv_lora_rank": 512}, ["Kimi K2", "latent"]),
    ({"model_type": "mistral3", "text_config": {"model_type": "ministral3", "kv_lora_rank": 512}},
     ["an MLA model (ministral3)", "latent KV cache"]),
    ({"model_type": "qwen3_next"}, ["Qwen3-Next", "recurrent state", "rolled back"]),
    ({"model_type": "qwen3_5_moe"}, ["Qwen3.5", "recurrent state"]),
    ({"model_type": "somehybrid", "layer_types": ["linear_attention", "full_attention"]},
     ["hybrid linear-attention model (somehybrid)"]),
    ({"model_type": "llama4"}, ["Llama4ForConditionalGeneration", "Llama4ForCausalLM"]),
])
def test_mla_and_hybrid_targets_refused_by_name(tmp_path, config, words):
    """One line naming the family and what its support needs, before any weights are read."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        load_target(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg

"""Qwen3-MoE, gpt-oss and Llama 4 text targets (export/families.py), tiny random models with the published configs'
structure (tools/testing/tiny_models presets): greedy EAGLE on ONNX Runtime equals transformers' greedy generate,
with prompts of 3-5x gpt-oss's sliding window and Llama 4's attention chunk; routed experts touch only the experts
the call's tokens picked; MLA and hybrid linear-attention targets are refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from reference import Comparison, GreedyReference

from eagle_export import contract as C
from eagle_export.errors import CheckpointError
from eagle_export.export.families import layer_mlp, moe_forward, moe_kind
from eagle_export.export.loaders import load_target
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.testing.tiny_models import make_tiny_target
from eagle_export.tree_params import TreeParams

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


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_lossless_past_the_window(models, name):
    """Prompts of 3x and 5x the window then 32 new tokens, a chain and a tree, plus no-draft
    decoding: token for token transformers' greedy generate. Catches a window or chunk left out of the mask (or
    off by one), sinks ignored, a wrong routing (top-k, normalisation, sigmoid input scale), a wrong expert
    layout (gpt-oss's interleaved gate/up, clamp, biases), Llama 4's rotary pairs, NoPE, QK norm or temperature.
    The artifact's graphs: the fused one only where GroupQueryAttention expresses the target (Qwen3-MoE); the
    standard graph computes the experts from the hit ones (one NonZero per MoE layer)."""
    preset, kw, fused, moe_layers = FAMILIES[name]
    target, _, art = models(preset, **kw)
    m = load_manifest(art)
    assert (C.TARGET_FUSED_GRAPH in m.graphs) == fused
    g = onnx.load(str(art / m.graphs[C.TARGET_GRAPH].file), load_external_data=False)
    assert sum(n.op_type == "NonZero" for n in g.graph.node) == moe_layers
    rt = EagleRuntime.open(art, threads=1)
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


@pytest.mark.parametrize("preset", ["qwen3_moe", "gpt_oss", "llama4"])
def test_moe_touches_only_the_picked_experts(tmp_path, preset):
    """The experts no token of the call picked are poisoned with NaN: the block's output still equals transformers'
    (on the clean weights) and is finite, for 1 and 2 tokens. A formulation that computed every expert
    (dense, weights multiplied by zero routing) would be NaN: the cost follows the active experts."""
    t = load_target(make_tiny_target(tmp_path / "t", preset, with_tokenizer=False, vocab_size=48))
    layer = next(la for la in t.model.model.layers if moe_kind(layer_mlp(la)) is not None)
    mlp = layer_mlp(layer)
    kind = moe_kind(mlp)
    router = mlp.gate if kind == "qwen3_moe" else mlp.router
    torch.manual_seed(0)
    for n in (1, 2):
        x = torch.randn(1, n, t.config.hidden_size)
        with torch.no_grad():
            logits = torch.nn.functional.linear(x.reshape(n, -1), router.weight)
            picked = set(torch.topk(logits, router.top_k, dim=-1).indices.flatten().tolist())
            if kind == "gpt_oss":  # its router has a bias
                logits = logits + router.bias
                picked = set(torch.topk(logits, router.top_k, dim=-1).indices.flatten().tolist())
            unpicked = [e for e in range(router.weight.shape[0]) if e not in picked]
            assert unpicked
            want = mlp(x)  # transformers' block on the clean weights (Llama 4's runs every expert)
            want = want[0] if isinstance(want, tuple) else want
            saved = {k: v.clone() for k, v in mlp.experts.state_dict().items()}
            for p in mlp.experts.parameters():
                p[unpicked] = float("nan")
            got = moe_forward(mlp, kind, x)
            mlp.experts.load_state_dict(saved)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.reshape(want.shape), want, atol=1e-5, rtol=1e-5)


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

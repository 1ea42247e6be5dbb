"""Tiny model settings shared by several test modules (same factory keys: each artifact is exported once)."""

from __future__ import annotations

# name -> (target preset, ModelFactory keywords) for EAGLE-3 heads on each supported target family.
EAGLE3_MODELS: dict[str, tuple[str, dict]] = {
    # Llama (GQA, 3 layers: feature layers 2, 1, 0 -> [0, 1, 2]); draft vocabulary 32 of 48 (random d2t).
    "llama-d2t": ("gqa", dict(eagle3=True, draft_vocab=32)),
    # Qwen2 (q/k/v biases); draft vocabulary = target vocabulary, no d2t buffers (identity).
    "qwen2-identity": ("qwen2", dict(eagle3=True)),
    # Qwen3 (q/k norms, head_dim 32 != 64/4, tied embeddings); d2t; the head's own embedding table.
    "qwen3-d2t-ownembed": ("qwen3", dict(eagle3=True, draft_vocab=32, own_embedding="random")),
    # Mistral (sliding window 4096 > capacity); a head narrower than its target (hidden 32, target_hidden_size 64).
    "mistral-narrow": ("mistral", dict(eagle3=True, draft_hidden=32, own_embedding="random")),
}

# Every published head format and variant (checkpoint-formats.md), written by tools/tiny_models from the document:
# name -> (target preset, ModelFactory keywords, detected format, feature layers as inputs of target layers).
# Targets with 8 layers give the three default layers distinct values (2, 4, 5).
FORMAT_MODELS: dict[str, tuple[str, dict, str, list[int] | None]] = {
    # Qwen2 target; a Qwen2 EAGLE-1 head: q/k/v biases ("qkv_bias": true), no "bias" key (= fc bias).
    "eagle1-qkvbias-nobiaskey": ("qwen2", dict(fc_bias=True, head=(("bias_key", False), ("qkv_bias", True))),
                                 "reference-eagle1", None),
    # HASS norms, two layers (layer 1 is a pre-norm Llama layer).
    "eagle1-hass-2layers": ("gqa", dict(head=(("hass", True), ("num_layers", 2))), "reference-eagle1", None),
    # SpecForge: eagle_config ids in the output-of-layer convention (1, 3, 4 -> inputs 2, 4, 5), fc_norm,
    # norm_output (EAGLE-3.1 feedback), a smaller draft vocabulary.
    "specforge-fcnorm-normout": ("mha", dict(eagle3=True, draft_vocab=32, num_hidden_layers=8, head=(
        ("layout", "specforge"), ("feature_ids", (1, 3, 4)), ("fc_norm", True), ("norm_output", True))),
        "specforge-eagle3", [2, 4, 5]),
    # speculators Eagle3Speculator: top-level ids (input convention), norm_before_residual absent (= true, as vLLM
    # reads it), norm_before_fc (input_norm), two layers (layers.0, layers.1), its own embedding.
    "speculators-2layers": ("gqa", dict(eagle3=True, own_embedding="random", num_hidden_layers=8, head=(
        ("layout", "speculators"), ("feature_ids", (1, 3, 6)), ("norm_before_fc", True), ("num_layers", 2))),
        "speculators-eagle3", [1, 3, 6]),
    # ModelOpt (layers.N naming): no ids in the config (default sorted {1, L//2-1, L-4} outputs = inputs 2, 4, 5),
    # two layers (layer 1's pre-norm named hidden_norm), d2t with a smaller draft vocabulary, no t2d.
    "modelopt-layers-2layers": ("mha", dict(eagle3=True, draft_vocab=32, num_hidden_layers=8, head=(
        ("layout", "modelopt"), ("num_layers", 2))), "modelopt-eagle3", [2, 4, 5]),
    # ModelOpt before 2026-03 (midlayer.* naming), ids (output convention) in eagle_config, lm_head over the full
    # vocabulary and no d2t.
    "modelopt-midlayer": ("mistral", dict(eagle3=True, num_hidden_layers=8, head=(
        ("layout", "modelopt-midlayer"), ("feature_ids", (0, 2, 5)))), "modelopt-eagle3", [1, 3, 6]),
    # Reference EAGLE-3 on a 6-layer target: the default layers 2, L//2, L-3 = 2, 3, 3 (a repeat).
    "reference-eagle3-6layers": ("mha", dict(eagle3=True, draft_vocab=32, num_hidden_layers=6),
                                 "reference-eagle3", [2, 3, 3]),
}

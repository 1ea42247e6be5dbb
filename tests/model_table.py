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

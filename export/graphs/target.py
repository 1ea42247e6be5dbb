"""The target verify graph's module (traced to ``target_verify``, run eagerly as the parity reference): one forward
over T new tokens with the tree mask, returning the requested rows' logits, the draft's features and the new K/V."""

from __future__ import annotations

import torch
from torch import nn

from .attention import kv_group, mask_bias, rope_tables, tree_attention
from .families import (
    STATIC,
    key_positions,
    layer_plans,
    mlp_forward,
    plan_mask,
    rope_cos_sin,
)


class TargetVerify(nn.Module):
    """Target forward over T new tokens: logits for the requested rows, draft features, new K/V.

    feature_layers=None gives the last hidden state after the final norm (EAGLE-1/2);
    a list of layer indices gives the *inputs* of those decoder layers (hidden_states[i] in
    transformers' output_hidden_states numbering), concatenated in the list's order (EAGLE-3); an index
    may repeat (a 6-layer target's reference layers are 2, 3, 3).
    ``expert_selection``: a MoE target's routed experts (families.py): ``STATIC`` (``TopK``, which TensorRT builds)
    by default; ``UNION`` (``NonZero``) only for measuring it (tools/lab/moe_cost.py).
    """

    def __init__(self, causal_lm: nn.Module, feature_layers: list[int] | None = None, expert_selection: str = STATIC):
        super().__init__()
        self.expert_selection = expert_selection
        base = causal_lm.model
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = causal_lm.lm_head
        self.feature_layers = list(feature_layers) if feature_layers is not None else None
        self.plans = layer_plans(causal_lm.config)
        if self.feature_layers is not None:
            n = len(self.layers)
            if not all(0 <= i < n for i in self.feature_layers):
                raise ValueError(f"feature_layers {self.feature_layers} must be layer indices in [0, {n})")

    def forward(self, input_ids, position_ids, attention_mask, logit_indices, *past):
        # Sizes, rotary tables and mask bias once per graph, shared by every layer.
        bsz, seq = input_ids.shape
        past_len = past[0].shape[1]
        h = self.embed_tokens(input_ids)
        attn0 = self.layers[0].self_attn
        hd = attn0.head_dim
        if any(p.rope == "interleaved" for p in self.plans):
            rope = tuple(t.unsqueeze(2) for t in rope_cos_sin(self.rotary_emb, h, position_ids, hd))
        else:
            rope = rope_tables(self.rotary_emb, h, position_ids, hd)
        # One bias per distinct layer mask (full, each window, each chunk size), built once per graph.
        kpos = key_positions(position_ids, past_len) if any(p.span for p in self.plans) else None
        biases = {}
        for p in self.plans:
            key = (p.mask, p.span)
            if key not in biases:
                biases[key] = mask_bias(plan_mask(attention_mask, p, position_ids, kpos), kv_group(attn0))
        presents = []
        taps = {}
        for i, layer in enumerate(self.layers):
            if self.feature_layers is not None and i in self.feature_layers:
                taps[i] = h
            plan = self.plans[i]
            a, k, v = tree_attention(layer.self_attn, layer.input_layernorm(h), rope, biases[(plan.mask, plan.span)],
                                     past[2 * i], past[2 * i + 1], bsz, seq, past_len, plan, position_ids)
            h = h + a
            h = h + mlp_forward(layer, layer.post_attention_layernorm(h), self.expert_selection)
            presents += [k, v]
        return target_outputs(self.norm(h), taps, self.feature_layers, logit_indices, self.lm_head, presents)


def target_outputs(normed, taps: dict, feature_layers: list[int] | None, logit_indices, lm_head, presents: list):
    """A target graph's outputs: logits of the requested rows (float32), the draft features (the final-norm hidden
    state, or the tapped layer inputs concatenated in ``feature_layers`` order), then the K/V outputs."""
    if feature_layers is None:
        feats = normed
    else:
        feats = torch.cat([taps[i] for i in feature_layers], -1)
    # The width as a Python int, not normed.shape[-1]: traced, that is a chain of shape nodes (Shape, Gather,
    # Unsqueeze, Concat, Reshape, Equal, Where) that ONNX Runtime runs on every call; a constant folds away.
    width = int(lm_head.weight.shape[-1])
    rows = torch.gather(normed, 1, logit_indices.unsqueeze(-1).expand(-1, -1, width))
    logits = lm_head(rows)
    # No Cast when the logits are float32 already: a Cast onto a graph output is not removed by ONNX Runtime.
    return (logits if logits.dtype == torch.float32 else logits.float(), feats, *presents)

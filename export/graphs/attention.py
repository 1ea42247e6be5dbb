"""Tree attention, shared by every traced graph: the rotary tables, the mask (the tree mask over the new tokens and
the cache columns, as an additive bias per KV group; windows and chunks where a layer has them), and attention over an
explicit cache.

The modules reuse the Hugging Face modules' weights and rotary embedding but own the attention: K/V come from an
explicit cache in the contract's BSHD layout, keys are masked by one boolean mask over [past + new] columns, and the
cache is never concatenated (scores against past and new keys are computed separately), so the graph does not copy
the cache."""

from __future__ import annotations

import torch
from torch import nn

from .families import (
    LayerPlan,
    l2_norm,
    rope_cos_sin,
    rotate_interleaved,
    sink_column,
    temperature_scale,
)

MASK_MIN = torch.finfo(torch.float32).min


def rope_tables(rotary_emb: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, head_dim: int):
    """cos and sign-folded sin, [B, T, 1, hd], computed once per graph and shared by every layer.

    rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2) exactly (negation is exact), so each
    layer rotates with one split and one concat, and the sign is folded into sin here once.
    """
    cos, sin = rope_cos_sin(rotary_emb, x, position_ids, head_dim)
    s1, s2 = sin.split([head_dim // 2, head_dim // 2], dim=-1)
    return cos.unsqueeze(2), torch.cat((-s1, s2), dim=-1).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x: [B, T, heads, hd]; cos/sin_signed from ``rope_tables``. Same values as HF's x*cos + rotate_half(x)*sin.

    head_dim is given as a Python int (not read from x) so the trace splits with constant sizes.
    """
    x1, x2 = x.split([head_dim // 2, head_dim // 2], dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin_signed


def mask_bias(attention_mask: torch.Tensor, group: int) -> torch.Tensor:
    """bool [B, T, S] -> additive float32 bias [B, 1, group*T, S], rows in the grouped query order (g*T + t).

    Computed once per graph; every layer adds it to its scores as they are.
    """
    zero = torch.zeros((), dtype=torch.float32)
    bias = torch.where(attention_mask, zero, torch.full((), MASK_MIN, dtype=torch.float32))
    return bias.unsqueeze(1).repeat(1, 1, group, 1)


def window_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """attention_mask [B, T, past + T] narrowed to keys at distance < window from their query (sliding window).

    A key's position is its column for past rows and its ``position_ids`` entry for the call's own rows. The runtime
    keeps the draft cache so that every context row's column is its position, and tree rows sit at columns at or past
    their positions, so a column never puts a visible key further away than it is (docs/formats.md, "Sliding window").
    """
    bsz, seq = position_ids.shape
    past_len = attention_mask.shape[-1] - seq
    cols = torch.arange(past_len, dtype=position_ids.dtype).unsqueeze(0).expand(bsz, past_len)
    key_pos = torch.cat((cols, position_ids), dim=1)
    return attention_mask & ((position_ids.unsqueeze(-1) - key_pos.unsqueeze(1)) < window)


def layer_biases(head: nn.Module, attention_mask: torch.Tensor, position_ids: torch.Tensor, group: int) -> list:
    """One additive mask bias per draft layer: the full one, or the sliding-window one on the head's window layers
    (each computed once per graph)."""
    opts = head.opts
    full = mask_bias(attention_mask, group)
    if not opts.sliding_window or not opts.sliding_layers:
        return [full] * head.num_layers
    win = mask_bias(window_mask(attention_mask, position_ids, opts.sliding_window), group)
    return [win if i in opts.sliding_layers else full for i in range(head.num_layers)]


def kv_group(attn: nn.Module) -> int:
    """Query heads per KV head of a Hugging Face attention module."""
    return attn.q_proj.out_features // attn.k_proj.out_features


def tree_attention(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   bias: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, bsz, seq, past_len,
                   plan: LayerPlan | None = None, position_ids: torch.Tensor | None = None):
    """Attention of T new tokens over [past rows | new rows] with an explicit mask.

    attn: a Hugging Face attention module (q/k/v/o projections, optional q_norm/k_norm).
    rope: ``rope_tables``; bias: ``mask_bias``; bsz, seq, past_len: the graph's dynamic sizes,
    read once from its inputs and passed to every layer, so the traced shape arithmetic is the
    same nodes in every layer (ONNX Runtime merges them); head counts are Python ints (constants).
    plan: the target layer's ``families.LayerPlan`` (None: Llama's half-split rotary); with rope "interleaved"
    the ``rope`` tables are half-width (Llama 4), with None the layer has no rotary. A module with ``sinks``
    (gpt-oss) gets one more score column per head, dropped after the softmax. position_ids: for the temperature.
    Returns (output [B, T, H_out], new K [B, T, nKV, hd], new V [B, T, nKV, hd]).
    """
    hd = attn.head_dim
    n_heads, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
    q = attn.q_proj(x).view(bsz, seq, n_heads, hd)
    k = attn.k_proj(x).view(bsz, seq, n_kv, hd)
    v = attn.v_proj(x).view(bsz, seq, n_kv, hd)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    style = "half" if plan is None else plan.rope
    if style == "half":
        q = apply_rope(q, *rope, hd)
        k = apply_rope(k, *rope, hd)
    elif style == "interleaved":
        q = rotate_interleaved(q, *rope)
        k = rotate_interleaved(k, *rope)
    if plan is not None and plan.qk_l2_eps is not None:
        q = l2_norm(q, plan.qk_l2_eps)
        k = l2_norm(k, plan.qk_l2_eps)
    if plan is not None and plan.temperature is not None:
        q = (q * temperature_scale(position_ids, *plan.temperature)).to(q.dtype)
    # Group query heads by their KV head: [B, nH, T, hd] is [B, nKV, group, T, hd], viewed as
    # [B, nKV, group*T, hd] (row g*T + t); no K/V repeat.
    qg = q.transpose(1, 2).reshape(bsz, n_kv, -1, hd)
    s_past = torch.matmul(qg, past_k.permute(0, 2, 3, 1))
    s_new = torch.matmul(qg, k.permute(0, 2, 3, 1))
    scores = torch.cat((s_past, s_new), dim=-1).float() * attn.scaling + bias
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        scores = torch.cat((scores, sink_column(sinks, n_kv, bsz, seq)), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1].to(x.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
    out = torch.matmul(probs[..., :past_len], past_v.transpose(1, 2))
    out = out + torch.matmul(probs[..., past_len:], v.transpose(1, 2))
    out = out.view(bsz, n_heads, -1, hd).transpose(1, 2).reshape(bsz, -1, n_heads * hd)
    return attn.o_proj(out), k, v

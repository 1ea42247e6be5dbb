"""What the target families beyond Llama's decoder-layer shape need in the verify graph: each layer's attention
pattern (full, sliding window, chunked), its rotary style (half-split, interleaved, none), learned attention sinks,
Llama 4's QK L2 norm and attention temperature, and routed-expert (MoE) MLPs.

Windows and chunks are applied in the mask, computed inside the graph from the positions: a committed cache row
``j`` holds the token at position ``j`` (the runtime commits accepted rows in order), and the call's new rows carry
their ``position_ids``. So the preallocated cache keeps full rows, and a sliding layer's mask also drops the keys
``window`` or more positions behind the query (transformers' ``kv_idx > q_idx - window``), a chunked layer's the keys
in another ``chunk``-sized block (``kv_idx // chunk == q_idx // chunk``).

Routed experts are computed over a *selection of experts that holds every one the call's tokens picked*
(``moe_forward``): the selected experts' weights are gathered by index and every token of the call runs through
them, weighted by its (dense, zero where unpicked) routing weights, so a selected expert no token picked adds exact
zeros. Two selections (``STATIC``, ``UNION``):

- ``STATIC`` (the standard graph, which TensorRT builds): ``TopK`` of ``K = min(N * top_k, experts)`` experts, N
  the call's tokens (a shape-only value), the hit experts first; TensorRT-RTX has no ``NonZero``. A 1-token step
  reads top_k experts, a verify of T tokens exactly min(T * top_k, experts).
- ``UNION`` (the fused graph, which only ONNX Runtime runs): exactly the hit experts (``NonZero``), at most
  min(T * top_k, experts).

A long prefill reads them all (the dense case). Standard ONNX ops (ScatterElements, TopK or NonZero, Gather, MatMul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"
STATIC, UNION = "static", "union"  # moe_forward's expert selections (module docstring)


@dataclass(frozen=True)
class LayerPlan:
    """How one target decoder layer attends: mask kind and size, rotary style, QK L2 norm, temperature tuning."""

    mask: str = FULL  # FULL | SLIDING | CHUNKED
    span: int | None = None  # the window (SLIDING) or chunk size (CHUNKED)
    rope: str | None = "half"  # "half" (rotate_half), "interleaved" (Llama 4's complex pairs), None (NoPE layer)
    qk_l2_eps: float | None = None  # Llama 4: L2 norm on q and k after rotary
    temperature: tuple[float, float] | None = None  # Llama 4 NoPE layers: (attn_scale, floor_scale)


def layer_plans(config) -> list[LayerPlan]:
    """One plan per decoder layer, read from a transformers config as its modeling code applies it."""
    n = config.num_hidden_layers
    mt = config.model_type
    if mt == "llama4_text":
        chunk = getattr(config, "attention_chunk_size", None)
        plans = []
        for i in range(n):
            use_rope = bool(config.no_rope_layers[i])
            chunked = config.layer_types[i] == "chunked_attention" and chunk
            plans.append(LayerPlan(
                mask=CHUNKED if chunked else FULL, span=int(chunk) if chunked else None,
                rope="interleaved" if use_rope else None,
                qk_l2_eps=float(config.rms_norm_eps) if config.use_qk_norm and use_rope else None,
                temperature=((float(config.attn_scale), float(config.floor_scale))
                             if config.attn_temperature_tuning and not use_rope else None)))
        return plans
    window = getattr(config, "sliding_window", None)
    if not window:
        return [LayerPlan() for _ in range(n)]
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral: one window on every layer
        return [LayerPlan(SLIDING, int(window)) for _ in range(n)]
    return [LayerPlan(SLIDING, int(window)) if t == "sliding_attention" else LayerPlan() for t in types]


def windowed(plans: list[LayerPlan], reach: int) -> list[int]:
    """Layers whose window or chunk is narrower than ``reach`` positions (there the mask matters)."""
    return [i for i, p in enumerate(plans) if p.mask != FULL and p.span < reach]


def key_positions(position_ids: torch.Tensor, past_len) -> torch.Tensor:
    """[B, past + T]: cache row j is position j; the new rows are at their position_ids."""
    bsz = position_ids.shape[0]
    past = torch.arange(past_len, dtype=position_ids.dtype, device=position_ids.device).unsqueeze(0).expand(bsz, -1)
    return torch.cat((past, position_ids), dim=1)


def plan_mask(attention_mask: torch.Tensor, plan: LayerPlan, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """The boolean mask [B, T, S] of a layer with this plan: the tree mask, narrowed by its window or chunk."""
    if plan.mask == FULL:
        return attention_mask
    q, k = qpos.unsqueeze(2), kpos.unsqueeze(1)
    if plan.mask == SLIDING:
        return attention_mask & (q - k < plan.span)
    return attention_mask & (torch.div(q, plan.span, rounding_mode="floor")
                             == torch.div(k, plan.span, rounding_mode="floor"))


def rope_cos_sin(rotary_emb: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, head_dim: int):
    """(cos, sin) [B, T, hd] in rotate_half form from any transformers rotary module: Llama's full-width tables as
    they are, gpt-oss's half-width ones doubled, Llama 4's complex ``freqs_cis`` (interleaved pairs) as its real and
    imaginary parts [B, T, hd/2]."""
    if getattr(getattr(rotary_emb, "config", None), "model_type", None) == "llama4_text":
        # Llama 4's module returns complex freqs_cis; the same values without complex ops (ONNX has none)
        freqs = position_ids[..., None].float() * rotary_emb.inv_freq.float()
        scale = rotary_emb.attention_scaling
        return (freqs.cos() * scale).to(x.dtype), (freqs.sin() * scale).to(x.dtype)
    cos, sin = rotary_emb(x, position_ids)
    if cos.shape[-1] * 2 == head_dim:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos, sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama 4's rotary: (x[2i], x[2i+1]) as a complex number times cos + i sin. x [B, T, heads, hd],
    cos/sin [B, T, 1, hd/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    xe, xo = pairs[..., 0], pairs[..., 1]
    out = torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's QK norm: RMS normalisation without a weight, in float32."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scale(position_ids: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    """Llama 4's query scale on NoPE layers, [B, T, 1, 1]: log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1."""
    p = position_ids.float()
    return (torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0)[..., None, None]


def sink_column(sinks: torch.Tensor, n_kv: int, bsz, seq) -> torch.Tensor:
    """gpt-oss's learned sinks as one extra score column [B, nKV, group*T, 1] in the grouped row order (g*T + t)."""
    group = sinks.shape[0] // n_kv
    col = sinks.float().view(1, n_kv, group, 1, 1).expand(bsz, n_kv, group, seq, 1)
    return col.reshape(bsz, n_kv, -1, 1)


# ----------------------------------------------------------------------------------------------------------------
# MLPs
# ----------------------------------------------------------------------------------------------------------------


def layer_mlp(layer: nn.Module) -> nn.Module:
    """The layer's feed-forward module (``mlp``; Llama 4: ``feed_forward``)."""
    mlp = getattr(layer, "mlp", None)
    return mlp if mlp is not None else layer.feed_forward


def moe_kind(mlp: nn.Module) -> str | None:
    """"qwen3_moe", "gpt_oss", "llama4" for a routed-expert block, None for a dense MLP."""
    if not hasattr(mlp, "experts"):
        return None
    if hasattr(mlp, "shared_expert") and hasattr(mlp, "router"):
        return "llama4"
    if hasattr(mlp, "router"):
        return "gpt_oss"
    if hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj"):
        return "qwen3_moe"
    raise NotImplementedError(f"unknown routed-expert block {type(mlp).__name__}")


def mlp_forward(layer: nn.Module, x: torch.Tensor, selection: str = STATIC) -> torch.Tensor:
    """The layer's feed-forward over x [B, T, H]: the dense MLP, or routed experts over the selected experts only
    (``selection``: ``STATIC`` or ``UNION``, see the module docstring)."""
    mlp = layer_mlp(layer)
    kind = moe_kind(mlp)
    if kind is None:
        return mlp(x)
    return moe_forward(mlp, kind, x, selection)


def _routing(mlp: nn.Module, kind: str, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert ids [N, k], dense routing weights [N, E], zero off the picked experts), as each family routes."""
    if kind == "qwen3_moe":
        g = mlp.gate
        probs = torch.softmax(nn.functional.linear(xs, g.weight).float(), dim=-1)
        top, idx = torch.topk(probs, g.top_k, dim=-1)
        if g.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        n_exp = g.weight.shape[0]
    elif kind == "gpt_oss":
        r = mlp.router
        logits = nn.functional.linear(xs, r.weight, r.bias)
        top, idx = torch.topk(logits, r.top_k, dim=-1)
        top = torch.softmax(top, dim=1)
        n_exp = r.weight.shape[0]
    else:  # llama4: sigmoid of the picked logits; it scales the experts' *input*
        r = mlp.router
        logits = nn.functional.linear(xs, r.weight)
        top, idx = torch.topk(logits, r.top_k, dim=1)
        top = torch.sigmoid(top.float())
        n_exp = r.weight.shape[0]
    dense = xs.new_zeros(xs.shape[0], n_exp).scatter(1, idx, top.to(xs.dtype))
    return idx, dense


class HitExperts(torch.autograd.Function):
    """The indices of the nonzero entries of a 1-D vector, ascending (ONNX ``NonZero``, then ``Squeeze``). Traced on
    the meta device (the lean export), where ``nonzero`` has no kernel, it stands in every index: only the trace's
    shapes matter there, and the emitted node is the same."""

    @staticmethod
    def forward(ctx, hit: torch.Tensor) -> torch.Tensor:
        if hit.is_meta:
            return torch.empty(hit.shape[0], dtype=torch.long, device="meta")
        return torch.nonzero(hit).squeeze(1)

    @staticmethod
    def symbolic(g, hit):
        axes = g.op("Constant", value_t=torch.tensor([0], dtype=torch.long))
        return g.op("Squeeze", g.op("NonZero", hit), axes)


class TopExperts(torch.autograd.Function):
    """The K = min(picks.numel(), len(rank)) entries of ``rank`` [E] ranked highest (ONNX ``TopK``). K is a
    shape-only value (``Size`` -> ``Min``), so the output's size does not depend on the data: TensorRT builds it.
    Traced with the tracing call's sizes; the emitted node computes K from each call's."""

    @staticmethod
    def forward(ctx, rank: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        k = min(picks.shape[0] * picks.shape[1], rank.shape[0])
        if rank.is_meta:
            return torch.empty(k, dtype=torch.long, device="meta")
        return torch.topk(rank, k).indices

    @staticmethod
    def symbolic(g, rank, picks):
        one = g.op("Constant", value_t=torch.tensor([1], dtype=torch.long))
        n = g.op("Reshape", g.op("Size", picks), one)  # [1]: tokens x top_k
        k = g.op("Min", n, g.op("Shape", rank))  # [1]: at most every expert
        _, ids = g.op("TopK", rank, k, axis_i=0, largest_i=1, sorted_i=1, outputs=2)
        return ids


def select_experts(idx: torch.Tensor, n_exp: int, selection: str = STATIC) -> torch.Tensor:
    """The experts ``moe_forward`` computes, given the call's picks ``idx`` [N, top_k]: every picked one, ascending.
    ``UNION``: exactly those. ``STATIC``: then the lowest unpicked ones up to min(N x top_k, experts) in all (a
    size fixed by the call's shape; their routing weights are zero)."""
    flat = idx.reshape(-1)
    hit = torch.zeros(n_exp, dtype=torch.float32, device=idx.device).scatter(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=idx.device))
    if selection == UNION:
        return HitExperts.apply(hit)
    # Distinct ranks: a hit expert e ranks n_exp - e (> 0), an unhit one -e (<= 0); exact in float32.
    rank = hit * n_exp - torch.arange(n_exp, dtype=torch.float32, device=idx.device)
    return TopExperts.apply(rank, idx)


def moe_forward(mlp: nn.Module, kind: str, x: torch.Tensor, selection: str = STATIC) -> torch.Tensor:
    """Routed experts over a selection holding every expert the call's tokens picked (see the module docstring)."""
    bsz, seq, hidden = x.shape
    xs = x.reshape(-1, hidden)
    idx, dense = _routing(mlp, kind, xs)
    ex = mlp.experts
    sel = select_experts(idx, dense.shape[1], selection)  # [M]
    w = dense[:, sel].transpose(0, 1).unsqueeze(-1)  # [M, N, 1]
    if kind == "qwen3_moe":  # gate_up [E, 2I, H], down [E, H, I]: x @ W^T
        gu = torch.matmul(ex.gate_up_proj[sel], xs.transpose(0, 1)).transpose(1, 2)  # [M, N, 2I]
        gate, up = gu.chunk(2, dim=-1)
        h = ex.act_fn(gate) * up
        y = torch.matmul(ex.down_proj[sel], h.transpose(1, 2)).transpose(1, 2)  # [M, N, H]
        y = y * w
    elif kind == "gpt_oss":  # gate_up [E, H, 2I] interleaved (gate even, up odd), biases; clamped SwiGLU
        gu = torch.matmul(xs.unsqueeze(0), ex.gate_up_proj[sel]) + ex.gate_up_proj_bias[sel].unsqueeze(1)
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(max=ex.limit)
        up = up.clamp(min=-ex.limit, max=ex.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * ex.alpha))
        y = torch.matmul(h, ex.down_proj[sel]) + ex.down_proj_bias[sel].unsqueeze(1)
        y = y * w
    else:  # llama4: experts(x * weight), gate_up [E, H, 2I] chunked, no biases; plus the shared expert
        gu = torch.matmul(xs.unsqueeze(0) * w, ex.gate_up_proj[sel])
        gate, up = gu.chunk(2, dim=-1)
        y = torch.matmul(up * ex.act_fn(gate), ex.down_proj[sel])
    out = y.sum(dim=0)
    if kind == "llama4":
        out = mlp.shared_expert(xs) + out
    return out.view(bsz, seq, hidden)

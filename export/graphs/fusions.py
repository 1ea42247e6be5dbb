"""The fusions: ONNX Runtime contrib operators the fused target graph is traced to, one ``torch.autograd.Function``
each. Run eagerly, a function computes the operator's math in PyTorch (the parity reference and the tracer's
shapes); traced, its ``symbolic`` emits the contrib node.

- ``GroupQueryAttention`` (``com.microsoft``): attention with rotary inside, over a past and present that share one
  whole-capacity BNSH buffer, the new rows written in place, the tree mask as ``attention_bias``;
- ``SkipRMSNorm`` (``com.microsoft.SkipSimplifiedLayerNormalization``): the residual add and the RMS norm as one op.

MatMulNBits, the other contrib op an artifact uses, is written by ``export/quantization`` over a finished graph."""

from __future__ import annotations

import torch

MS = "com.microsoft"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved rotary (transformers' rotate_half convention); x [B, T, heads, hd], cos/sin [B, T, 1, hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GroupQueryAttention(torch.autograd.Function):
    """ONNX Runtime's ``com.microsoft.GroupQueryAttention`` with rotary inside, a shared past/present buffer and an
    additive attention bias. Eager: the same math in PyTorch (the present buffers are new tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, position_ids, bias,
                num_heads: int, kv_heads: int, scale: float):
        if torch.jit.is_tracing():  # the exporter emits ``symbolic``; only the shapes matter (out is q-shaped)
            return q.clone(), past_k.clone(), past_v.clone()
        B, T, _ = q.shape
        hd = past_k.shape[-1]
        total = bias.shape[-1]
        past = total - T
        cos = cos_cache[position_ids].unsqueeze(2)
        sin = sin_cache[position_ids].unsqueeze(2)
        qh = _rotate(q.view(B, T, num_heads, hd), cos, sin)
        kh = _rotate(k.view(B, T, kv_heads, hd), cos, sin)
        vh = v.view(B, T, kv_heads, hd)
        present_k, present_v = past_k.clone(), past_v.clone()
        present_k[:, :, past:total] = kh.transpose(1, 2)
        present_v[:, :, past:total] = vh.transpose(1, 2)
        keys, values = present_k[:, :, :total], present_v[:, :, :total]
        group = num_heads // kv_heads
        qg = qh.transpose(1, 2).reshape(B, kv_heads, group * T, hd)
        scores = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * scale
        scores = scores.view(B, kv_heads, group, T, total) + bias.float().unsqueeze(1)
        probs = torch.softmax(scores, dim=-1).view(B, kv_heads, group * T, total)
        out = torch.matmul(probs, values.float()).to(q.dtype)
        out = out.view(B, num_heads, T, hd).transpose(1, 2).reshape(B, T, num_heads * hd)
        return out, present_k, present_v

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, position_ids, bias,
                 num_heads, kv_heads, scale):
        out, pk, pv = g.op(f"{MS}::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total_len,
                           cos_cache, sin_cache, position_ids, bias, num_heads_i=num_heads, kv_num_heads_i=kv_heads,
                           scale_f=scale, do_rotary_i=1, rotary_interleaved_i=0, outputs=3)
        out.setType(q.type())
        pk.setType(past_k.type())
        pv.setType(past_v.type())
        return out, pk, pv


class SkipRMSNorm(torch.autograd.Function):
    """``com.microsoft.SkipSimplifiedLayerNormalization``: s = x + skip, out = RMSNorm(s) * gamma; returns (out, s).
    Eager: transformers' LlamaRMSNorm math (float32 inside, cast back before the weight)."""

    @staticmethod
    def forward(ctx, x, skip, gamma, eps: float):
        if torch.jit.is_tracing():
            return x.clone(), x.clone()
        s = x + skip
        f = s.float()
        out = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        return gamma * out.to(s.dtype), s

    @staticmethod
    def symbolic(g, x, skip, gamma, eps):
        out, _mean, _inv, s = g.op(f"{MS}::SkipSimplifiedLayerNormalization", x, skip, gamma, epsilon_f=eps,
                                   outputs=4)
        out.setType(x.type())
        s.setType(x.type())
        return out, s

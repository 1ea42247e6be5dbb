"""The fused target verify graph for ONNX Runtime: ``GroupQueryAttention`` writing the cache in place, rotary inside
it, and skip + RMS norm as one op (``SkipSimplifiedLayerNormalization``), as onnxruntime-genai's models have.

Traced from ``FusedTargetVerify``, whose two fused steps are ``torch.autograd.Function``s (``fusions.py``): run eagerly
they compute
the operator's math in PyTorch (the parity reference and the tracer's shapes), traced they emit the ONNX Runtime
contrib node. So one module is both the graph's source and its reference, and everything else (the lean path,
the weights' external data) is the standard graph's machinery.

The cache contract (graph contract 4, ``eagle_export/contract.py``): each layer's K and V are one buffer
``[batch, kv_heads, capacity, head_dim]`` (BNSH), bound as both ``past_*`` and ``present_*``. The attention mask's
width ``total_len`` says where the call's rows go: the ``new_tokens`` rows are written at rows
``[total_len - new_tokens, total_len)`` of every sequence's buffer, and attention reads rows ``[0, total_len)``
under the mask. Nothing else of the cache is read or copied."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

from .attention import MASK_MIN
from .families import UNION, mlp_forward
from .fusions import MS, GroupQueryAttention, SkipRMSNorm
from .target import target_outputs


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rope_cache(rotary_emb: nn.Module, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim / 2] from a transformers rotary embedding (its scaling and attention factor
    included), for GroupQueryAttention's rotary inside. Computed in float32, then cast."""
    pos = torch.arange(positions).unsqueeze(0)
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary_emb(probe, pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].to(dtype).contiguous(), sin[0, :, :half].to(dtype).contiguous()


class FusedTargetVerify(nn.Module):
    """The target over T new tokens with fused attention writing the cache in place (contract 4's cache IO).

    Same outputs as ``modules.TargetVerify`` (logits of the requested rows, draft features), and the updated
    cache buffers as ``present_*`` (the same memory as ``past_*`` when bound so). ``positions``: rows of the rotary
    cache, at least the largest position id a call may carry.
    """

    def __init__(self, causal_lm: nn.Module, feature_layers: list[int] | None, positions: int,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        base = causal_lm.model
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.lm_head = causal_lm.lm_head
        self.feature_layers = list(feature_layers) if feature_layers is not None else None
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scale = float(attn.scaling)
        if rope is None:
            rope = rope_cache(base.rotary_emb, positions, self.lm_head.weight.dtype)
        self.register_buffer("cos_cache", rope[0], persistent=False)
        self.register_buffer("sin_cache", rope[1], persistent=False)

    def _attention(self, layer: nn.Module, x: torch.Tensor, past_k, past_v, seqlens_k, total, position_ids, bias):
        attn = layer.self_attn
        B, T, _ = x.shape
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMS norm before rotary
            q = attn.q_norm(q.view(B, T, self.num_heads, self.head_dim)).view(B, T, -1)
            k = attn.k_norm(k.view(B, T, self.kv_heads, self.head_dim)).view(B, T, -1)
        out, pk, pv = GroupQueryAttention.apply(q, k, v, past_k, past_v, seqlens_k, total, self.cos_cache,
                                                self.sin_cache, position_ids, bias, self.num_heads, self.kv_heads,
                                                self.scale)
        return attn.o_proj(out), pk, pv

    def forward(self, input_ids, position_ids, attention_mask, logit_indices, *cache):
        dtype = self.cos_cache.dtype
        # Sizes as tensors, so the trace keeps them dynamic: total_len from the mask, one seqlens_k per sequence.
        total32 = torch._shape_as_tensor(attention_mask)[2].to(torch.int32)
        # expand_as, not expand(bsz): a traced expand to a traced size adds a chain of shape nodes per call.
        seqlens_k = (total32 - 1).expand_as(input_ids[:, 0])
        zero = torch.zeros((), dtype=dtype)
        bias = torch.where(attention_mask, zero, torch.full((), MASK_MIN, dtype=torch.float32).to(dtype))
        bias = bias.unsqueeze(1)  # [B, 1, T, total]
        h = self.embed_tokens(input_ids)
        presents = []
        taps = {}
        first = self.layers[0].input_layernorm
        x = first(h)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            if self.feature_layers is not None and i in self.feature_layers:
                taps[i] = h
            a, pk, pv = self._attention(layer, x, cache[2 * i], cache[2 * i + 1], seqlens_k, total32, position_ids,
                                        bias)
            post = layer.post_attention_layernorm
            x, h = SkipRMSNorm.apply(a, h, post.weight, _eps(post))
            m = mlp_forward(layer, x, UNION)  # only ONNX Runtime runs this graph: NonZero's exact union
            nxt = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            x, h = SkipRMSNorm.apply(m, h, nxt.weight, _eps(nxt))
            presents += [pk, pv]
        return target_outputs(x, taps, self.feature_layers, logit_indices, self.lm_head, presents)


def pack_qkv(model) -> int:
    """Give each GroupQueryAttention one packed QKV MatMul, as onnxruntime-genai's graphs have: where its query, key
    and value are MatMuls of the same input by 2-D initializers, they become one MatMul by the initializers'
    ``Concat`` (axis 1), whose output is GroupQueryAttention's packed query (key and value left empty).

    The Concat stays a node over the initializers the standard graph also holds (so the artifact stores them once);
    ONNX Runtime folds it into one packed weight when it loads the graph. Returns the attentions packed."""
    from onnx import helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            consumers[x] = consumers.get(x, 0) + 1
    packed = 0
    drop: set[int] = set()
    new_nodes: dict[int, list] = {}
    for node in g.node:
        if node.op_type != "GroupQueryAttention" or node.domain != MS:
            continue
        mms = [producer.get(x) for x in node.input[:3]]
        if any(m is None or m.op_type != "MatMul" or consumers.get(m.output[0]) != 1 for m in mms):
            continue
        if len({m.input[0] for m in mms}) != 1 or any(m.input[1] not in inits or len(inits[m.input[1]].dims) != 2
                                                        for m in mms):
            continue
        base = mms[0].output[0]
        w = f"{base}.qkv_weight"
        y = f"{base}.qkv"
        cat = helper.make_node("Concat", [m.input[1] for m in mms], [w], name=f"{mms[0].name}/QKVConcat", axis=1)
        mm = helper.make_node("MatMul", [mms[0].input[0], w], [y], name=f"{mms[0].name}/QKV")
        for m in mms:
            drop.add(id(m))
        new_nodes[id(node)] = [cat, mm]
        node.input[0], node.input[1], node.input[2] = y, "", ""
        packed += 1
    nodes = []
    for n in g.node:
        if id(n) in drop:
            continue
        nodes.extend(new_nodes.get(id(n), []))
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return packed


# Name prefix of the nodes and constants ``pad_one_row_attention`` adds.
ONE_ROW = "/one_row_pad"


def pad_one_row_attention(model: onnx.ModelProto) -> int:
    """Make a call of one row of one sequence run its GroupQueryAttentions over two rows, as every other call does.

    ONNX Runtime's CPU GroupQueryAttention multiplies the attention probabilities by V with one MLAS GEMM of
    ``new_tokens`` rows per head, and MLAS computes a one-row product (alpha 1) with a kernel of its own
    (``MlasSgemmKernelM1Avx``: multiply then add, another summation order), where two rows or more go through the FMA
    GEMM kernel and each row's result does not depend on the others. So a plain decoding step's row differs in its
    last bits from the same row verified in a tree. A float graph barely notices; at accuracy level 4 every MatMul
    quantizes its input row to int8, where such a difference can cross a rounding boundary and move the output by a
    whole step, which the later layers and the cached K/V carry on (tools/lab/results.md, "Why quantized EAGLE
    diverged").

    Here, when the call has one row of one sequence (``batch * new_tokens == 1``), each GroupQueryAttention takes its
    packed QKV (or query, key and value) and the positions with that row repeated after it (``Pad``, edge mode), the
    sequence lengths one longer and the attention bias with a zero row and column after it; its output is sliced
    back to the call's rows. The extra row is a scratch row: the causal rule keeps it out of the real row's
    attention, and its K/V land in the cache row after the call's (row ``total_len``), which a later call writes
    before any call reads it. Other calls pad nothing (a batch of one-row sequences cannot: the operator takes
    several rows over a past for one sequence only). Cost: two small nodes per layer and a few shared ones
    (tools/lab/results.md).

    Applied to the fused graph of a quantized export (export/quantization/artifact.py). Returns the attentions
    padded."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    gqas = [x for x in g.node if x.op_type == "GroupQueryAttention" and x.domain == MS]
    if not gqas:
        return 0
    shared_inputs = tuple(gqas[0].input[i] for i in (5, 6, 9, 10))  # seqlens_k, total_len, position_ids, bias
    if any(tuple(x.input[i] for i in (5, 6, 9, 10)) != shared_inputs for x in gqas):
        raise ValueError("the GroupQueryAttention nodes do not share their lengths, positions and bias")
    seqlens, total, pos, bias = shared_inputs
    P = ONE_ROW

    def const(name: str, values) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), f"{P}/{name}"))
        return f"{P}/{name}"

    count = iter(range(1 << 30))

    def node(op: str, inputs: list[str], out: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [out], name=f"{P}/{op}_{next(count)}", **attrs)

    zero1, one, ax0, ax1 = const("zero1", [0]), const("one", 1), const("ax0", [0]), const("ax1", [1])
    zeros = {k: const(f"zeros{k}", [0] * k) for k in (3, 4, 6)}
    added: list[onnx.NodeProto] = []
    for op, inputs, out, attrs in (
        ("Size", [pos], "rows", {}),  # batch x new_tokens
        ("Equal", [f"{P}/rows", one], "is_one", {}),
        ("Cast", [f"{P}/is_one"], "pad", {"to": TensorProto.INT64}),
        ("Unsqueeze", [f"{P}/pad", ax0], "pad1", {}),
        ("Cast", [f"{P}/pad"], "pad32", {"to": TensorProto.INT32}),
        ("Shape", [pos], "new1", {"start": 1, "end": 2}),  # [new_tokens]
        ("Concat", [zeros[3], f"{P}/pad1"], "pads_pos", {"axis": 0}),  # [B, T]: T end
        ("Concat", [zeros[4], f"{P}/pad1", zero1], "pads_qkv", {"axis": 0}),  # [B, T, W]: T end
        ("Concat", [zeros[6], f"{P}/pad1", f"{P}/pad1"], "pads_bias", {"axis": 0}),  # [B, 1, T, total]: T, total ends
        ("Pad", [pos, f"{P}/pads_pos"], "position_ids", {"mode": "edge"}),
        ("Add", [seqlens, f"{P}/pad32"], "seqlens_k", {}),
        ("Add", [total, f"{P}/pad32"], "total_len", {}),
        ("Pad", [bias, f"{P}/pads_bias"], "bias", {"mode": "constant"}),  # zeros: the scratch row sees every column
    ):
        added.append(node(op, inputs, f"{P}/{out}", **attrs))
    nodes = []
    for x in g.node:
        if x.op_type == "GroupQueryAttention" and x.domain == MS:
            if x is gqas[0]:  # the shared nodes after what they read, before their first reader
                nodes += added
            for i in (0, 1, 2):  # the packed QKV, or query, key and value (Qwen3's normed q and k are not packed)
                if x.input[i]:
                    nodes.append(node("Pad", [x.input[i], f"{P}/pads_qkv"], f"{x.input[i]}{P}", mode="edge"))
                    x.input[i] = f"{x.input[i]}{P}"
            out = x.output[0]
            x.input[5], x.input[6], x.input[9], x.input[10] = (f"{P}/seqlens_k", f"{P}/total_len",
                                                               f"{P}/position_ids", f"{P}/bias")
            x.output[0] = f"{out}{P}"
            nodes.append(x)
            nodes.append(node("Slice", [f"{out}{P}", zero1, f"{P}/new1", ax1], out))
            continue
        nodes.append(x)
    del g.node[:]
    g.node.extend(nodes)
    return len(gqas)

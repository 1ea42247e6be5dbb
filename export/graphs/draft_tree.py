"""The draft tree graph: a round's whole draft work in one call.

The draft step graph (``modules.DraftStep``) runs one tree level per call, so a depth-6 tree costs seven session
calls a round (the context pass, then six levels) with Python between them. ``DraftTree`` unrolls the same steps
into one graph: the context pass over the accepted tokens' target features, then ``depth`` tree levels fed from
the draft's own output, each level's frontier chosen by top-k inside the graph, exactly as ``runtime.tree
.TreeGrower`` chooses it on the host. It returns every candidate of the tree (score, token, parent, in the
grower's generation order), from which the runtime selects the verify tree, plus the context rows' K/V (the only
draft rows the cache keeps) and the last context row's top-k and hidden (so a round may still grow its tree level
by level from them).

The graph is traced for one ``top_k`` and one ``depth``: every level's row count is a Python int, so its shapes are
constants. A graph of depth d is the first d levels of a deeper one: the export traces each top_k's graph to the
artifact's ``max_depth``, and the runtime cuts it to a round's depth (``runtime/tree_graph.py``).

What keeps a call cheap (docs/runtime.md, "The draft tree graph"): ONNX Runtime's CPU provider pays a few
microseconds per node whatever it computes, and a draft head streams its weights once per level, so the graph has
few nodes and reads each weight once a level:

- shapes are constants; the dynamic axes (batch, context rows, cache rows) pass through ``Reshape`` 0 entries and
  ``GatherND`` (``_reshape``, ``_row_at``), never through ``Shape``/``Gather``/``Concat`` chains;
- a layer's q, k and v are one MatMul; rotary embedding is one ``Gather`` (the half-swap), one Mul and one
  ReduceSum against a table made once per call for every position, in which the values' slot is cos 1, sin 0;
- the context pass computes every row's K/V but only the last row's query, attention, MLP and logits (the row a
  tree grows from) in its last layer;
- the cache is concatenated once into the attention layout ([B, kv_heads, rows, head_dim]); a level appends its
  rows and attends over all of them with one MatMul (ONNX Runtime fuses the key transpose and the scale into it),
  under one additive bias per node carried from level to level (the root's view of the context, the node's
  ancestors, itself);
- a chain (top_k 1) runs its levels on 2-D rows, where ONNX Runtime fuses each projection with its bias or its
  residual into one Gemm; a wider tree picks its frontier's rows with ``GatherND``, and the parents are computed
  once at the end.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import MASK_MIN
from .families import rope_cos_sin

# Rotary types whose frequencies are fixed (transformers' ``dynamic_rope_update`` changes the others per call).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class _Reshape(torch.autograd.Function):
    """ONNX ``Reshape`` to a constant shape whose 0 entries keep the input's dimension (one entry is -1): dynamic
    axes pass through without shape arithmetic in the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


class _RowAt(torch.autograd.Function):
    """Rows of every sequence: x [B, n, *tail], index [B, *lead, 1] -> x[b, index[b, ..., 0]], [B, *lead, *tail]
    (ONNX ``GatherND``, batch_dims 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        idx = index[..., 0]
        b = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (idx.dim() - 1)))
        return x[b, idx]

    @staticmethod
    def symbolic(g, x, index):
        return g.op("GatherND", x, index, batch_dims_i=1)


class _TakeLast(torch.autograd.Function):
    """x [..., d] at positions ``index`` (a constant of any shape) along its last axis: [..., *index.shape] (ONNX
    ``Gather``, axis -1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[..., index]

    @staticmethod
    def symbolic(g, x, index):
        return g.op("Gather", x, index, axis_i=-1)


class _PadEnd(torch.autograd.Function):
    """x (rank ``rank``) with ``n`` zeros appended to its last axis (ONNX ``Pad``, constant pads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, rank: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, n))

    @staticmethod
    def symbolic(g, x, n, rank):
        pads = [0] * (2 * rank)
        pads[-1] = n
        return g.op("Pad", x, g.op("Constant", value_t=torch.tensor(pads, dtype=torch.int64)))


class _Const(torch.autograd.Function):
    """A constant tensor in the graph. ``ref`` gives only the device: the lean export traces on the meta device,
    where a tensor made in Python has no data to put in the graph, but a symbolic's constant has."""

    @staticmethod
    def forward(ctx, ref: torch.Tensor, values: tuple, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).reshape(shape).to(ref.device)

    @staticmethod
    def symbolic(g, ref, values, dtype, shape):
        return g.op("Constant", value_t=torch.tensor(values, dtype=dtype).reshape(shape))


def _reshape(x: torch.Tensor, *shape: int) -> torch.Tensor:
    return _Reshape.apply(x, tuple(shape))


def _row_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _RowAt.apply(x, index)


def _pad_end(x: torch.Tensor, n: int) -> torch.Tensor:
    return _PadEnd.apply(x, n, x.dim())


def _const(ref: torch.Tensor, values, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    values = tuple(values)
    return _Const.apply(ref, values, dtype, shape or (len(values),))


class DraftTree(nn.Module):
    """Context pass + ``depth`` tree levels of a draft head, with the frontier selection inside the graph.

    head: ``heads.Eagle1Head`` or ``heads.Eagle3Head``. context_top_k: the width of the context row's top-k
    output (the step graph's, ``max_top_k``). top_k, depth: the tree the graph grows. plain: every weight a MatMul's
    operand (no Gemm), for weight quantization, which rewrites MatMuls (export/quantization/artifact.py).
    """

    def __init__(self, head: nn.Module, context_top_k: int, top_k: int, depth: int, plain: bool = False):
        super().__init__()
        if not 1 <= top_k <= context_top_k or depth < 1:
            raise ValueError(f"a draft tree graph needs 1 <= top_k <= {context_top_k} and depth >= 1, got top_k "
                             f"{top_k}, depth {depth}")
        self.head = head
        self.context_top_k, self.top_k, self.depth, self.plain = context_top_k, top_k, depth, plain
        self.eagle3 = head.variant == "eagle3"
        for i in range(head.num_layers):
            if getattr(self._layer(i).self_attn, "q_norm", None) is not None:
                raise ValueError("a draft tree graph takes draft layers without q_norm/k_norm")
        attn = self._layer(0).self_attn
        self.hd = attn.head_dim
        self.n_heads = attn.q_proj.out_features // self.hd
        self.n_kv = attn.k_proj.out_features // self.hd
        self.group = self.n_heads // self.n_kv
        self.hidden_size = head.fc.out_features
        opts = head.opts
        self.window = opts.sliding_window if opts.sliding_window and opts.sliding_layers else 0
        self.window_layers = set(opts.sliding_layers) if self.window else set()

    def _layer(self, i: int) -> nn.Module:
        head = self.head
        if i == 0:
            return head.midlayer if head.variant == "eagle3" else head.layers[0]
        return head.layers[str(i)] if isinstance(head.layers, nn.ModuleDict) else head.layers[i]

    # ---- the head's math, row-wise (the same as its forward_hidden) ------------------------------------------
    def _first_input(self, embeds: torch.Tensor, rows: torch.Tensor, from_features: bool):
        """The first layer's attention input and residual, for rows fed from target features (the context) or from
        the draft's own output (tree levels); as ``Eagle1Head``/``Eagle3Head.forward_hidden``."""
        head = self.head
        if not self.eagle3:
            emb = embeds.to(rows.dtype)
            if head.embed_layernorm is not None:
                emb = head.embed_layernorm(emb)
            f = rows if head.hidden_layernorm is None else head.hidden_layernorm(rows)
            x = head.fc(torch.cat((emb, f), dim=-1))
            return x, x  # layer 0 has no input norm
        h = head.fc_in(rows) if from_features else rows
        layer = head.midlayer
        emb = embeds.to(h.dtype)
        hn = layer.hidden_norm(layer.input_layernorm(h) if head.opts.hidden_input_norm else h)
        x = torch.cat((layer.input_layernorm(emb), hn), dim=-1)
        return x, (hn if head.opts.norm_before_residual else h)

    def _logprobs(self, h: torch.Tensor, k: int):
        """Top-k log-probs and target ids of rows h (the step graph's head: logits, log-softmax, top-k, id map)."""
        vals, ids = torch.topk(torch.log_softmax(self.head.logits(h), dim=-1), k, dim=-1)
        return vals, self.head.map_ids(ids)

    def _qkv(self, attn: nn.Module, x: torch.Tensor, cs: torch.Tensor, shape: tuple[int, ...], sum_axes):
        """x [..., in] -> rotated q [..., kv, group, hd], k and v [..., kv, 1, hd]: one MatMul for q, k and v, viewed
        as ``shape`` (..., kv, group + 2, hd), then ``rot * cos + rotate_half(rot) * sin`` as one Gather of both
        halves' orders, one Mul with ``cs`` (from ``_rotary``) and one ReduceSum over ``sum_axes``."""
        hd, g, nkv = self.hd, self.group, self.n_kv
        inn = attn.q_proj.in_features
        # Rows of the three projections grouped by KV head: the group's q heads, its k head, its v head.
        w = torch.cat((attn.q_proj.weight.view(nkv, g, hd, inn), attn.k_proj.weight.view(nkv, 1, hd, inn),
                       attn.v_proj.weight.view(nkv, 1, hd, inn)), 1).reshape(-1, inn)
        biases = [getattr(attn, n).bias for n in ("q_proj", "k_proj", "v_proj")]
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([(torch.zeros(m.out_features, dtype=w.dtype, device=w.device) if t is None else t)
                           .view(nkv, -1, hd) for t, m in zip(biases, (attn.q_proj, attn.k_proj, attn.v_proj),
                                                               strict=True)], 1).reshape(-1)
        p = _reshape(torch.nn.functional.linear(x, w, b), *shape)
        half = hd // 2
        order = _const(x, [*range(hd), *range(half, hd), *range(half)], torch.int64, (2, hd))
        rot = (_TakeLast.apply(p, order) * cs).sum(sum_axes)
        return rot.split([g, 1, 1], dim=-2)

    def _rotary(self, position_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Rotary factors [B, T, 1, group + 2, 2, hd] of positions [B, T]: (cos, sign * sin) for the q and k slots,
        (1, 0) for the v slot, so that ``_qkv`` rotates q and k as the step graph does and passes v through."""
        g, hd, half = self.group, self.hd, self.hd // 2
        rotary = self.head.rotary_emb
        sign = [-1.0] * half + [1.0] * half
        if getattr(rotary, "rope_type", None) in STATIC_ROPE:
            # transformers' rotary: angle = position * inv_freq (both halves), cos/sin times attention_scaling. The
            # values' slot gets angle 0 (cos 1, sin 0) and no scaling.
            inv = rotary.inv_freq.float()
            slots = _const(position_ids, [1.0] * (g + 1) + [0.0], torch.float32, (g + 2, 1))
            freq = torch.cat((inv, inv)) * slots  # [g + 2, hd]
            angle = _reshape(position_ids, 0, 0, 1, 1, -1).float() * freq  # [B, T, 1, g + 2, hd]
            scale = float(rotary.attention_scaling)
            cos, sin = angle.cos(), angle.sin()
            if scale != 1.0:
                cos = cos * _const(position_ids, [scale] * (g + 1) + [1.0], torch.float32, (g + 2, 1))
            sin = sin * _const(position_ids, [s * scale for s in sign] * (g + 1) + [0.0] * hd, torch.float32,
                               (g + 2, hd))
            cs = torch.cat((cos, sin), dim=-1).to(like.dtype)
            return _reshape(cs, 0, 0, 1, g + 2, 2, -1)
        cos, sin = rope_cos_sin(rotary, like, position_ids, hd)  # [B, T, hd] each
        cs = _reshape(torch.cat((cos, sin), dim=-1), 0, 0, 1, 1, 2, -1)  # [B, T, 1, 1, 2, hd]
        keep = [1.0] * hd + sign
        keep = _const(cs, keep * (g + 1) + [0.0] * (2 * hd), cs.dtype, (g + 2, 2, hd))
        vone = _const(cs, [0.0] * ((g + 1) * 2 * hd) + [1.0] * hd + [0.0] * hd, cs.dtype, (g + 2, 2, hd))
        return cs * keep + vone

    def _attend(self, attn: nn.Module, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                bias: torch.Tensor, out_shape: tuple[int, ...]) -> torch.Tensor:
        """q [..., kv, group, hd] over keys/values [..., kv, S, hd] under the additive float32 bias -> the heads
        concatenated, reshaped to ``out_shape`` (..., heads * hd), before o_proj."""
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * attn.scaling + bias
        out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
        return _reshape(out, *out_shape)

    def _after_attention(self, layer: nn.Module, res: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: o_proj and the residual, then the MLP and its residual. On 2-D rows each
        projection and its residual are one ``Gemm`` (the residual as its C)."""
        o_proj, mlp = layer.self_attn.o_proj, layer.mlp
        if o.dim() != 2 or self.plain or o_proj.bias is not None or mlp.down_proj.bias is not None:
            h = res + o_proj(o)
            return h + mlp(layer.post_attention_layernorm(h))
        # addmm: Gemm(A, W^T, C), W^T stored as the step graph stores it (one copy in the artifact)
        h = torch.addmm(res, o, o_proj.weight.t())
        x = layer.post_attention_layernorm(h)
        return torch.addmm(h, mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight.t())

    def _output_state(self, h: torch.Tensor) -> torch.Tensor:
        """What the head feeds back (EAGLE-3.1 feeds norm(g))."""
        return self.head.norm(h) if self.eagle3 and self.head.opts.norm_output else h

    # ---- the graph ---------------------------------------------------------------------------------------------
    def forward(self, input_embeds, features, position_ids, attention_mask, last_row, *past):
        """input_embeds/features/position_ids/attention_mask/past: a context pass, as the step graph takes it
        (every new row a feature row). last_row [B]: each sequence's last context row (its new root).

        Returns (scores [B, N], tokens [B, N], parents [B, N], context top-k log-probs [B, Kc], context top-k ids
        [B, Kc], context hidden [B, H], present K/V of the context rows ...), N = top_k + depth * top_k^2:
        candidates in generation order (the root's children, then each level's k x k children, row-major by
        frontier node), scores cumulative log-probs, tokens target ids, parents candidate indices (-1: the root)."""
        k, depth, n_layers = self.top_k, self.depth, self.head.num_layers
        nkv, g, hd, width = self.n_kv, self.group, self.hd, self.n_heads * self.hd
        chain = k == 1
        flat = chain and not self.plain  # a chain's levels on 2-D rows, q [B, kv, g, hd] against [B, kv, S, hd]
        layers = [self._layer(i) for i in range(n_layers)]
        last, last3 = last_row.reshape(-1, 1), last_row.reshape(-1, 1, 1)
        # Positions: the context rows', then the tree levels' (the root's + 1 .. + depth), one rotary table.
        root_pos = _row_at(position_ids, last3)  # [B, 1]
        levels = _const(last_row, range(1, depth + 1), torch.int64)
        cs = self._rotary(torch.cat((position_ids, root_pos + levels), dim=1), input_embeds)
        cs_ctx, cs_tree = cs[:, :-depth], cs[:, -depth:].split(1, dim=1)  # [B, n, ...], depth x [B, 1, ...]

        # The masks as additive float32 biases: the context rows' own (a head of several layers needs every row's)
        # and the root's row, which every tree node shares for the context.
        zero, low = torch.zeros((), dtype=torch.float32), torch.full((), MASK_MIN, dtype=torch.float32)
        root_mask = _row_at(attention_mask, last)  # [B, S]
        key_pos = None
        if self.window:  # each cached key's position: its column for past rows, then the context rows' positions
            past_len = attention_mask.shape[-1] - position_ids.shape[1]
            cols = torch.arange(past_len, dtype=position_ids.dtype).unsqueeze(0).expand(position_ids.shape[0], -1)
            key_pos = torch.cat((cols, position_ids), dim=1)  # [B, S]

        def root_bias(layer: int, level: int = 0) -> torch.Tensor:
            """[B, S]: the root's row, for a node ``level`` levels below the root (its window moves with it)."""
            m = root_mask
            if layer in self.window_layers:
                m = m & ((root_pos + level - key_pos) < self.window)
            return torch.where(m, zero, low)

        # ---- the context pass: every row's K/V in every layer; the last layer attends from the root's row only
        x, res = self._first_input(input_embeds, features, True)
        caches, presents = [], []
        h = None
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if i:
                x, res = layer.input_layernorm(h), h
            q, kn, vn = self._qkv(attn, x, cs_ctx, (0, 0, nkv, g + 2, -1), -2)  # [B, n, kv, ., hd]
            kn, vn = _reshape(kn, 0, 0, nkv, -1), _reshape(vn, 0, 0, nkv, -1)
            presents += [kn, vn]
            keys = torch.cat((past[2 * i], kn), dim=1).transpose(1, 2)  # [B, kv, S, hd]
            values = torch.cat((past[2 * i + 1], vn), dim=1).transpose(1, 2)
            caches.append([keys, values])
            if i == n_layers - 1:
                q, res = _row_at(q, last), _row_at(res, last)  # [B, kv, g, hd], [B, H]
                bias = _reshape(root_bias(i), 0, 1, 1, -1)
                o = self._attend(attn, q, keys, values, bias, (-1, width))
            else:  # every row: [B, n, kv, g, hd] over [B, 1, kv, S, hd]
                m = attention_mask
                if i in self.window_layers:
                    m = m & ((position_ids.unsqueeze(-1) - key_pos.unsqueeze(1)) < self.window)
                bias = _reshape(torch.where(m, zero, low), 0, 0, 1, 1, -1)
                o = self._attend(attn, q, keys.unsqueeze(1), values.unsqueeze(1), bias, (0, 0, -1))
            h = self._after_attention(layer, res, o)
        ctx_h = self._output_state(h)  # [B, H]
        ctx_vals, ctx_ids = self._logprobs(ctx_h, self.context_top_k)  # [B, Kc]

        # ---- the tree: level 1 is the root's children; each level feeds its k nodes and scores their k children.
        # Each node's bias over the cache (context, the tree rows fed so far, its own level): the root's context row,
        # its ancestors, itself. A chain's nodes see every tree row; a wider tree's carry their own rows.
        full = [i for i in range(n_layers) if i not in self.window_layers]
        base = root_bias(full[0] if full else 0)  # [B, S]
        if flat:
            out_s, out_t = [ctx_vals[:, :1]], [ctx_ids[:, :1]]  # [B, 1]
            scores, tokens, hidden = out_s[0], ctx_ids[:, 0], ctx_h  # [B, 1], [B], [B, H]
            node_bias = _pad_end(_reshape(base, 0, 1, 1, -1), 1)  # [B, 1, 1, S + 1]
        else:
            scores, tokens = ctx_vals[:, :k], ctx_ids[:, :k]  # [B, k]
            out_s, out_t = [scores.reshape(-1, 1, k)], [tokens.reshape(-1, 1, k)]
            scores = scores.reshape(-1, k, 1)
            hidden = ctx_h.unsqueeze(1) if chain else ctx_h.unsqueeze(1).repeat(1, k, 1)  # [B, k, H]
            base5 = _reshape(base, 0, 1, 1, 1, -1)
            if chain:
                node_bias = _pad_end(base5, 1)
            else:
                eye = _const(base, [0.0 if i == j else MASK_MIN for i in range(k) for j in range(k)], torch.float32,
                             (1, k, 1, 1, k))
                eye = _reshape(base[:, :1], 0, 1, 1, 1, -1) * 0 + eye  # [B, k, 1, 1, k]
                node_bias = torch.cat((base5.repeat(1, k, 1, 1, 1), eye), dim=-1)
            caches = [[c.unsqueeze(1) for c in kv] for kv in caches]  # [B, 1, kv, S, hd]
        bests = []
        rows_shape = (-1, 1, nkv, g + 2, hd) if flat else (-1, k, nkv, g + 2, hd)
        for level in range(1, depth + 1):
            x, res = self._first_input(self.head.embed_tokens(tokens), hidden, False)
            cs_l = cs_tree[level - 1]
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                if i:
                    x, res = layer.input_layernorm(h), h
                if flat:  # q [B, kv, g, hd], k/v [B, kv, 1, hd]: the cache's own layout
                    q, kn, vn = self._qkv(attn, x, cs_l, rows_shape, (1, -2))
                else:  # [B, k, kv, ., hd]; k/v to [B, 1, kv, k, hd]
                    q, kn, vn = self._qkv(attn, x, cs_l, rows_shape, -2)
                    if k > 1:
                        kn, vn = kn.permute(0, 3, 2, 1, 4), vn.permute(0, 3, 2, 1, 4)
                keys, values = (torch.cat((c, n), dim=-2) for c, n in zip(caches[i], (kn, vn), strict=True))
                caches[i] = [keys, values]
                bias = node_bias
                if i in self.window_layers:  # the window moves with the level: context keys beyond it are hidden
                    moved = _reshape(root_bias(i, level) - base, 0, 1, 1, -1)
                    if not flat:
                        moved = moved.unsqueeze(1)
                    bias = bias + _pad_end(moved, level * k)
                o = self._attend(attn, q, keys, values, bias, (-1, width) if flat else (-1, k, width))
                h = self._after_attention(layer, res, o)
            h = self._output_state(h)  # [B, H] (flat) or [B, k, H]
            v, t = self._logprobs(h, k)  # [B, 1] or [B, k, k]: node i's k children
            cand = scores + v
            out_s.append(cand)
            out_t.append(t)
            if level == depth:
                break
            if chain:  # the one child is the next frontier, fed from this level's only row
                scores, tokens, hidden = cand, t.reshape(-1) if flat else t.reshape(-1, 1), h
                node_bias = _pad_end(node_bias, 1)
                continue
            # The best k of the k x k children (ties: the lower index first, ONNX TopK, as the grower)
            scores, best = torch.topk(cand.reshape(-1, k * k, 1), k, dim=1)  # [B, k, 1]
            bests.append(best)
            tokens = _row_at(t.reshape(-1, k * k), best)  # [B, k]
            parent = torch.div(best, k, rounding_mode="trunc")  # each new node's parent row in this level
            hidden = _row_at(h, parent)
            node_bias = torch.cat((_row_at(node_bias, parent), eye), dim=-1)  # [B, k, 1, 1, S + fed + k]

        # Parents: -1 for the root's children; a level's children point at its frontier node (level 1's frontier is
        # the root's children 0..k-1; a later one is its best picks, offset by the candidates before that level).
        # The outputs end as runtime/tree_graph.py expects to cut them to fewer levels: each a Concat of one piece per
        # level, or (parents) an Add of a constant with one entry per candidate (and, wider than a chain, a Gather by
        # a constant of a Concat of one pick per level), behind a depth-free Reshape.
        n = k + depth * k * k
        if chain:
            parents = last * 0 + _const(last_row, range(-1, n - 1), torch.int64, (1, n))
            if flat:
                return (torch.cat(out_s, dim=1), torch.cat(out_t, dim=1), parents, ctx_vals, ctx_ids, ctx_h,
                        *presents)
            return (_reshape(torch.cat(out_s, dim=1), 0, -1), _reshape(torch.cat(out_t, dim=1), 0, -1), parents,
                    ctx_vals, ctx_ids, ctx_h, *presents)
        cols, offs = [0] * k, [-1] * k  # per candidate: its parent's column in ``front``, and the offset added
        for level in range(1, depth + 1):
            for i in range(k):
                col, off = (0, i) if level == 1 else (1 + (level - 2) * k + i, k + (level - 2) * k * k)
                cols += [col] * k
                offs += [off] * k
        front = torch.cat((last3 * 0, *bests), dim=1)  # [B, 1 + (depth - 1) k, 1]
        parents = (torch.index_select(front, 1, _const(last_row, cols, torch.int64))
                   + _const(last_row, offs, torch.int64, (n, 1)))
        return (_reshape(torch.cat(out_s, dim=1), 0, -1), _reshape(torch.cat(out_t, dim=1), 0, -1),
                _reshape(parents, 0, -1), ctx_vals, ctx_ids, ctx_h, *presents)

"""The PyTorch modules that are traced to ONNX, and run eagerly as the parity reference.

They reuse the Hugging Face modules' weights and rotary embedding but own the
attention: K/V come from an explicit cache in the contract's BSHD layout, keys
are masked by one boolean mask over [past + new] columns, and the cache is
never concatenated (scores against past and new keys are computed separately),
so the graph does not copy the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_export.export.graphs.families import (
    STATIC,
    LayerPlan,
    key_positions,
    l2_norm,
    layer_plans,
    mlp_forward,
    plan_mask,
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
    rows = torch.gather(normed, 1, logit_indices.unsqueeze(-1).expand(-1, -1, normed.shape[-1]))
    return (lm_head(rows).float(), feats, *presents)


def _decoder_layer(config, index: int, opts, in_dim: int) -> nn.Module:
    """A Llama decoder layer whose q/k/v read ``in_dim`` and carry the options' biases."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layer = LlamaDecoderLayer(config, layer_idx=index)
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(in_dim, old.out_features, bias=opts.qkv_bias))
    return layer


def _later_layers(head: nn.Module, h, rope, biases: list, past, shape) -> tuple[torch.Tensor, list]:
    """Layers 1..N-1 of a multi-layer head: plain pre-norm decoder layers, each with its own K/V cache."""
    presents = []
    for i in range(1, head.num_layers):
        layer = head.layers[str(i)] if isinstance(head.layers, nn.ModuleDict) else head.layers[i]
        a, k, v = tree_attention(layer.self_attn, layer.input_layernorm(h), rope, biases[i], past[2 * i],
                                 past[2 * i + 1], *shape, past[0].shape[1])
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        presents += [k, v]
    return h, presents


class Eagle1Head(nn.Module):
    """EAGLE-1/2 head: fc(concat[embed(x), f]) then decoder layers (layer 0 without input norm).

    The embedding and lm_head are the target's unless the checkpoint brings its own embedding.
    Options (``HeadOptions``): fc bias, q/k/v biases (Qwen2 heads), HASS norms (on the embedding and the
    feature before fc, and before lm_head), more than one layer (layers >= 1 are pre-norm Llama layers).
    Draft vocabulary = target vocabulary, so ``map_ids`` is the identity.
    """

    variant = "eagle1"

    def __init__(self, config, opts, embed_tokens: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.opts = opts
        self.num_layers = opts.num_layers
        self.fc = nn.Linear(2 * hidden, hidden, bias=opts.fc_bias)
        layers = [_decoder_layer(config, i, opts, hidden) for i in range(opts.num_layers)]
        layers[0].input_layernorm = nn.Identity()
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.embed_layernorm = LlamaRMSNorm(hidden, eps=eps) if opts.embed_norm else None
        self.hidden_layernorm = LlamaRMSNorm(hidden, eps=eps) if opts.hidden_fc_norm else None
        self.lm_head_layernorm = LlamaRMSNorm(hidden, eps=eps) if opts.lm_head_norm else None

    def forward_hidden(self, input_embeds, features, hidden_in, position_ids, attention_mask, *past, rope=None):
        """Rows: features (target) then hidden_in (fed back); both go through fc with their token's embedding.

        input_embeds: ``embed_tokens`` rows of the rows' tokens [B, T, H] (the graph takes them as an input).
        past: [k0, v0, k1, v1, ...] per layer. Returns (hidden [B, T, H], new K0, new V0, new K1, ...).
        """
        f = torch.cat((features, hidden_in), dim=1)
        emb = input_embeds.to(f.dtype)
        if self.embed_layernorm is not None:
            emb = self.embed_layernorm(emb)
        if self.hidden_layernorm is not None:
            f = self.hidden_layernorm(f)
        x = self.fc(torch.cat((emb, f), dim=-1))
        layer = self.layers[0]
        attn = layer.self_attn
        if rope is None:  # rope: the caller's tables for these positions (the tree graph makes its levels' once)
            rope = rope_tables(self.rotary_emb, x, position_ids, attn.head_dim)
        biases = layer_biases(self, attention_mask, position_ids, kv_group(attn))
        a, k, v = tree_attention(attn, x, rope, biases[0], past[0], past[1], *emb.shape[:2], past[0].shape[1])
        h = x + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        h, presents = _later_layers(self, h, rope, biases, past, emb.shape[:2])
        return (h, k, v, *presents)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_layernorm is not None:
            hidden = self.lm_head_layernorm(hidden)
        return self.lm_head(hidden).float()

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class Eagle3Head(nn.Module):
    """EAGLE-3 head in canonical names (``midlayer.*``, ``hidden_norm``, own ``norm`` and ``lm_head``).

    Context rows: z = fc(pre(target features)) (pre: identity, ``input_norm`` over the whole vector when
    norm_before_fc, or one ``fc_norm.{i}`` per target-hidden-wide chunk when fc_norm); fed-back rows: z = the
    head's own previous output (H wide, no fc). Then
        x = concat[input_layernorm(embed(token)), hidden_norm(z)]      (2H: q/k/v read 2H)
        g = r + o_proj(attention(x))         r = z, or hidden_norm(z) when norm_before_residual
        g = g + mlp(post_attention_layernorm(g))
        g = later layers (plain pre-norm decoder layers, ``layers.{i}``) when the head has more than one
        logits = lm_head(norm(g))                                      (draft vocabulary Vd)
    and the step feeds back g, or norm(g) when norm_output (EAGLE-3.1). Draft ids map to target ids with
    target_id = draft_id + d2t[draft_id] (identity when ``draft_to_target`` is None).
    """

    variant = "eagle3"

    def __init__(self, config, opts, feature_dim: int, draft_vocab_size: int, embed_tokens: nn.Embedding,
                 draft_to_target: torch.Tensor | None = None, target_hidden: int | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        hidden = config.hidden_size
        eps = config.rms_norm_eps
        self.opts = opts
        self.num_layers = opts.num_layers
        self.fc = nn.Linear(feature_dim, hidden, bias=opts.fc_bias)
        self.input_norm = LlamaRMSNorm(feature_dim, eps=eps) if opts.norm_before_fc else None
        chunk = target_hidden or hidden
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(chunk, eps=eps) for _ in range(feature_dim // chunk)])
                        if opts.fc_norm else None)
        layer = _decoder_layer(config, 0, opts, 2 * hidden)
        layer.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.midlayer = layer
        self.layers = nn.ModuleDict({str(i): _decoder_layer(config, i, opts, hidden)
                                     for i in range(1, opts.num_layers)})
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.embed_tokens = embed_tokens
        if draft_to_target is not None:
            self.register_buffer("draft_to_target", draft_to_target.to(torch.long), persistent=False)
        else:
            self.draft_to_target = None

    def fc_in(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the target features, after the checkpoint's feature norm if it has one."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        elif self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def forward_hidden(self, input_embeds, features, hidden_in, position_ids, attention_mask, *past, rope=None):
        """Rows: features (fc applied) then hidden_in (no fc). past: [k0, v0, k1, v1, ...] per layer.

        input_embeds: ``embed_tokens`` rows of the rows' tokens [B, T, H] (the graph takes them as an input).
        Returns (state fed back [B, T, H], new K0, new V0, new K1, ...)."""
        h = torch.cat((self.fc_in(features), hidden_in), dim=1)
        layer = self.midlayer
        emb = input_embeds.to(h.dtype)
        # ModelOpt's first layer normalises the hidden stream with input_layernorm before hidden_norm.
        hn = layer.hidden_norm(layer.input_layernorm(h) if self.opts.hidden_input_norm else h)
        x = torch.cat((layer.input_layernorm(emb), hn), dim=-1)
        attn = layer.self_attn
        if rope is None:  # as in Eagle1Head
            rope = rope_tables(self.rotary_emb, h, position_ids, attn.head_dim)
        biases = layer_biases(self, attention_mask, position_ids, kv_group(attn))
        a, k, v = tree_attention(attn, x, rope, biases[0], past[0], past[1], *emb.shape[:2], past[0].shape[1])
        g = (hn if self.opts.norm_before_residual else h) + a
        g = g + layer.mlp(layer.post_attention_layernorm(g))
        g, presents = _later_layers(self, g, rope, biases, past, emb.shape[:2])
        if self.opts.norm_output:
            g = self.norm(g)
        return (g, k, v, *presents)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(g)); with norm_output the fed-back state already is norm(g); without final_norm (SpecForge
        0.2.0's norm_output false) lm_head(g)."""
        plain = self.opts.norm_output or not self.opts.final_norm
        return self.lm_head(hidden if plain else self.norm(hidden)).float()

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (draft_id + d2t[draft_id], precomputed)."""
        if self.draft_to_target is None:
            return ids
        return self.draft_to_target[ids]


class DraftStep(nn.Module):
    """Draft step graph: head forward + log-softmax + top-k (+ draft->target id map) inside the graph.

    It takes its tokens' embedding rows, not their ids (contract version 3): the table stays out of the graph,
    stored once in the artifact, and the runtime gathers the rows (``embed`` does it here, for eager callers).
    """

    def __init__(self, head: nn.Module, top_k: int):
        super().__init__()
        self.head = head
        self.top_k = top_k

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ``input_embeds`` of these token ids: rows of the head's embedding table (the target's, or its own)."""
        return self.head.embed_tokens(input_ids)

    def forward(self, input_embeds, features, hidden_in, position_ids, attention_mask, *past):
        h, *presents = self.head.forward_hidden(input_embeds, features, hidden_in, position_ids, attention_mask,
                                                *past)
        logp = torch.log_softmax(self.head.logits(h), dim=-1)
        vals, ids = torch.topk(logp, self.top_k, dim=-1)
        return (vals, self.head.map_ids(ids), h, *presents)

"""The draft heads (EAGLE-1/2 and EAGLE-3) and the draft step graph's module (``DraftStep``, traced to ``draft_step``,
run eagerly as the parity reference): one head forward over [B, T] positions with the tree mask, then top-k inside."""

from __future__ import annotations

import torch
from torch import nn

from .attention import kv_group, layer_biases, rope_tables, tree_attention


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
    Draft vocabulary = target vocabulary, so ``map_ids`` is the identity, unless ``prune_vocab`` cut the lm_head to
    some target ids (``export --draft-vocab``): then draft id i is target id ``draft_to_target[i]``, as in EAGLE-3.
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
        self.draft_to_target = None  # set by prune_vocab

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
        """Draft ids -> target ids: the identity, or the kept ids' map after ``prune_vocab``."""
        if self.draft_to_target is None:
            return ids
        return self.draft_to_target[ids]


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


def prune_vocab(head: nn.Module, target_ids: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
    """Cut the head's lm_head to the rows of ``target_ids`` (ascending target ids, all in the head's vocabulary) and
    map draft id i back to ``target_ids[i]`` (``export --draft-vocab``; the manifest's ``draft_vocab`` entry).

    EAGLE-1/2: the rows are the target's lm_head rows (the head stops sharing the target's module, which stays whole
    for the verify graph). EAGLE-3: the rows of the head's own lm_head whose draft ids map to those target ids.
    ``lm_head_weight``: the full lm_head weight when the head's is on the meta device (the lean export reads it from
    the checkpoint); default the head's own. Every draft graph is traced from this head, so pruning applies to the
    step graph and the tree graphs alike, and their ``topk_ids`` stay target ids.
    """
    old = head.lm_head
    weight = old.weight if lm_head_weight is None else lm_head_weight
    target_ids = target_ids.to(torch.long)
    current = head.draft_to_target
    if current is None:
        rows = target_ids
    else:  # EAGLE-3 with a d2t: the draft ids whose target ids are kept
        where = {int(t): i for i, t in enumerate(current.tolist())}
        rows = torch.tensor([where[int(t)] for t in target_ids], dtype=torch.long)
    lm = nn.Linear(old.in_features, len(rows), bias=old.bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        lm.weight.copy_(weight.detach()[rows])
        if old.bias is not None:
            lm.bias.copy_(old.bias.detach()[rows])
    head.lm_head = lm.eval()
    if "draft_to_target" in head._buffers:
        del head._buffers["draft_to_target"]
    elif hasattr(head, "draft_to_target"):
        delattr(head, "draft_to_target")
    head.register_buffer("draft_to_target", target_ids.clone(), persistent=False)


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

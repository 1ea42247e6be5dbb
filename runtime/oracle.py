"""A plain PyTorch oracle of the greedy EAGLE-2 loop: slow, cache-free, meant to be obviously correct.

It drives an EAGLE-1/2 head or an EAGLE-3 head (the dynamic tree is EAGLE-2's either way).

It shares nothing with the runtime's loop on purpose, so it can catch the runtime's bugs:

- no KV cache, no tree attention mask, no exported graph: every forward runs over a whole
  sequence with an ordinary causal mask;
- the target is the Hugging Face model itself (``model.model(...)`` then ``lm_head``), not the
  traced ``TargetVerify``;
- the head's decoder layer runs through Hugging Face's own ``LlamaDecoderLayer.forward`` (eager
  attention), not the traced ``tree_attention``; the EAGLE-3 head's layer is written out here
  from its definition, with Hugging Face's eager ``LlamaAttention`` (not ``Eagle3Head``);
- EAGLE-3 features come from transformers' ``output_hidden_states`` (the input of decoder layer
  ``i`` is ``hidden_states[i]``), and draft ids map to target ids with the checkpoint's ``d2t``;
- the tree policy and greedy acceptance are restated here in plain Python, not ``TreeGrower`` or
  ``accept_greedy``.

What it computes, per round (names as in docs/runtime.md):

1. Target forward on the committed sequence (prompt + generated, root last). Its last hidden
   state after the final norm gives the features ``f_j`` (EAGLE-3: the inputs of the feature layers,
   concatenated); its last row gives the target's choice after the root.
2. Draft context: the head over the pairs ``(f_j, x_{j+1})`` for ``j < L`` (``x_L`` is the root),
   at positions ``0 .. L-1``. The last row's hidden predicts the root's children.
3. Tree, brute force: every node the policy feeds to the draft is run as its own sequence, the
   context pairs followed by the root-to-node path, each path pair carrying its parent's hidden
   (the root's children carry the last context row's hidden) at positions ``L .. L+d-1``
   (EAGLE-1/2 puts those hiddens through fc like features; EAGLE-3 feeds them without fc). The
   node's hidden is the last row of that forward. Children: its top-k log-probs, scored by the
   cumulative path log-prob. The best ``top_k`` children of a level form the next frontier; the
   ``total_tokens`` best nodes of all levels form the verify tree, in generation order, less those
   whose path probability ``exp(score)`` is below the tree's ``threshold``. Ties are broken by
   generation order (as the runtime documents).
4. Acceptance: from the root, run the target on sequence + path and step to the child whose
   token is the target's argmax; stop when none is. The argmax there is the bonus token.

Each round also records two margins: the smallest gap between two values whose order decided
something this round, on the draft side (adjacent top-k log-probs, adjacent scores at the
frontier cut, the scores at the selection cut and their distance to the threshold) and on the
target side (the target's top-2 logits along the walk). A disagreement with another
implementation in a round whose margin is below the numeric noise of the comparison is a tie,
not a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_export.tree_params import TreeParams


@dataclass
class EagleRound:
    """One round of the loop, as both the runtime (via ``on_round``) and the oracle report it."""

    tree_tokens: list[int]  # root first, tree order (generation order)
    tree_parents: list[int]  # tree index of each node's parent, -1 for the root
    accepted: int  # draft tokens accepted
    committed: list[int]  # accepted draft tokens + the bonus token
    draft_margin: float = math.inf  # oracle only: smallest decisive draft log-prob / score gap this round
    target_margin: float = math.inf  # oracle only: smallest target top-2 logit gap along the walk

    @classmethod
    def from_runtime(cls, tree, acc) -> EagleRound:
        """Build from the runtime's ``VerifyTree`` and ``Accepted`` (the ``on_round`` callback's arguments)."""
        return cls([int(t) for t in tree.tokens], [int(p) for p in tree.parents], int(acc.num_accepted),
                   [int(t) for t in acc.tokens] + [int(acc.bonus)])

    def same_as(self, other: EagleRound) -> bool:
        return (self.tree_tokens, self.tree_parents, self.accepted, self.committed) == (
            other.tree_tokens, other.tree_parents, other.accepted, other.committed)

    def to_dict(self) -> dict:
        return {"tree_tokens": self.tree_tokens, "tree_parents": self.tree_parents, "accepted": self.accepted,
                "committed": self.committed}


@dataclass
class OracleResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    finish_reason: str  # "length" or "capacity"
    first_margin: float  # target's top-2 gap behind the first token
    rounds: list[EagleRound] = field(default_factory=list)


def _gaps(sorted_desc: list[float], count: int) -> float:
    """Smallest gap between adjacent values among the first ``count`` (+1 for the cut) of a descending list."""
    vals = sorted_desc[: count + 1]
    return min((a - b for a, b in zip(vals, vals[1:], strict=False)), default=math.inf)


@dataclass
class _Node:
    token: int
    parent: int  # candidate index of the parent, -1 = the root
    score: float  # cumulative log-prob of the path
    hidden: torch.Tensor | None = None  # the head's output at this node, once the node is fed


class EagleOracle:
    """Greedy EAGLE-2 over an eager target (a transformers causal LM) and an EAGLE head, fp32.

    head: an ``Eagle1Head`` or an ``Eagle3Head`` (only its weights are used: the forward is written
    here). EAGLE-3: ``feature_layers`` are the target layers whose inputs make the features, and
    ``d2t`` the checkpoint's offsets (target id = draft id + d2t[draft id]); None: the head's own map, which
    ``prune_vocab`` sets for an ``export --draft-vocab`` artifact's head (either variant), else the identity.
    """

    def __init__(self, causal_lm: torch.nn.Module, head: torch.nn.Module, feature_layers: list[int] | None = None,
                 d2t: torch.Tensor | None = None):
        self.lm = causal_lm.eval()
        self.head = head.eval()
        self.variant = getattr(head, "variant", "eagle1")
        if self.variant == "eagle3" and not feature_layers:
            raise ValueError("an EAGLE-3 head needs the target's feature_layers")
        self.feature_layers = list(feature_layers) if self.variant == "eagle3" else None
        self.draft_vocab = self.head.lm_head.out_features
        own = getattr(head, "draft_to_target", None)
        self.to_target = own if d2t is None else torch.arange(len(d2t)) + d2t.to(torch.long)

    @classmethod
    def load(cls, target_dir: str | Path, draft_dir: str | Path,
             feature_layers: list[int] | None = None) -> EagleOracle:
        from eagle_export.export.checkpoint.loaders import load_draft_head, load_target

        target = load_target(target_dir, dtype=torch.float32, progress=False)
        d = load_draft_head(draft_dir, target, feature_layers)
        return cls(target.model, d.head, d.feature_layers, d.ckpt.weights.get("d2t"))

    # ---- the two models, over whole sequences ----------------------------------------------
    @torch.no_grad()
    def target(self, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [n, F] and float32 logits [n, V].

        EAGLE-1/2: the last hidden state after the final norm. EAGLE-3: the inputs of the decoder
        layers ``feature_layers`` (``hidden_states[i]`` of ``output_hidden_states``), concatenated.
        """
        out = self.lm.model(input_ids=torch.tensor([seq]), use_cache=False,
                            output_hidden_states=self.variant == "eagle3")
        h = out.last_hidden_state[0]
        feats = h if self.variant == "eagle1" else torch.cat([out.hidden_states[i][0] for i in self.feature_layers], -1)
        return feats, self.lm.lm_head(h).float()

    @torch.no_grad()
    def head_hidden(self, feats: torch.Tensor, tokens: list[int], fed: torch.Tensor | None = None) -> torch.Tensor:
        """The head over rows (feats[i], tokens[i]) then (fed[j], tokens[...]) at positions 0..n-1, causal: [n, H].

        ``fed``: the head's own outputs fed back (tree nodes). EAGLE-1/2 treats them as features
        (through fc); EAGLE-3 feeds them without fc.
        """
        if self.variant == "eagle3":
            return self._eagle3_hidden(feats, tokens, fed)
        if fed is not None:
            feats = torch.cat((feats, fed))
        n = len(tokens)
        emb = self.head.embed_tokens(torch.tensor([tokens])).to(feats.dtype)
        feats = feats[None]
        if getattr(self.head, "embed_layernorm", None) is not None:  # HASS: norms on both fc inputs
            emb, feats = self.head.embed_layernorm(emb), self.head.hidden_layernorm(feats)
        x = self.head.fc(torch.cat((emb, feats), dim=-1))
        pos = torch.arange(n)[None]
        masks = self._masks(n, x.dtype)
        pos_emb = self.head.rotary_emb(x, pos)
        for i, layer in enumerate(self.head.layers):  # layer 0's input norm is the identity; later ones plain
            x = layer(x, attention_mask=masks[i], position_embeddings=pos_emb)
        return x[0]

    def _masks(self, n: int, dtype) -> list[torch.Tensor]:
        """Per draft layer, the additive causal mask over positions 0..n-1, narrowed to the head's sliding window on
        its window layers."""
        opts = self.head.opts
        causal = torch.full((n, n), torch.finfo(dtype).min).triu(1)[None, None]
        if not opts.sliding_window:
            return [causal] * opts.num_layers
        far = torch.arange(n)[:, None] - torch.arange(n)[None, :] >= opts.sliding_window
        win = causal.masked_fill(far, torch.finfo(dtype).min)
        return [win if i in opts.sliding_layers else causal for i in range(opts.num_layers)]

    def _eagle3_hidden(self, feats: torch.Tensor, tokens: list[int], fed: torch.Tensor | None) -> torch.Tensor:
        """EAGLE-3 as the reference (SafeAILab EAGLE) has it: h = fc(features) for context rows, the fed-back g as is;
        q/k/v over concat[input_layernorm(embed), hidden_norm(h)], residual h, then the MLP block.
        Attention is transformers' own (eager ``LlamaAttention``) with an ordinary causal mask."""
        layer, opts = self.head.midlayer, self.head.opts
        if opts.norm_before_fc:
            feats = self.head.input_norm(feats)
        elif opts.fc_norm:
            parts = feats.chunk(len(self.head.fc_norm), dim=-1)
            feats = torch.cat([norm(p) for norm, p in zip(self.head.fc_norm, parts, strict=True)], dim=-1)
        h = self.head.fc(feats)
        if fed is not None:
            h = torch.cat((h, fed))
        n = len(tokens)
        emb = self.head.embed_tokens(torch.tensor(tokens)).to(h.dtype)
        hn = layer.hidden_norm(layer.input_layernorm(h) if opts.hidden_input_norm else h)  # ModelOpt: both norms
        x = torch.cat((layer.input_layernorm(emb), hn), dim=-1)[None]
        masks = self._masks(n, x.dtype)
        pos_emb = self.head.rotary_emb(h[None], torch.arange(n)[None])
        a = layer.self_attn(hidden_states=x, position_embeddings=pos_emb, attention_mask=masks[0])[0][0]
        g = (hn if opts.norm_before_residual else h) + a
        g = g + layer.mlp(layer.post_attention_layernorm(g))
        for i in range(1, opts.num_layers):  # later layers: plain pre-norm decoder layers
            g = self.head.layers[str(i)](g[None], attention_mask=masks[i], position_embeddings=pos_emb)[0]
        return self.head.norm(g) if opts.norm_output else g  # EAGLE-3.1 feeds norm(g) back

    @torch.no_grad()
    def head_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs over the draft vocabulary (EAGLE-3: lm_head(norm(g)); EAGLE-1/2: the target's lm_head)."""
        if self.variant == "eagle3":
            opts = self.head.opts  # norm_output: already normed; no final_norm (SpecForge 0.2.0): lm_head(g)
            normed = hidden if opts.norm_output or not opts.final_norm else self.head.norm(hidden)
            return torch.log_softmax(self.head.lm_head(normed).float(), dim=-1)
        if getattr(self.head, "lm_head_layernorm", None) is not None:  # HASS
            hidden = self.head.lm_head_layernorm(hidden)
        return torch.log_softmax(self.head.lm_head(hidden).float(), dim=-1)

    def target_id(self, draft_id: int) -> int:
        return draft_id if self.to_target is None else int(self.to_target[draft_id])

    # ---- the loop ----------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, tree: TreeParams,
                 capacity: int | None = None) -> OracleResult:
        """Greedy EAGLE without EOS stopping: ``min(max_new_tokens, capacity - len(prompt))`` tokens."""
        prompt = [int(t) for t in prompt]
        room = max_new_tokens if capacity is None else capacity - len(prompt)
        limit = min(max_new_tokens, room)
        reason = "length" if capacity is None or max_new_tokens <= room else "capacity"
        if limit <= 0:
            return OracleResult([], reason, math.inf)
        _, logits = self.target(prompt)
        first, first_margin = self._argmax(logits[-1])
        out = [first]
        rounds: list[EagleRound] = []
        while len(out) < limit:
            rnd = self.round(prompt + out, tree)
            rounds.append(rnd)
            out += rnd.committed
        return OracleResult(out[:limit], reason, first_margin, rounds)

    def round(self, seq: list[int], tree: TreeParams) -> EagleRound:
        """One round on the committed sequence ``seq`` (its last token is the root)."""
        k = tree.top_k
        L = len(seq) - 1
        feats, logits = self.target(seq)
        ctx_feats, ctx_tokens = feats[:L], seq[1:L + 1]
        root_hidden = self.head_hidden(ctx_feats, ctx_tokens)[-1]
        draft_margin = target_margin = math.inf

        nodes: list[_Node] = []

        def children(hidden: torch.Tensor, parent: int, base_score: float) -> list[_Node]:
            nonlocal draft_margin
            vals, ids = torch.topk(self.head_logprobs(hidden), min(k + 1, self.draft_vocab))
            vals, ids = vals.tolist(), [self.target_id(i) for i in ids.tolist()]
            draft_margin = min(draft_margin, _gaps(vals, k))
            return [_Node(ids[j], parent, base_score + vals[j]) for j in range(k)]

        def path(c: int) -> list[int]:
            out = []
            while c >= 0:
                out.append(c)
                c = nodes[c].parent
            return out[::-1]

        nodes += children(root_hidden, -1, 0.0)
        frontier = list(range(k))
        for _level in range(tree.depth):
            new: list[_Node] = []
            for c in frontier:
                p = path(c)
                parent_hidden = [root_hidden] + [nodes[a].hidden for a in p[:-1]]
                h = self.head_hidden(ctx_feats, ctx_tokens + [nodes[a].token for a in p],
                                     torch.stack(parent_hidden))[-1]
                nodes[c].hidden = h
                new += children(h, c, nodes[c].score)
            base = len(nodes)
            nodes += new
            order = sorted(range(len(new)), key=lambda i: (-new[i].score, i))
            draft_margin = min(draft_margin, _gaps([new[i].score for i in order], k))
            frontier = [base + i for i in order[:k]]

        ranked = sorted(range(len(nodes)), key=lambda c: (-nodes[c].score, c))
        draft_margin = min(draft_margin, _gaps([nodes[c].score for c in ranked][tree.total_tokens - 1:], 1))
        chosen = ranked[: tree.total_tokens]
        if tree.threshold > 0:  # only nodes whose path probability reaches the threshold: a score of log(threshold)
            floor = math.log(tree.threshold)
            draft_margin = min(draft_margin, *(abs(nodes[c].score - floor) for c in chosen))
            chosen = [c for c in chosen if nodes[c].score >= floor]
        chosen = sorted(chosen)
        tree_index = {c: i + 1 for i, c in enumerate(chosen)}
        tokens = [seq[-1]] + [nodes[c].token for c in chosen]
        parents = [-1] + [0 if nodes[c].parent < 0 else tree_index[nodes[c].parent] for c in chosen]

        # Greedy acceptance: walk down while the target's argmax is a child's token.
        node, walk, cur = 0, [0], list(seq)
        row = logits[-1]
        while True:
            want, gap = self._argmax(row)
            target_margin = min(target_margin, gap)
            kids = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == want]
            if not kids:
                break
            node = kids[0]
            walk.append(node)
            cur.append(want)
            row = self.target(cur)[1][-1]
        accepted = [tokens[i] for i in walk[1:]]
        return EagleRound(tokens, parents, len(accepted), accepted + [want], draft_margin, target_margin)

    @staticmethod
    def _argmax(row: torch.Tensor) -> tuple[int, float]:
        top = torch.topk(row, 2).values
        return int(row.argmax()), float(top[0] - top[1])


@dataclass
class OracleComparison:
    """Outcome of one prompt: ``match``, ``tie`` (first difference at a near-tie) or ``mismatch``."""

    status: str
    rounds_compared: int
    detail: str = ""


def compare_with_oracle(tokens: list[int], rounds: list[EagleRound], oracle: OracleResult,
                        tie_gap: float, draft_tie_gap: float | None = None) -> OracleComparison:
    """Round-by-round comparison of a run (tokens + its rounds) with the oracle's.

    The first difference decides: a tie when the oracle's target margin there is below
    ``tie_gap`` or its draft margin below ``draft_tie_gap`` (default: ``tie_gap``): the two sides
    may legitimately order near-equal values differently. Otherwise a mismatch.
    """
    draft_tie_gap = tie_gap if draft_tie_gap is None else draft_tie_gap
    if tokens[:1] != oracle.tokens[:1]:
        status = "tie" if oracle.first_margin < tie_gap else "mismatch"
        return OracleComparison(status, 0, f"first token: got {tokens[:1]}, oracle {oracle.tokens[:1]} "
                                           f"(target top-2 gap {oracle.first_margin:.3g})")
    for i, (got, want) in enumerate(zip(rounds, oracle.rounds, strict=False)):
        if not got.same_as(want):
            tie = want.target_margin < tie_gap or want.draft_margin < draft_tie_gap
            return OracleComparison("tie" if tie else "mismatch", i,
                                    f"round {i}: got {got.to_dict()}, oracle {want.to_dict()} (smallest decisive "
                                    f"gaps: draft {want.draft_margin:.3g}, target {want.target_margin:.3g})")
    if len(rounds) != len(oracle.rounds) or tokens != oracle.tokens:
        return OracleComparison("mismatch", min(len(rounds), len(oracle.rounds)),
                                f"{len(rounds)} rounds and {len(tokens)} tokens, oracle {len(oracle.rounds)} rounds "
                                f"and {len(oracle.tokens)} tokens")
    return OracleComparison("match", len(rounds))

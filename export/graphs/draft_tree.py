"""The draft tree graph: a round's whole draft work in one call.

The draft step graph (``modules.DraftStep``) runs one tree level per call, so a depth-6 tree costs seven session
calls a round (the context pass, then six levels) with Python between them. ``DraftTree`` unrolls the same steps
into one graph: the context pass over the accepted tokens' target features, then ``depth`` tree levels fed from
the draft's own output, each level's frontier chosen by top-k inside the graph, exactly as ``runtime.tree
.TreeGrower`` chooses it on the host. It returns every candidate of the tree (score, token, parent, in the
grower's generation order), from which the runtime selects the verify tree, plus the context rows' K/V (the only
draft rows the cache keeps) and the last context row's top-k and hidden (so a round may still grow its tree level
by level from them).

The tree's ``top_k`` and ``depth`` are fixed when the graph is traced (the artifact's default tree); a round whose
tree has that top_k and a depth up to it uses the graph (a shallower tree reads the first levels' candidates), any
other tree the step graph.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import rope_tables


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, R, *tail] rows ``index`` [B, N] -> [B, N, *tail] (per batch row)."""
    tail = x.shape[2:]
    idx = index.reshape(*index.shape, *([1] * len(tail))).expand(*index.shape, *tail)
    return torch.gather(x, 1, idx)


class DraftTree(nn.Module):
    """Context pass + ``depth`` tree levels of a draft head, with the frontier selection inside the graph.

    head: ``modules.Eagle1Head`` or ``modules.Eagle3Head``. context_top_k: the width of the context row's top-k
    output (the step graph's, ``max_top_k``). top_k, depth: the tree the graph grows.
    """

    def __init__(self, head: nn.Module, context_top_k: int, top_k: int, depth: int):
        super().__init__()
        if not 1 <= top_k <= context_top_k or depth < 1:
            raise ValueError(f"a draft tree graph needs 1 <= top_k <= {context_top_k} and depth >= 1, got top_k "
                             f"{top_k}, depth {depth}")
        self.head = head
        self.context_top_k, self.top_k, self.depth = context_top_k, top_k, depth

    def _step(self, embeds, features, hidden_in, position_ids, mask, past, k: int, rope=None):
        h, *presents = self.head.forward_hidden(embeds, features, hidden_in, position_ids, mask, *past, rope=rope)
        logp = torch.log_softmax(self.head.logits(h), dim=-1)
        vals, ids = torch.topk(logp, k, dim=-1)
        return vals, self.head.map_ids(ids), h, presents

    def forward(self, input_embeds, features, position_ids, attention_mask, last_row, *past):
        """input_embeds/features/position_ids/attention_mask/past: a context pass, as the step graph takes it
        (every new row a feature row). last_row [B]: each sequence's last context row (its new root).

        Returns (scores [B, N], tokens [B, N], parents [B, N], context top-k log-probs [B, Kc], context top-k ids
        [B, Kc], context hidden [B, H], present K/V of the context rows ...), N = ``candidate_count``: candidates
        in generation order (the root's children, then each level's k x k children, row-major by frontier node),
        scores cumulative log-probs, tokens target ids, parents candidate indices (-1: the root)."""
        k, bsz = self.top_k, input_embeds.shape[0]
        no_rows = input_embeds[:, :0]
        vals, ids, h, presents = self._step(input_embeds, features, no_rows, position_ids, attention_mask, past,
                                            self.context_top_k)
        last = last_row.reshape(bsz, 1)
        ctx_vals, ctx_ids, ctx_h = _rows(vals, last), _rows(ids, last), _rows(h, last)  # [B, 1, ...]
        seen = _rows(attention_mask, last)  # [B, 1, past + new]: the root's view, which every tree node shares
        base_pos = _rows(position_ids.unsqueeze(-1), last).reshape(bsz, 1) + 1
        cache = [torch.cat((p, n), dim=1) for p, n in zip(past, presents, strict=True)]

        # Every level's rotary tables at once: level l's nodes all sit at position root + l.
        attn = self.head.midlayer.self_attn if self.head.variant == "eagle3" else self.head.layers[0].self_attn
        # Index constants are made from the inputs (new_ones, cumsum), not as tensors of their own: the lean export
        # traces on the meta device, where a tensor constant has no data to put in the graph.
        levels = base_pos.new_ones((1, self.depth)).cumsum(-1) - 1
        cos, sin = rope_tables(self.head.rotary_emb, h, base_pos + levels, attn.head_dim)  # [B, depth, 1, hd]
        ar = base_pos.new_ones((k,)).cumsum(0) - 1
        eye = (ar.unsqueeze(1) == ar.unsqueeze(0)).unsqueeze(0).expand(bsz, k, k)
        scores, tokens = ctx_vals[:, 0, :k], ctx_ids[:, 0, :k]  # level 1: the root's children
        front = ar.unsqueeze(0).expand(bsz, k)  # the frontier's candidate indices
        hidden = ctx_h.expand(bsz, k, ctx_h.shape[-1])
        ancestors = seen.new_zeros((bsz, k, 0))  # over the tree rows fed so far
        ones = seen.new_ones((bsz, 1, 1))
        out_s, out_t, out_p = [scores], [tokens], [torch.full_like(tokens, -1)]
        count = k
        for level in range(1, self.depth + 1):
            if k == 1:  # a chain: every node sees the root's view and every node fed before it
                mask = torch.cat((seen, ones.expand(bsz, 1, level)), dim=-1)
            else:
                mask = torch.cat((seen.expand(bsz, k, seen.shape[-1]), ancestors, eye), dim=-1)
            pos = base_pos.expand(bsz, k) + (level - 1)
            rope = (cos[:, level - 1:level], sin[:, level - 1:level])  # broadcast over the level's k rows
            v, t, h, new = self._step(self.head.embed_tokens(tokens), features[:, :0], hidden, pos, mask, cache, k,
                                      rope)
            cache = [torch.cat((c, n), dim=1) for c, n in zip(cache, new, strict=True)]
            cand = (scores.unsqueeze(-1) + v).reshape(bsz, k * k)  # (frontier node i, child j), row-major
            cand_t = t.reshape(bsz, k * k)
            out_s.append(cand)
            out_t.append(cand_t)
            out_p.append(front.unsqueeze(-1).expand(bsz, k, k).reshape(bsz, k * k))
            if level < self.depth:
                if k == 1:  # the one child is the next frontier, fed from this level's only row
                    scores, tokens, front, hidden = cand, cand_t, torch.zeros_like(front) + count, h
                else:
                    scores, best = torch.topk(cand, k, dim=-1)  # ties: the lower index first (ONNX TopK), as the grower
                    rows = torch.div(best, k, rounding_mode="floor")  # each new node's parent row in this frontier
                    tokens = torch.gather(cand_t, 1, best)
                    front = best + count
                    hidden = _rows(h, rows)
                    ancestors = _rows(torch.cat((ancestors, eye), dim=-1), rows)
            count += k * k
        return (torch.cat(out_s, dim=1), torch.cat(out_t, dim=1), torch.cat(out_p, dim=1), ctx_vals[:, 0],
                ctx_ids[:, 0], ctx_h[:, 0], *presents)

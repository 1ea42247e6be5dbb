"""validate's inputs and tolerances: the cases each graph runs on (prefill, random trees, decode, draft
context passes and tree levels, at cache 0 and near capacity), and the tolerance per dtype and output."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from eagle_export import contract as C
from eagle_export.manifest import Manifest

# fp32: the graphs compute what the modules compute, in the same precision: 1e-4 absolute.
# fp16: the graphs run in half precision against the float32 modules. Each fp16 op keeps about three
# significant digits and the error grows with depth and context (measured on the tiny models: 0.5% of
# an output's scale at cache 11, 2.5% at cache 254), so: 5e-2 relative, or 5e-2 of the output's scale
# (max(1, largest |PyTorch value| of that output over all inputs)) absolute, which judges the small
# elements of a large tensor by its scale. Real bugs (a wrong mask, position or weight) are O(100%).
FP32_ATOL = 1e-4


FP16_REL = 5e-2


@dataclass(frozen=True)
class Tolerance:
    """Elementwise: an element fails when |got - want| > atol and |got - want| > rtol * |want| (want = PyTorch)."""

    atol: float
    rtol: float

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol}


EXACT = Tolerance(0.0, 0.0)


# Greedy/oracle comparisons: a first difference where the reference's deciding gap (target top-2 logits,
# draft log-probs or path scores) is below the tie gap is a tie. Tie gap = max(floor, 4 x the worst error
# measured on logits and topk_logprobs): in a generation, errors also travel from the target's features
# into the draft, so the graph-level error alone is not enough.
TIE_FLOOR = {"float32": 1e-4, "float16": 1e-2}


TIE_FACTOR = 4.0


def tolerances(torch_iterations: list, dtype: str) -> dict[str, Tolerance]:
    """Per output, from the PyTorch runner's outputs: ints exact (top-k ids: up to ties), floats per dtype."""
    tols = {}
    for name, first in torch_iterations[0].items():
        if np.issubdtype(first.dtype, np.integer):
            tols[name] = EXACT
        elif dtype == "float32":
            tols[name] = Tolerance(FP32_ATOL, 0.0)
        else:
            scale = max([1.0] + [float(np.abs(it[name].astype(np.float32)).max(initial=0.0))
                                 for it in torch_iterations])
            tols[name] = Tolerance(float(f"{FP16_REL * scale:.2g}"), FP16_REL)
    return tols


def random_tree(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random tree of n nodes in tree order (parents precede children): (depths, ancestor-or-self mask)."""
    from eagle_export.runtime.tree import VerifyTree

    parents = np.full(n, -1)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
    tree = VerifyTree.from_parents(np.zeros(n, dtype=np.int64), parents)
    return tree.depths, tree.mask


def _past(rng, rows: int, layers: int, heads: int, dim: int, dtype: str) -> list[np.ndarray]:
    return [rng.standard_normal((1, rows, heads, dim)).astype(dtype) for _ in range(2 * layers)]


def _causal(new: int, past: int) -> np.ndarray:
    return np.concatenate([np.ones((new, past), dtype=bool), np.tri(new, dtype=bool)], axis=1)[None]


def target_cases(m: Manifest, rng: np.random.Generator) -> list[tuple[str, OrderedDict]]:
    """Target verify inputs: prefill, tree verify (random trees), decode; cache 0, mid and near capacity."""
    t, S = m.target, m.max_seq_len
    tree_n = m.tree_defaults.total_tokens + 1
    max_n = m.tree_limits.max_verify_tokens
    mid = min(S - 2, 11)
    cases = []

    names = m.graphs[C.TARGET_GRAPH].spec.input_names

    def add(name, ids, pos, mask, rows, past):
        feed = OrderedDict(zip(names, [ids, pos, mask, rows,
                                       *_past(rng, past, t.num_layers, t.kv_heads, t.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    def ids(n):
        return rng.integers(0, t.vocab_size, (1, n)).astype(np.int64)

    n = min(S, 7)
    add(f"prefill, cache 0 ({n} tokens)", ids(n), np.arange(n)[None], _causal(n, 0), np.array([[n - 1]]), 0)
    n = min(5, S - mid)
    add(f"prefill chunk, cache {mid} ({n} tokens)", ids(n), np.arange(mid, mid + n)[None], _causal(n, mid),
        np.array([[n - 1]]), mid)
    for past, n, what in ((0, tree_n, "cache 0"), (mid, tree_n, f"cache {mid}"),
                          (S - 2, max_n, f"cache {S - 2}, near capacity")):
        depths, tmask = random_tree(rng, n)
        mask = np.concatenate([np.ones((n, past), dtype=bool), tmask], axis=1)[None]
        add(f"tree verify, random {n}-node tree, {what}", ids(n), (past + depths)[None], mask, np.arange(n)[None],
            past)
    add(f"decode step, cache {S - 1}", ids(1), np.array([[S - 1]]), np.ones((1, 1, S), dtype=bool),
        np.array([[0]]), S - 1)
    for _, feed in cases:
        for k in (C.POSITION_IDS, C.LOGIT_INDICES):
            feed[k] = np.ascontiguousarray(feed[k], dtype=np.int64)
    return cases


def draft_cases(m: Manifest, rng: np.random.Generator, table) -> list[tuple[str, OrderedDict]]:
    """Draft step inputs: context passes and tree levels (random ancestors), cache 0 and near capacity.

    The tokens' input_embeds are rows of ``table`` (the runtime's ``TokenEmbedding``) for random ids, fed to both
    runners alike; ``check_embedding`` checks the table itself."""
    d, t, S = m.draft, m.target, m.max_seq_len
    lim = m.tree_limits
    names = m.graphs[C.DRAFT_GRAPH].spec.input_names
    cases = []

    def add(name, n, pos, mask, past, tree_level=False):
        """Context passes feed target features; tree levels feed the draft's own hidden (contract v2)."""
        hidden_rows = n if tree_level else 0
        feed = OrderedDict(zip(names, [
            table.rows(rng.integers(0, t.vocab_size, (1, n))).float().numpy().astype(m.dtype),
            rng.standard_normal((1, n - hidden_rows, d.feature_dim)).astype(m.dtype),
            rng.standard_normal((1, hidden_rows, d.hidden_size)).astype(m.dtype),
            np.ascontiguousarray(pos, dtype=np.int64), mask,
            *_past(rng, past, d.num_layers, d.kv_heads, d.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    def level_mask(k: int, L: int, level: int) -> np.ndarray:
        """Tree level ``level``: context visible, one ancestor row per earlier level, identity block."""
        fed = (level - 1) * k
        mask = np.zeros((k, L + fed + k), dtype=bool)
        mask[:, :L] = True
        for lv in range(level - 1):
            mask[np.arange(k), L + lv * k + rng.integers(0, k, k)] = True
        mask[:, L + fed:] = np.eye(k, dtype=bool)
        return mask[None]

    n = min(S, 7)
    add(f"context pass, cache 0 ({n} tokens)", n, np.arange(n)[None], _causal(n, 0), 0)
    L = min(S - 2, 11)
    n = min(lim.max_depth + 1, 4)
    add(f"context pass after a round, cache {L} ({n} tokens)", n, np.arange(L, L + n)[None], _causal(n, L), L)
    k, level = m.tree_defaults.top_k, min(2, max(1, m.tree_defaults.depth))
    add(f"tree level {level}, top_k {k}, cache {L + (level - 1) * k}", k, np.full((1, k), L + level - 1),
        level_mask(k, L, level), L + (level - 1) * k, tree_level=True)
    k, level, L = lim.max_top_k, max(1, lim.max_depth), S - 2
    add(f"tree level {level}, top_k {k}, cache {L + (level - 1) * k}, near capacity", k,
        np.full((1, k), L + level - 1), level_mask(k, L, level), L + (level - 1) * k, tree_level=True)
    return cases


def tree_cases(m: Manifest, rng: np.random.Generator, table, graph: str) -> list[tuple[str, OrderedDict]]:
    """Draft tree graph inputs: a prompt's context pass over an empty cache, and a round's context pass near capacity
    whose tree grows past it (rows are random; the last context row is each case's root)."""
    d, t, S = m.draft, m.target, m.max_seq_len
    names = m.graphs[graph].spec.input_names
    cases = []

    def add(name, n, past):
        feed = OrderedDict(zip(names, [
            table.rows(rng.integers(0, t.vocab_size, (1, n))).float().numpy().astype(m.dtype),
            rng.standard_normal((1, n, d.feature_dim)).astype(m.dtype),
            np.arange(past, past + n, dtype=np.int64)[None], _causal(n, past), np.array([n - 1], dtype=np.int64),
            *_past(rng, past, d.num_layers, d.kv_heads, d.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    n = min(S, 7)
    add(f"prompt context and tree, cache 0 ({n} tokens)", n, 0)
    add("one-token prompt and tree, cache 0", 1, 0)
    n = min(m.tree_limits.max_depth + 1, 4)
    L = min(S - n, 11)
    add(f"round context and tree, cache {L} ({n} tokens)", n, L)
    add(f"round context and tree, cache {S - n} ({n} tokens), near capacity", n, S - n)
    return cases

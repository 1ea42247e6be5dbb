"""EAGLE-2 dynamic tree: growth level by level, then selection of the verify tree.

Policy follows the reference (SafeAILab EAGLE ``topK_genrate``): every frontier node gets
``top_k`` children scored by cumulative log-prob, the best ``top_k`` children form the next
frontier, and the ``total_tokens`` best nodes over everything generated become the verify tree
in generation order. Ties are broken by candidate index (generation order) so results are
deterministic; the reference's ``torch.topk`` leaves them unspecified. A tree's ``threshold`` narrows the
selection to the candidates whose cumulative draft probability reaches it (``TreeGrower.select``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eagle_export.tree_params import TreeParams


@dataclass
class Frontier:
    """Nodes to feed to the draft next.

    ``parent_rows[i]`` is the row of the previous draft call's output holding the feature of
    node i's parent: at level 1 every entry is 0, meaning "the last context row" (the context
    pass output); deeper, it is the parent's index within the previous frontier.
    ``tree_mask[i]`` is node i's ancestor-or-self mask over every frontier row fed to the draft
    this round (level-1 rows 0..k-1, level-2 rows k..2k-1, ...) followed by this frontier's own
    k rows (identity block). Arrays are read-only views valid until ``TreeGrower.reset``.
    """

    tokens: np.ndarray  # int64[k]
    parent_rows: np.ndarray  # int64[k]
    tree_mask: np.ndarray  # bool[k, fed + k]
    level: int  # 1-based depth of these nodes

    @property
    def fed(self) -> int:
        """Rows fed to the draft this round before this frontier."""
        return self.tree_mask.shape[1] - self.tree_mask.shape[0]


@dataclass
class VerifyTree:
    """Tree the target verifies, in tree order: index 0 is the root, parents precede children."""

    tokens: np.ndarray  # int64[T]
    parents: np.ndarray  # int64[T], -1 for the root
    depths: np.ndarray  # int64[T], root 0
    mask: np.ndarray  # bool[T, T], mask[i, j] = j is i or an ancestor of i
    _child_ptr: np.ndarray = field(init=False, repr=False)
    _child_idx: np.ndarray = field(init=False, repr=False)
    _kids: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # CSR children lists (in tree order) so acceptance finds a child by token in O(children).
        n = self.num_nodes
        counts = np.bincount(self.parents[1:], minlength=n)
        self._child_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=self._child_ptr[1:])
        self._child_idx = np.argsort(self.parents[1:], kind="stable").astype(np.int64) + 1
        self._kids = [self._child_idx[self._child_ptr[i]:self._child_ptr[i + 1]].tolist() for i in range(n)]

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def children_of(self, i: int) -> np.ndarray:
        """Tree-order indices of node i's children, ascending."""
        return self._child_idx[self._child_ptr[i]:self._child_ptr[i + 1]]

    def children_lists(self) -> list[list[int]]:
        """Every node's children (tree order) as Python lists: the greedy walk reads them without numpy calls."""
        return self._kids

    def child_with_token(self, i: int, token: int) -> int:
        """Index of node i's child carrying ``token``, or -1 (siblings have distinct tokens)."""
        kids = self.children_of(i)
        hit = np.flatnonzero(self.tokens[kids] == token)
        return int(kids[hit[0]]) if hit.size else -1

    @classmethod
    def from_parents(cls, tokens: np.ndarray, parents: np.ndarray) -> VerifyTree:
        """Build depths and the ancestor-or-self mask from a parent list (parents precede children)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int64)
        n = tokens.shape[0]
        if n < 1 or parents.shape != (n,) or parents[0] != -1:
            raise ValueError("need tokens/parents of equal length >= 1 with parents[0] == -1")
        if np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n)):
            raise ValueError("every non-root parent must be an earlier node")
        depths = np.zeros(n, dtype=np.int64)
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i in range(1, n):
            p = parents[i]
            depths[i] = depths[p] + 1
            mask[i] = mask[p]
            mask[i, i] = True
        return cls(tokens=tokens, parents=parents, depths=depths, mask=mask)

    def with_tokens(self, tokens: np.ndarray) -> VerifyTree:
        """The same shape carrying other tokens: shares the structure arrays (read-only), builds nothing."""
        tree = object.__new__(VerifyTree)
        tree.tokens, tree.parents, tree.depths, tree.mask = tokens, self.parents, self.depths, self.mask
        tree._child_ptr, tree._child_idx, tree._kids = self._child_ptr, self._child_idx, self._kids
        return tree

    def freeze(self) -> VerifyTree:
        """Make the structure arrays read-only (they are shared by ``with_tokens``); returns self."""
        for a in (self.parents, self.depths, self.mask, self._child_ptr, self._child_idx):
            a.flags.writeable = False
        return self


# Log-probs <= 0 (NaN fails the test too) is what makes a parent outscore its children.
_NOT_LOGPROBS = "log-probs must be <= 0 and not NaN"


class TreeGrower:
    """Grows one round's draft tree; buffers and views are made once from the tree parameters.

    Candidates are numbered in generation order: level-1 nodes 0..k-1, then each
    ``add_children`` call appends k*k children row-major (frontier node i, child j).

    It runs between graph calls every round with small k (a CPU's best trees have top_k 1-2), where a numpy call
    costs more than the arithmetic: candidates are kept in Python lists, the per-level ``Frontier`` views are made
    once here, and a verify tree's structure (depths, mask, children) is built once per distinct shape.
    """

    SHAPE_CACHE = 256  # distinct verify-tree shapes kept (a chain has one; a top_k 2, 8-token tree a few dozen)

    def __init__(self, params: TreeParams) -> None:
        self.params = params
        k, d = params.top_k, params.depth
        # Candidates so far (generation order): cumulative log-prob, token, parent candidate (-1 = root), level.
        self._scores: list[float] = []
        self._tokens: list[int] = []
        self._parent: list[int] = []
        self._level: list[int] = []
        self._front_cand: list[list[int]] = []  # per level: the frontier's candidate indices
        # Per-level frontier arrays the draft is fed from; level L lives at slot L-1 and stays valid until reset().
        self._front_tokens = np.empty((d + 1, k), dtype=np.int64)
        self._front_rows = np.empty((d + 1, k), dtype=np.int64)
        self._front_mask = np.zeros((d + 1, k, (d + 1) * k), dtype=bool)
        for s in range(d + 1):  # each level's own k rows: the identity block, the same every round
            self._front_mask[s, :, s * k:(s + 1) * k] = np.eye(k, dtype=bool)
        self._front_rows[0] = 0  # level 1 is fed from the last context row
        if k == 1:  # a chain: every node's parent is row 0 and every earlier row is an ancestor, every round
            self._front_rows[:] = 0
            for s in range(d + 1):
                self._front_mask[s, 0, :s + 1] = True
        self._frontiers = [self._make_frontier(level) for level in range(1, d + 2)]
        self._levels = [1] * k + [level for level in range(2, d + 2) for _ in range(k * k)]
        self._shapes: dict[bytes, VerifyTree] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the current round (buffers are reused, not reallocated)."""
        for lst in (self._scores, self._tokens, self._parent, self._level, self._front_cand):
            lst.clear()

    @property
    def num_candidates(self) -> int:
        return len(self._scores)

    @property
    def scores(self) -> np.ndarray:
        """Cumulative log-prob of every candidate so far, in generation order (a read-only copy)."""
        return _frozen(self._scores, np.float64)

    @property
    def candidate_tokens(self) -> np.ndarray:
        return _frozen(self._tokens, np.int64)

    @property
    def candidate_parents(self) -> np.ndarray:
        """Candidate index of each candidate's parent, -1 for level-1 nodes (the root)."""
        return _frozen(self._parent, np.int64)

    def _arrays(self, logp, ids, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """logp/ids as arrays of shape [rows, >= top_k] with integer ids, or a ValueError."""
        k = self.params.top_k
        if type(logp) is not np.ndarray or type(ids) is not np.ndarray:
            logp, ids = np.asarray(logp), np.asarray(ids)
        if logp.ndim != 2 or logp.shape != ids.shape or logp.shape[0] != rows or logp.shape[1] < k:
            raise ValueError(f"expected logp/ids of shape [{rows}, >={k}], got {logp.shape} and {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        return logp, ids

    def _rows(self, logp, ids, rows: int) -> tuple[list[list[float]], list[list[int]]]:
        """The first top_k columns of logp/ids [rows, >= top_k] as lists, checked."""
        k = self.params.top_k
        logp, ids = self._arrays(logp, ids, rows)
        lp = logp[:, :k].tolist()
        if not all(v <= 0 for row in lp for v in row):
            raise ValueError(_NOT_LOGPROBS)
        return lp, ids[:, :k].tolist()

    def _make_frontier(self, level: int) -> Frontier:
        s, k = level - 1, self.params.top_k
        views = (self._front_tokens[s], self._front_rows[s], self._front_mask[s, :, : level * k])
        for v in views:
            v.flags.writeable = False
        return Frontier(tokens=views[0], parent_rows=views[1], tree_mask=views[2], level=level)

    def add_root_children(self, logp: np.ndarray, ids: np.ndarray) -> Frontier:
        """Level 1: the root's top_k tokens (logp/ids sorted descending, length >= top_k)."""
        if self._front_cand:
            raise RuntimeError("add_root_children called twice without reset()")
        (lp,), (tk,) = self._rows(np.asarray(logp)[None], np.asarray(ids)[None], 1)
        k = self.params.top_k
        self._scores.extend(lp)
        self._tokens.extend(tk)
        self._parent.extend([-1] * k)
        self._level.extend([1] * k)
        self._front_cand.append(list(range(k)))
        self._front_tokens[0] = tk
        return self._frontiers[0]

    def add_children(self, logp: np.ndarray, ids: np.ndarray) -> Frontier:
        """Append top_k children of every frontier node; the best top_k become the next frontier.

        Row i of logp/ids is the draft's sorted top-K for frontier node i.
        """
        levels = len(self._front_cand)
        if not levels:
            raise RuntimeError("add_children before add_root_children")
        if levels > self.params.depth:
            raise RuntimeError(f"tree already has depth {self.params.depth} draft levels")
        k = self.params.top_k
        if k == 1:
            return self._add_chain_child(logp, ids, levels)
        lp, tk = self._rows(logp, ids, k)
        parents = self._front_cand[levels - 1]
        base = len(self._scores)
        sc = self._scores
        new = [sc[p] + v for p, row in zip(parents, lp, strict=True) for v in row]  # row-major: (node i, child j)
        sc.extend(new)
        for row in tk:
            self._tokens.extend(row)
        for p in parents:
            self._parent.extend([p] * k)
        self._level.extend([levels + 1] * (k * k))
        # Best k children: score descending, candidate index ascending (sorted is stable, reverse=True included).
        best = sorted(range(k * k), key=new.__getitem__, reverse=True)[:k]
        s = levels  # slot of the new frontier
        self._front_cand.append([base + b for b in best])
        rows = [b // k for b in best]  # parent's index in the current frontier = its row in the draft output
        self._front_tokens[s] = [tk[b // k][b % k] for b in best]
        self._front_rows[s] = rows
        fed, fm = levels * k, self._front_mask
        for i, r in enumerate(rows):  # row by row: cheaper than one fancy-indexed copy for small k
            fm[s, i, :fed] = fm[s - 1, r, :fed]
        return self._frontiers[s]

    def _add_chain_child(self, logp, ids, levels: int) -> Frontier:
        """``add_children`` for top_k 1: one child, no ranking; parent row 0 and the all-ancestors mask are set
        once in ``__init__``."""
        logp, ids = self._arrays(logp, ids, 1)
        lp, tok = float(logp[0, 0]), int(ids[0, 0])
        if not lp <= 0:
            raise ValueError(_NOT_LOGPROBS)
        parent = self._front_cand[levels - 1][0]
        self._front_cand.append([len(self._scores)])
        self._scores.append(self._scores[parent] + lp)
        self._tokens.append(tok)
        self._parent.append(parent)
        self._level.append(levels + 1)
        self._front_tokens[levels, 0] = tok
        return self._frontiers[levels]

    def load(self, scores: np.ndarray, tokens: np.ndarray, parents: np.ndarray) -> None:
        """This round's candidates grown elsewhere (the draft tree graph, ``export/graphs/draft_tree.py``), in this
        grower's
        generation order; arrays of at least ``top_k + depth * top_k^2`` entries, of which that many are read (a
        graph grown deeper than this tree serves it with its first levels). Then ``select`` as after growing."""
        n = len(self._levels)
        if min(len(scores), len(tokens), len(parents)) < n:
            raise ValueError(f"a tree of top_k {self.params.top_k}, depth {self.params.depth} has {n} candidates, got "
                             f"{len(scores)}")
        sc = scores[:n].tolist()
        if not all(v <= 0 for v in sc):  # a parent must outscore its children (and NaN fails too)
            raise ValueError(_NOT_LOGPROBS)
        self.reset()
        self._scores.extend(sc)
        self._tokens.extend(tokens[:n].tolist())
        self._parent.extend(parents[:n].tolist())
        self._level.extend(self._levels)

    def select(self, total_tokens: int, root_token: int, threshold: float = 0.0) -> VerifyTree:
        """The total_tokens best candidates in generation order, under the root (tree index 0).

        threshold: only candidates whose path probability ``exp(score)`` is at least this are eligible (0: all), so
        an unsure draft gets a narrower verify, down to the root alone. A parent scores at least as high as its
        children (log-probs <= 0, and adding one never rounds up), so the eligible set, and the best total_tokens of
        it, stay a connected tree."""
        count = len(self._scores)
        if not 1 <= total_tokens <= count:
            raise ValueError(f"total_tokens={total_tokens} outside 1..{count} generated candidates")
        sc = self._scores
        if threshold > 0:
            floor = math.log(threshold)
            chosen = [c for c in range(count) if sc[c] >= floor]
            if len(chosen) > total_tokens:
                chosen = sorted(sorted(chosen, key=sc.__getitem__, reverse=True)[:total_tokens])
        elif total_tokens == count:
            chosen = range(count)
        else:
            chosen = sorted(sorted(range(count), key=sc.__getitem__, reverse=True)[:total_tokens])
        tree_of = {c: i for i, c in enumerate(chosen, start=1)}
        tree_of[-1] = 0  # the root
        cand_parent, cand_token = self._parent, self._tokens
        parents = np.array([-1, *(tree_of.get(cand_parent[c], -1) for c in chosen)], dtype=np.int64)
        tokens = np.array([root_token, *(cand_token[c] for c in chosen)], dtype=np.int64)
        key = parents.tobytes()
        shape = self._shapes.get(key)
        if shape is None:
            if np.any(parents[1:] < 0):
                raise RuntimeError("selection is not connected: a selected node's parent was not selected")
            shape = VerifyTree.from_parents(tokens, parents)
            if shape.depths[1:].tolist() != [self._level[c] for c in chosen]:
                raise RuntimeError("tree depths disagree with generation levels")
            if len(self._shapes) >= self.SHAPE_CACHE:
                self._shapes.clear()
            self._shapes[key] = shape.freeze()
        return shape.with_tokens(tokens)


def _frozen(values: list, dtype) -> np.ndarray:
    a = np.array(values, dtype=dtype)
    a.flags.writeable = False
    return a

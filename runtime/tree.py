"""EAGLE-2 dynamic tree: growth level by level, then selection of the verify tree.

Policy follows the reference (SafeAILab EAGLE ``topK_genrate``): every frontier node gets
``top_k`` children scored by cumulative log-prob, the best ``top_k`` children form the next
frontier, and the ``total_tokens`` best nodes over everything generated become the verify tree
in generation order. Ties are broken by candidate index (generation order) so results are
deterministic; the reference's ``torch.topk`` leaves them unspecified.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        # CSR children lists (in tree order) so acceptance finds a child by token in O(children).
        n = self.num_nodes
        counts = np.bincount(self.parents[1:], minlength=n)
        self._child_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=self._child_ptr[1:])
        self._child_idx = np.argsort(self.parents[1:], kind="stable").astype(np.int64) + 1

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def children_of(self, i: int) -> np.ndarray:
        """Tree-order indices of node i's children, ascending."""
        return self._child_idx[self._child_ptr[i]:self._child_ptr[i + 1]]

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
        tree._child_ptr, tree._child_idx = self._child_ptr, self._child_idx
        return tree

    def freeze(self) -> VerifyTree:
        """Make the structure arrays read-only (they are shared by ``with_tokens``); returns self."""
        for a in (self.parents, self.depths, self.mask, self._child_ptr, self._child_idx):
            a.flags.writeable = False
        return self


def _top_order(scores: np.ndarray) -> np.ndarray:
    """Indices by (score descending, index ascending): stable sort of the negated scores."""
    return np.argsort(-scores, kind="stable")


class TreeGrower:
    """Grows one round's draft tree into buffers sized once from the tree parameters.

    Candidates are numbered in generation order: level-1 nodes 0..k-1, then each
    ``add_children`` call appends k*k children row-major (frontier node i, child j).

    It runs between graph calls every round, so it is written for small k: buffers and the per-level
    ``Frontier`` views are made once here, and a verify tree's structure is built once per distinct shape.
    """

    SHAPE_CACHE = 512  # distinct verify-tree shapes kept (a chain has one; top_k 2 trees a few dozen)

    def __init__(self, params: TreeParams) -> None:
        self.params = params
        k, d = params.top_k, params.depth
        n = params.max_candidates
        self._scores = np.empty(n, dtype=np.float64)
        self._tokens = np.empty(n, dtype=np.int64)
        self._parent = np.empty(n, dtype=np.int64)  # candidate index of parent, -1 = root
        self._level = np.empty(n, dtype=np.int64)
        # Per-level frontier state; level L lives at slot L-1 and stays valid until reset().
        self._front_cand = np.empty((d + 1, k), dtype=np.int64)
        self._front_tokens = np.empty((d + 1, k), dtype=np.int64)
        self._front_rows = np.empty((d + 1, k), dtype=np.int64)
        self._front_mask = np.zeros((d + 1, k, (d + 1) * k), dtype=bool)
        for s in range(d + 1):  # each level's own k rows: the identity block, the same every round
            self._front_mask[s, :, s * k:(s + 1) * k] = np.eye(k, dtype=bool)
        self._frontiers = [self._make_frontier(level) for level in range(1, d + 2)]
        self._row_of_child = np.repeat(np.arange(k, dtype=np.int64), k)  # child c of a level: frontier row c // k
        self._shapes: dict[bytes, VerifyTree] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the current round (buffers are reused, not reallocated)."""
        self._count = 0
        self._levels = 0  # frontiers produced so far

    @property
    def num_candidates(self) -> int:
        return self._count

    @property
    def scores(self) -> np.ndarray:
        """Cumulative log-prob of every candidate so far, in generation order (read-only view)."""
        return self._view(self._scores)

    @property
    def candidate_tokens(self) -> np.ndarray:
        return self._view(self._tokens)

    @property
    def candidate_parents(self) -> np.ndarray:
        """Candidate index of each candidate's parent, -1 for level-1 nodes (the root)."""
        return self._view(self._parent)

    def _view(self, buf: np.ndarray) -> np.ndarray:
        v = buf[: self._count]
        v.flags.writeable = False
        return v

    def _check(self, logp: np.ndarray, ids: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.params.top_k
        if type(logp) is not np.ndarray or type(ids) is not np.ndarray:
            logp, ids = np.asarray(logp), np.asarray(ids)
        if logp.ndim != 2 or logp.shape != ids.shape or logp.shape[0] != rows or logp.shape[1] < k:
            raise ValueError(f"expected logp/ids of shape [{rows}, >={k}], got {logp.shape} and {ids.shape}")
        logp, ids = logp[:, :k], ids[:, :k]
        # Log-probs <= 0 (NaN fails too: max propagates it) is what makes a parent outscore its children.
        if not logp.max() <= 0:
            raise ValueError("log-probs must be <= 0 and not NaN")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        return logp, ids

    def _make_frontier(self, level: int) -> Frontier:
        s, k = level - 1, self.params.top_k
        views = (self._front_tokens[s], self._front_rows[s], self._front_mask[s, :, : level * k])
        for v in views:
            v.flags.writeable = False
        return Frontier(tokens=views[0], parent_rows=views[1], tree_mask=views[2], level=level)

    def add_root_children(self, logp: np.ndarray, ids: np.ndarray) -> Frontier:
        """Level 1: the root's top_k tokens (logp/ids sorted descending, length >= top_k)."""
        if self._levels:
            raise RuntimeError("add_root_children called twice without reset()")
        logp, ids = self._check(np.asarray(logp)[None], np.asarray(ids)[None], 1)
        k = self.params.top_k
        self._scores[:k] = logp[0]
        self._tokens[:k] = ids[0]
        self._parent[:k] = -1
        self._level[:k] = 1
        self._count = k
        self._front_cand[0] = np.arange(k)
        self._front_tokens[0] = ids[0]
        self._front_rows[0] = 0  # level 1 is fed from the last context row
        self._levels = 1
        return self._frontiers[0]

    def add_children(self, logp: np.ndarray, ids: np.ndarray) -> Frontier:
        """Append top_k children of every frontier node; the best top_k become the next frontier.

        Row i of logp/ids is the draft's sorted top-K for frontier node i.
        """
        if not self._levels:
            raise RuntimeError("add_children before add_root_children")
        if self._levels > self.params.depth:
            raise RuntimeError(f"tree already has depth {self.params.depth} draft levels")
        k = self.params.top_k
        s = self._levels - 1  # slot of the current frontier
        logp, ids = self._check(logp, ids, k)
        base, n = self._count, k * k
        end = base + n
        fed = self._levels * k
        if k == 1:  # a chain: one child, no ranking
            parent = int(self._front_cand[s, 0])
            self._scores[base] = self._scores[parent] + float(logp[0, 0])
            token = self._tokens[base] = ids[0, 0]
            self._parent[base] = parent
            self._front_cand[s + 1, 0] = base
            self._front_tokens[s + 1, 0] = token
            self._front_rows[s + 1, 0] = 0
            self._front_mask[s + 1, 0, :fed] = True
        else:
            parents = self._front_cand[s]
            scores = self._scores[base:end]
            np.add(self._scores[parents][:, None], logp, out=scores.reshape(k, k))
            self._tokens[base:end] = ids.ravel()
            self._parent[base:end] = parents[self._row_of_child]
            best = _top_order(scores)[:k]
            rows = self._row_of_child[best]  # parent's index in the current frontier = its row in the draft output
            self._front_cand[s + 1] = best + base
            self._front_tokens[s + 1] = self._tokens[base + best]
            self._front_rows[s + 1] = rows
            self._front_mask[s + 1, :, :fed] = self._front_mask[s, rows, :fed]
        self._level[base:end] = self._levels + 1
        self._count = end
        self._levels += 1
        return self._frontiers[s + 1]

    def select(self, total_tokens: int, root_token: int) -> VerifyTree:
        """The total_tokens best candidates in generation order, under the root (tree index 0)."""
        count = self._count
        if not 1 <= total_tokens <= count:
            raise ValueError(f"total_tokens={total_tokens} outside 1..{count} generated candidates")
        if total_tokens == count:
            chosen = np.arange(count)
        else:
            chosen = np.sort(_top_order(self._scores[:count])[:total_tokens])
        # Map candidate index -> tree index (root's children point at tree index 0).
        tree_of = np.empty(count + 1, dtype=np.int64)  # slot count: "the root", reached through parent -1
        tree_of[:] = -1
        tree_of[count] = 0
        tree_of[chosen] = np.arange(1, total_tokens + 1)
        parents = np.empty(total_tokens + 1, dtype=np.int64)
        parents[0] = -1
        parents[1:] = tree_of[self._parent[chosen]]  # parent -1 indexes slot count
        tokens = np.empty(total_tokens + 1, dtype=np.int64)
        tokens[0] = root_token
        tokens[1:] = self._tokens[chosen]
        key = parents.tobytes()
        shape = self._shapes.get(key)
        if shape is None:
            if np.any(parents[1:] < 0):
                raise RuntimeError("selection is not connected: a selected node's parent was not selected")
            shape = VerifyTree.from_parents(tokens, parents)
            if not np.array_equal(shape.depths[1:], self._level[chosen]):
                raise RuntimeError("tree depths disagree with generation levels")
            if len(self._shapes) >= self.SHAPE_CACHE:
                self._shapes.clear()
            self._shapes[key] = shape.freeze()
        return shape.with_tokens(tokens)

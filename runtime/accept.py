"""Acceptance of a verified draft tree: greedy (longest path matching the target's argmax) and
sampling (recursive rejection over the tree, which keeps the target's distribution exactly)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import sample_token
from .tree import VerifyTree


@dataclass
class Accepted:
    """Accepted path: ``indices`` root first (len = accepted draft tokens + 1), ``tokens`` root excluded."""

    indices: np.ndarray  # int64, tree-order indices
    tokens: np.ndarray  # int64, accepted draft tokens
    bonus: int  # greedy: target argmax at the last accepted node; sampling: drawn there (see accept_sampling)

    @property
    def num_accepted(self) -> int:
        return int(self.tokens.shape[0])


def accept_greedy(tree: VerifyTree, target_argmax: np.ndarray) -> Accepted:
    """Walk from the root while a child's token equals the target's argmax at the current node.

    Siblings carry distinct tokens (top-k), so at most one child matches and the walk is unique.
    """
    target_argmax = np.asarray(target_argmax)
    if target_argmax.shape != (tree.num_nodes,):
        raise ValueError(f"target_argmax has shape {target_argmax.shape}, expected ({tree.num_nodes},)")
    best, tokens, kids = target_argmax.tolist(), tree.tokens.tolist(), tree.children_lists()
    path, node = [0], 0
    while True:
        want = best[node]
        for child in kids[node]:
            if tokens[child] == want:
                break
        else:
            break
        path.append(child)
        node = child
    indices = np.array(path, dtype=np.int64)
    return Accepted(indices=indices, tokens=np.array([tokens[i] for i in path[1:]], dtype=np.int64),
                    bonus=best[node])


def accept_sampling(tree: VerifyTree, probs, rng: np.random.Generator) -> Accepted:
    """Recursive rejection over the tree (EAGLE's sampling acceptance).

    ``probs[i]`` is the target's processed distribution (``sampling.process_logits``) at tree node
    i: a [T, V] array, or a ``sampling.LazyProbs`` that processes only the rows this walk visits.
    At the current node, try its children in tree order: accept child x with probability p(x);
    on rejection set p(x) = 0 and renormalise before the next sibling. An accepted child becomes
    the current node. When every child is rejected, the bonus is drawn from the residual p; when
    the node has no children (a full path was accepted), from the node's own distribution.

    The drafts are deterministic top-k, i.e. a proposal q that is one-hot on each sibling in turn,
    so this is speculative sampling's "accept with min(1, p/q), else draw from norm(max(p - q, 0))"
    applied sibling after sibling: the committed token at every node is distributed exactly as p
    (docs/runtime.md, "Sampling", has the proof). Uses one uniform draw per tried child plus one
    for a bonus.
    """
    if len(probs) != tree.num_nodes:
        raise ValueError(f"probs has {len(probs)} rows, expected {tree.num_nodes}")
    node = 0
    while True:
        p = np.array(probs[node], dtype=np.float64)  # a copy: rejections modify it
        mass = total = p.sum()  # total: the mass left after the rejections so far (renormalising lazily)
        accepted = -1
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            px = p[x]
            if rng.random() * total < px:  # u < p(x) / total
                accepted = int(child)
                break
            p[x] = 0.0
            total -= px
            if total <= 1e-9 * mass:  # cancellation: recount exactly
                total = p.sum()
                if not total > 0:
                    # x held all the remaining mass (probability 1 in exact arithmetic): rejected only by
                    # rounding. Accept it rather than draw from an empty residual.
                    p[x] = px
                    accepted = int(child)
                    break
        if accepted < 0:
            break
        node = accepted
    path = _path_to(tree, node)
    return Accepted(indices=path, tokens=tree.tokens[path[1:]].copy(), bonus=sample_token(p, rng))


def _path_to(tree: VerifyTree, node: int) -> np.ndarray:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return np.asarray(path[::-1], dtype=np.int64)

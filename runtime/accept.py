"""Acceptance of a verified draft tree: greedy (longest path matching the target's argmax) and
sampling (each committed token drawn from the target's distribution, a child accepted when the draw is its token),
which keeps the target's distribution exactly."""

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
    """Sampling acceptance over the tree: at each node, draw the next token from the target's distribution there;
    if it is a child's token, step to that child and go on; else it is the bonus.

    ``probs[i]`` is the target's processed distribution (``sampling.process_logits``) at tree node i: a [T, V]
    array, or a ``sampling.LazyProbs`` that processes only the rows this walk visits. Each committed token is one
    draw of ``sampling.sample_token`` (one uniform, the inverse of the row's cumulative distribution), exactly what
    a plain decoding step draws for it: so every committed token has the target's distribution, and a request's
    tokens for a seed do not depend on the tree, on whether a round drafted, or on the draft at all.

    The drafts are deterministic top-k, i.e. a proposal q one-hot on each child: a child x is accepted with
    probability p(x), as recursive rejection (speculative sampling's "accept with min(1, p/q), else draw from
    norm(max(p - q, 0))", sibling after sibling) accepts it, and the bonus is drawn from p restricted to the other
    tokens, its residual: the same acceptance, with the draws coupled to plain decoding's (docs/runtime.md,
    "Sampling", has the argument).
    """
    if len(probs) != tree.num_nodes:
        raise ValueError(f"probs has {len(probs)} rows, expected {tree.num_nodes}")
    tokens, kids = tree.tokens.tolist(), tree.children_lists()
    node = 0
    while True:
        x = sample_token(probs[node], rng)
        for child in kids[node]:
            if tokens[child] == x:
                break
        else:
            break
        node = child
    path = _path_to(tree, node)
    return Accepted(indices=path, tokens=tree.tokens[path[1:]].copy(), bonus=x)


def _path_to(tree: VerifyTree, node: int) -> np.ndarray:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return np.asarray(path[::-1], dtype=np.int64)

"""Greedy acceptance of a verified draft tree (EAGLE: longest path matching the target's argmax)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import VerifyTree


@dataclass
class Accepted:
    """Accepted path: ``indices`` root first (len = accepted draft tokens + 1), ``tokens`` root excluded."""

    indices: np.ndarray  # int64, tree-order indices
    tokens: np.ndarray  # int64, accepted draft tokens
    bonus: int  # target argmax at the last accepted node

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
    path = [0]
    while (nxt := tree.child_with_token(path[-1], int(target_argmax[path[-1]]))) >= 0:
        path.append(nxt)
    indices = np.asarray(path, dtype=np.int64)
    return Accepted(indices=indices, tokens=tree.tokens[indices[1:]].copy(),
                    bonus=int(target_argmax[path[-1]]))

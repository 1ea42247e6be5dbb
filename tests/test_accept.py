"""Greedy acceptance: hand-built trees with known answers, then a brute-force check over all
root-to-leaf paths of grown trees. Sampling acceptance: the same hand tree with deterministic
distributions, and agreement with greedy acceptance when every distribution is one-hot (the
statistical checks are in test_sampling.py and test_sampling_lossless.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree import ROOT, grow, grow_hand_tree, grown_trees

from eagle_export.runtime.accept import accept_greedy, accept_sampling
from eagle_export.runtime.tree import VerifyTree


@pytest.fixture
def tree() -> VerifyTree:
    """Tree order: 0 root, 1:10(p0), 2:11(p0), 3:20(p1), 4:22(p2), 5:30(p4), 6:32(p3)."""
    g, _ = grow_hand_tree()
    t = g.select(6, ROOT)
    np.testing.assert_array_equal(t.tokens, [ROOT, 10, 11, 20, 22, 30, 32])
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 1, 2, 4, 3])
    return t


def argmax_for(tree: VerifyTree, **at: int) -> np.ndarray:
    """Target argmax per node; nodes not named get a token no child carries."""
    out = np.full(tree.num_nodes, 1000, dtype=np.int64)
    for name, tok in at.items():
        out[int(name[1:])] = tok
    return out


def check(acc, indices, tokens, bonus) -> None:
    np.testing.assert_array_equal(acc.indices, indices)
    np.testing.assert_array_equal(acc.tokens, tokens)
    assert acc.indices.dtype == np.int64 and acc.tokens.dtype == np.int64
    assert acc.bonus == bonus and isinstance(acc.bonus, int)
    assert acc.num_accepted == len(tokens)


def test_full_path_through_second_child(tree):
    # root's second child (11), then its only child, down to a leaf: all 3 accepted + bonus
    acc = accept_greedy(tree, argmax_for(tree, n0=11, n2=22, n4=30, n5=77))
    check(acc, [0, 2, 4, 5], [11, 22, 30], 77)


def test_full_path_first_branch(tree):
    check(accept_greedy(tree, argmax_for(tree, n0=10, n1=20, n3=32, n6=5)), [0, 1, 3, 6], [10, 20, 32], 5)


def test_reject_at_root_gives_bonus_only(tree):
    check(accept_greedy(tree, argmax_for(tree, n0=55, n1=20)), [0], [], 55)


def test_partial_path(tree):
    # 10 and 20 accepted, the target wants 99 after 20 but the only child there is 32
    check(accept_greedy(tree, argmax_for(tree, n0=10, n1=20, n3=99)), [0, 1, 3], [10, 20], 99)


def test_argmax_off_path_is_ignored(tree):
    # node 2's argmax would match its child, but the walk never reaches node 2
    check(accept_greedy(tree, argmax_for(tree, n0=10, n1=44, n2=22)), [0, 1], [10], 44)


def test_root_only_tree_and_bad_shape():
    t = VerifyTree.from_parents(np.array([5]), np.array([-1]))
    check(accept_greedy(t, np.array([9])), [0], [], 9)
    with pytest.raises(ValueError):
        accept_greedy(t, np.array([9, 9]))


def all_paths(tree: VerifyTree) -> list[list[int]]:
    """Every root-to-leaf path, found by walking each leaf's parent chain."""
    paths = []
    for leaf in range(tree.num_nodes):
        if np.any(tree.parents == leaf):
            continue
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = int(tree.parents[j])
        paths.append(path[::-1])
    return paths


@settings(max_examples=100, deadline=None)
@given(grown_trees(), st.data())
def test_accept_matches_brute_force_over_paths(case, data):
    params, levels = case
    g, _ = grow(params, levels)
    tree = g.select(params.total_tokens, ROOT)
    # Bias the target toward some child's token so long accepted paths are common.
    target = np.empty(tree.num_nodes, dtype=np.int64)
    for i in range(tree.num_nodes):
        options = tree.tokens[tree.children_of(i)].tolist() + [100]
        target[i] = data.draw(st.sampled_from(options))
    acc = accept_greedy(tree, target)

    assert acc.indices[0] == 0
    for a, b in zip(acc.indices[:-1], acc.indices[1:], strict=True):
        assert tree.parents[b] == a  # a root-started path
    np.testing.assert_array_equal(acc.tokens, tree.tokens[acc.indices[1:]])

    best: list[int] = [0]
    for path in all_paths(tree):
        n = 1
        while n < len(path) and tree.tokens[path[n]] == target[path[n - 1]]:
            n += 1
        if n > len(best):
            best = path[:n]
    np.testing.assert_array_equal(acc.indices, best)
    np.testing.assert_array_equal(acc.tokens, tree.tokens[best[1:]])
    assert acc.bonus == target[best[-1]]


# ---- sampling acceptance -----------------------------------------------------------------------

VOCAB = 101  # covers every token of the hand tree and the grown trees (ids < 100) plus 100


def one_hot_rows(tokens: np.ndarray) -> np.ndarray:
    rows = np.zeros((len(tokens), VOCAB))
    rows[np.arange(len(tokens)), tokens] = 1.0
    return rows


def test_sampling_full_path_bonus_from_last_node(tree):
    # Certain acceptance down 11 -> 22 -> 30, then the bonus comes from node 5's own distribution.
    probs = one_hot_rows(argmax_for(tree, n0=11, n2=22, n4=30, n5=77) % VOCAB)
    for seed in range(5):
        check(accept_sampling(tree, probs, np.random.default_rng(seed)), [0, 2, 4, 5], [11, 22, 30], 77)


def test_sampling_children_without_mass_are_never_accepted(tree):
    # The root gives its children 10 and 11 no mass: always rejected, bonus from the residual.
    probs = np.full((tree.num_nodes, VOCAB), 1.0 / VOCAB)
    probs[0] = 0.0
    probs[0, [10, 11, 55]] = [0.0, 0.0, 1.0]
    rng = np.random.default_rng(0)
    for _ in range(50):
        check(accept_sampling(tree, probs, rng), [0], [], 55)


def test_sampling_residual_excludes_rejected_children(tree):
    # Root: half on 10, half on 11. If 10 is rejected, 11 carries all the residual mass: always accepted.
    probs = np.full((tree.num_nodes, VOCAB), 1.0 / VOCAB)
    probs[0] = 0.0
    probs[0, [10, 11]] = 0.5
    rng = np.random.default_rng(0)
    firsts = {int(accept_sampling(tree, probs, rng).indices[1]) for _ in range(100)}
    assert firsts == {1, 2}


class _AlmostOne:
    """An rng whose uniform draws are all the largest double below 1 (the worst case for rounding)."""

    def random(self) -> float:
        return float(np.nextafter(1.0, 0.0))


def test_sampling_all_mass_on_children_never_leaves_an_empty_residual(tree):
    # Root: 0.7 on 10 and 0.3 on 11. With u = 1 - 2**-53, 10 is rejected and the residual 0.3 /
    # (1 - 0.7) rounds just below 1: 11 must still be accepted, not a bonus drawn from nothing.
    probs = np.full((tree.num_nodes, VOCAB), 1.0 / VOCAB)
    probs[0] = 0.0
    probs[0, [10, 11]] = [0.7, 0.3]
    acc = accept_sampling(tree, probs, _AlmostOne())
    assert acc.indices[:2].tolist() == [0, 2]


@settings(max_examples=100, deadline=None)
@given(grown_trees(), st.data())
def test_sampling_with_one_hot_distributions_equals_greedy(case, data):
    params, levels = case
    g, _ = grow(params, levels)
    tree = g.select(params.total_tokens, ROOT)
    target = np.empty(tree.num_nodes, dtype=np.int64)
    for i in range(tree.num_nodes):
        target[i] = data.draw(st.sampled_from(tree.tokens[tree.children_of(i)].tolist() + [100]))
    want = accept_greedy(tree, target)
    got = accept_sampling(tree, one_hot_rows(target), np.random.default_rng(data.draw(st.integers(0, 2**32))))
    check(got, want.indices, want.tokens, want.bonus)

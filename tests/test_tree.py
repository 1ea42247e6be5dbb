"""EAGLE-2 tree growth and selection: hand-built cases with known answers, then properties
checked against a plain-Python reference of the policy (score desc, candidate index asc)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_export.runtime.tree import TreeGrower, VerifyTree
from eagle_export.tree_params import TreeParams, candidate_count

ROOT = 99


def arr(*rows):
    return np.array(rows, dtype=np.float64)


def grow_hand_tree() -> tuple[TreeGrower, list]:
    """top_k=2, depth=2; dyadic log-probs so sums are exact and ties are real ties.

    Candidates (index: token score): c0:10 -0.25, c1:11 -0.5 | c2:20 -0.75, c3:21 -1.25,
    c4:22 -0.625, c5:23 -1.25 | c6:30 -0.75, c7:31 -1.125, c8:32 -0.75, c9:33 -2.75.
    """
    g = TreeGrower(TreeParams(top_k=2, depth=2, total_tokens=5))
    f1 = g.add_root_children(np.array([-0.25, -0.5, -4.0]), np.array([10, 11, 12]))
    f2 = g.add_children(arr([-0.5, -1.0, -3.0], [-0.125, -0.75, -3.0]), np.array([[20, 21, 5], [22, 23, 6]]))
    # frontier rows: 0 = c4 (token 22), 1 = c2 (token 20)
    f3 = g.add_children(arr([-0.125, -0.5, -3.0], [0.0, -2.0, -3.0]), np.array([[30, 31, 7], [32, 33, 8]]))
    return g, [f1, f2, f3]


def test_hand_tree_candidates_and_frontiers():
    g, (f1, f2, f3) = grow_hand_tree()
    assert g.num_candidates == g.params.max_candidates == 10
    np.testing.assert_array_equal(
        g.scores, [-0.25, -0.5, -0.75, -1.25, -0.625, -1.25, -0.75, -1.125, -0.75, -2.75])
    np.testing.assert_array_equal(g.candidate_tokens, [10, 11, 20, 21, 22, 23, 30, 31, 32, 33])
    np.testing.assert_array_equal(g.candidate_parents, [-1, -1, 0, 0, 1, 1, 4, 4, 2, 2])

    assert f1.level == 1 and f1.fed == 0
    np.testing.assert_array_equal(f1.tokens, [10, 11])
    np.testing.assert_array_equal(f1.parent_rows, [0, 0])  # both fed from the last context row
    np.testing.assert_array_equal(f1.tree_mask, np.eye(2, dtype=bool))

    # c4 (-0.625) beats c2 (-0.75); the parent of c4 is level-1 row 1.
    assert f2.level == 2 and f2.fed == 2
    np.testing.assert_array_equal(f2.tokens, [22, 20])
    np.testing.assert_array_equal(f2.parent_rows, [1, 0])
    np.testing.assert_array_equal(f2.tree_mask, [[0, 1, 1, 0], [1, 0, 0, 1]])

    # c6 and c8 tie at -0.75: lower candidate index (c6) first.
    assert f3.level == 3 and f3.fed == 4
    np.testing.assert_array_equal(f3.tokens, [30, 32])
    np.testing.assert_array_equal(f3.parent_rows, [0, 1])
    np.testing.assert_array_equal(f3.tree_mask, [[0, 1, 1, 0, 1, 0], [1, 0, 0, 1, 0, 1]])
    for f in (f1, f2, f3):
        assert f.tokens.dtype == np.int64 and f.parent_rows.dtype == np.int64 and f.tree_mask.dtype == bool


def check_tree(tree: VerifyTree, tokens, parents, depths) -> None:
    np.testing.assert_array_equal(tree.tokens, tokens)
    np.testing.assert_array_equal(tree.parents, parents)
    np.testing.assert_array_equal(tree.depths, depths)
    np.testing.assert_array_equal(tree.mask, brute_mask(np.asarray(parents)))
    assert tree.num_nodes == len(tokens)


def test_hand_tree_selection():
    g, _ = grow_hand_tree()
    # best 5: c0 c1 c4 c2 c6 (c2 and c6 tie at -0.75, c8 too: lowest indices win); generation order.
    t5 = g.select(5, ROOT)
    check_tree(t5, [ROOT, 10, 11, 20, 22, 30], [-1, 0, 0, 1, 2, 4], [0, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(t5.mask, [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1, 1],
    ])
    t6 = g.select(6, ROOT)
    check_tree(t6, [ROOT, 10, 11, 20, 22, 30, 32], [-1, 0, 0, 1, 2, 4, 3], [0, 1, 1, 2, 2, 3, 3])
    # c3 and c5 tie at -1.25: c3 is taken.
    t8 = g.select(8, ROOT)
    check_tree(t8, [ROOT, 10, 11, 20, 21, 22, 30, 31, 32], [-1, 0, 0, 1, 1, 2, 5, 5, 3],
               [0, 1, 1, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(t8.children_of(0), [1, 2])
    np.testing.assert_array_equal(t8.children_of(1), [3, 4])
    np.testing.assert_array_equal(t8.children_of(5), [6, 7])
    assert t8.children_of(8).size == 0
    assert t8.child_with_token(5, 31) == 7 and t8.child_with_token(5, 32) == -1


def test_total_tokens_below_top_k_times_depth():
    g, _ = grow_hand_tree()
    check_tree(g.select(3, ROOT), [ROOT, 10, 11, 22], [-1, 0, 0, 2], [0, 1, 1, 2])
    check_tree(g.select(1, ROOT), [ROOT, 10], [-1, 0], [0, 1])


def test_top_k_one_is_a_chain():
    g = TreeGrower(TreeParams(top_k=1, depth=3, total_tokens=4))
    f = g.add_root_children(np.array([-0.5, -1.0]), np.array([7, 8]))
    for level, tok in enumerate([3, 4, 5], start=2):
        f = g.add_children(np.array([[-0.25, -2.0]]), np.array([[tok, 0]]))
        assert f.level == level
        np.testing.assert_array_equal(f.parent_rows, [0])
        np.testing.assert_array_equal(f.tree_mask, np.ones((1, level), dtype=bool))
    tree = g.select(4, ROOT)
    check_tree(tree, [ROOT, 7, 3, 4, 5], [-1, 0, 1, 2, 3], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(tree.mask, np.tril(np.ones((5, 5), dtype=bool)))


def test_depth_zero():
    g = TreeGrower(TreeParams(top_k=3, depth=0, total_tokens=2))
    f = g.add_root_children(np.array([-0.5, -0.5, -1.0, -2.0]), np.array([4, 5, 6, 7]))
    np.testing.assert_array_equal(f.tokens, [4, 5, 6])
    check_tree(g.select(2, ROOT), [ROOT, 4, 5], [-1, 0, 0], [0, 1, 1])
    with pytest.raises(RuntimeError):
        g.add_children(np.zeros((3, 3)) - 1, np.zeros((3, 3), dtype=np.int64))


def _grow_random(params: TreeParams, rng: np.random.Generator, logp: np.ndarray) -> TreeGrower:
    """A tree of ``params`` grown from ``logp`` [levels + 1, k, k + 1] (dyadic log-probs, zeros among them: a child
    that ties its parent), level by level, with token ids unique per candidate."""
    g, k = TreeGrower(params), params.top_k
    g.add_root_children(logp[0, 0], np.arange(k + 1))
    for level in range(1, params.depth + 1):
        g.add_children(logp[level, :, :], 100 * level + np.arange(k * (k + 1)).reshape(k, k + 1))
    return g


def test_trimmed_trees_verify_the_same_nodes():
    """TreeParams.trimmed cuts depth to total_tokens - 1: the levels it drops are never selected, with ties (a child
    whose log-prob is 0) and with a threshold, so the verify trees are identical (planted: a cut to total_tokens - 2
    loses the chain's deepest node; selection that took a child before its tied parent would differ too)."""
    rng = np.random.default_rng(7)
    assert TreeParams(1, 8, 8).trimmed() == TreeParams(1, 7, 8)
    assert TreeParams(4, 3, 12).trimmed() == TreeParams(4, 3, 12)
    assert TreeParams(2, 6, 3, 0.05).trimmed() == TreeParams(2, 2, 3, 0.05)
    assert TreeParams(3, 2, 1).trimmed() == TreeParams(3, 1, 1)  # not below 1 (the tree graph has no depth 0)
    assert TreeParams(3, 0, 1).trimmed() == TreeParams(3, 0, 1)
    cut = 0
    for _ in range(500):
        k, depth = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        full = TreeParams(k, depth, int(rng.integers(1, candidate_count(k, depth) + 1)),
                          float(rng.choice([0.0, 0.05, 0.3])))
        short = full.trimmed()
        assert short.validate() and short.total_tokens <= short.max_candidates
        if short == full:
            continue
        cut += 1
        logp = -rng.integers(0, 6, size=(depth + 1, k, k + 1)) / 4.0  # ties and zeros on purpose
        a = _grow_random(full, rng, logp).select(full.total_tokens, ROOT, full.threshold)
        b = _grow_random(short, rng, logp).select(short.total_tokens, ROOT, short.threshold)
        for name in ("tokens", "parents", "depths", "mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{full} -> {short}")
    assert cut > 100


def test_reset_reuses_buffers_and_frontiers_stay_valid():
    g, (f1, f2, f3) = grow_hand_tree()
    first = g.select(6, ROOT)
    mask_buf = f3.tree_mask.base
    np.testing.assert_array_equal(f2.tree_mask, [[0, 1, 1, 0], [1, 0, 0, 1]])  # not clobbered by level 3
    with pytest.raises(ValueError):
        f1.tokens[0] = 1  # read-only views
    g.reset()
    assert g.num_candidates == 0
    f1b = g.add_root_children(np.array([-0.25, -0.5, -4.0]), np.array([10, 11, 12]))
    g.add_children(arr([-0.5, -1.0], [-0.125, -0.75]), np.array([[20, 21], [22, 23]]))
    f3b = g.add_children(arr([-0.125, -0.5], [0.0, -2.0]), np.array([[30, 31], [32, 33]]))
    assert f3b.tree_mask.base is mask_buf and f1b.level == 1
    second = g.select(6, ROOT)
    np.testing.assert_array_equal(first.tokens, second.tokens)
    np.testing.assert_array_equal(first.mask, second.mask)


def test_bad_inputs():
    g = TreeGrower(TreeParams(top_k=2, depth=1, total_tokens=3))
    with pytest.raises(RuntimeError):
        g.add_children(arr([-1.0, -2.0], [-1.0, -2.0]), np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        g.add_root_children(np.array([-1.0]), np.array([1]))  # fewer than top_k
    with pytest.raises(ValueError):
        g.add_root_children(np.array([0.5, -1.0]), np.array([1, 2]))  # not a log-prob
    with pytest.raises(ValueError):
        g.add_root_children(np.array([np.nan, -1.0]), np.array([1, 2]))
    g.add_root_children(np.array([-1.0, -2.0]), np.array([1, 2]))
    with pytest.raises(RuntimeError):
        g.add_root_children(np.array([-1.0, -2.0]), np.array([1, 2]))
    with pytest.raises(ValueError):
        g.add_children(np.array([[-1.0, -2.0]]), np.array([[1, 2]]))  # one row for a 2-node frontier
    with pytest.raises(ValueError):
        g.select(3, ROOT)  # only 2 candidates so far
    with pytest.raises(ValueError):
        g.select(0, ROOT)


def test_bad_inputs_chain():
    """top_k 1 has its own fast path: it refuses the same bad input."""
    g = TreeGrower(TreeParams(top_k=1, depth=2, total_tokens=3))
    g.add_root_children(np.array([-1.0]), np.array([1]))
    for logp, ids in ((np.array([[0.5]]), np.array([[2]])), (np.array([[np.nan]]), np.array([[2]])),
                      (np.array([[-1.0], [-1.0]]), np.array([[2], [3]])), (np.array([[-1.0]]), np.array([[2.0]]))):
        with pytest.raises(ValueError):
            g.add_children(logp, ids)
    g.add_children([[-0.5, -3.0]], [[2, 9]])  # lists are fine; extra columns are ignored
    g.add_children(np.array([[-0.25]]), np.array([[3]]))
    with pytest.raises(RuntimeError):
        g.add_children(np.array([[-0.25]]), np.array([[4]]))  # past depth
    check_tree(g.select(3, ROOT), [ROOT, 1, 2, 3], [-1, 0, 1, 2], [0, 1, 2, 3])
    np.testing.assert_array_equal(g.scores, [-1.0, -1.5, -1.75])


def test_from_parents_rejects_bad_order():
    with pytest.raises(ValueError):
        VerifyTree.from_parents(np.array([1, 2, 3]), np.array([-1, 2, 0]))
    with pytest.raises(ValueError):
        VerifyTree.from_parents(np.array([1, 2]), np.array([0, -1]))


# ---------------------------------------------------------------- properties

def brute_mask(parents: np.ndarray) -> np.ndarray:
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def reference_policy(k: int, levels: list[tuple[np.ndarray, np.ndarray]], total: int):
    """Plain-Python restatement of the policy: returns candidates, frontiers, selected indices."""
    cands: list[tuple[float, int, int]] = []  # (score, token, parent candidate)
    lp0, id0 = levels[0]
    for j in range(k):
        cands.append((float(lp0[0, j]), int(id0[0, j]), -1))
    frontiers = [list(range(k))]
    for lp, ids in levels[1:]:
        base = len(cands)
        for i, parent in enumerate(frontiers[-1]):
            for j in range(k):
                cands.append((cands[parent][0] + float(lp[i, j]), int(ids[i, j]), parent))
        kids = sorted(range(base, len(cands)), key=lambda c: (-cands[c][0], c))
        frontiers.append(kids[:k])
    chosen = sorted(sorted(range(len(cands)), key=lambda c: (-cands[c][0], c))[:total])
    return cands, frontiers, chosen


logp_value = st.one_of(
    st.integers(-16, -1).map(lambda q: q / 4.0),  # coarse grid: frequent exact ties
    st.floats(-8.0, -1e-3, allow_nan=False),
)


@st.composite
def grown_trees(draw, vocab: int = 8):
    k = draw(st.integers(1, 3))
    depth = draw(st.integers(0, 3))
    width = draw(st.integers(k, min(k + 2, vocab)))
    total = draw(st.integers(1, k + depth * k * k))
    levels = []
    for rows in [1] + [k] * depth:
        lp = np.array([sorted(draw(st.lists(logp_value, min_size=width, max_size=width)), reverse=True)
                       for _ in range(rows)])
        ids = np.array([draw(st.permutations(range(vocab)))[:width] for _ in range(rows)], dtype=np.int64)
        levels.append((lp, ids))
    return TreeParams(top_k=k, depth=depth, total_tokens=total), levels


def grow(params: TreeParams, levels):
    g = TreeGrower(params)
    fronts = [g.add_root_children(levels[0][0][0], levels[0][1][0])]
    fronts += [g.add_children(lp, ids) for lp, ids in levels[1:]]
    return g, fronts


@settings(max_examples=100, deadline=None)
@given(grown_trees())
def test_growth_and_selection_match_reference(case):
    params, levels = case
    k = params.top_k
    g, fronts = grow(params, levels)
    tree = g.select(params.total_tokens, ROOT)
    cands, ref_fronts, chosen = reference_policy(k, levels, params.total_tokens)

    np.testing.assert_allclose(g.scores, [c[0] for c in cands], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(g.candidate_tokens, [c[1] for c in cands])
    np.testing.assert_array_equal(g.candidate_parents, [c[2] for c in cands])

    level_of = {c: lvl for lvl, fr in enumerate(ref_fronts) for c in fr}  # frontier slot of a candidate
    for lvl, (f, ref) in enumerate(zip(fronts, ref_fronts, strict=True)):
        assert f.level == lvl + 1 and f.tree_mask.shape == (k, (lvl + 1) * k)
        np.testing.assert_array_equal(f.tokens, [cands[c][1] for c in ref])
        if lvl == 0:
            np.testing.assert_array_equal(f.parent_rows, np.zeros(k))
        else:
            prev = ref_fronts[lvl - 1]
            np.testing.assert_array_equal(f.parent_rows, [prev.index(cands[c][2]) for c in ref])
        expect = np.zeros((k, (lvl + 1) * k), dtype=bool)
        for i, c in enumerate(ref):
            a = c
            while a >= 0:  # every ancestor-or-self sits in exactly one fed frontier row
                expect[i, level_of[a] * k + ref_fronts[level_of[a]].index(a)] = True
                a = cands[a][2]
        np.testing.assert_array_equal(f.tree_mask, expect)

    n = params.total_tokens + 1
    assert tree.num_nodes == n and tree.tokens[0] == ROOT
    np.testing.assert_array_equal(tree.tokens[1:], [cands[c][1] for c in chosen])
    tree_of = {c: t + 1 for t, c in enumerate(chosen)}
    np.testing.assert_array_equal(tree.parents[1:], [tree_of.get(cands[c][2], 0) for c in chosen])
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i  # parent selected and precedes
        assert tree.depths[i] == tree.depths[p] + 1
    np.testing.assert_array_equal(tree.mask, brute_mask(tree.parents))
    for i in range(n):
        kids = tree.children_of(i)
        np.testing.assert_array_equal(kids, np.flatnonzero(tree.parents == i))
        assert len(set(tree.tokens[kids].tolist())) == len(kids)  # siblings have distinct tokens

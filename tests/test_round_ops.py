"""The operators appended to the TensorRT engines' sources (engines/round_ops.py), run with ONNX Runtime against the
host's own selection (``TreeGrower.select``) and acceptance (``accept_greedy``) on random trees: the same verify
tree, the same accepted path and bonus."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from eagle_export import contract as C
from eagle_export.engines.round_ops import append_acceptance, append_selection, candidate_levels
from eagle_export.runtime.accept import accept_greedy
from eagle_export.runtime.tree import TreeGrower, VerifyTree
from eagle_export.tools.testing.trt_emulator import ties_the_other_way
from eagle_export.tree_params import TreeParams


def _session(inputs: list[tuple[str, int, list]], append) -> ort.InferenceSession:
    """A graph whose only nodes are the appended ones, over inputs named as the engine's tensors they read."""
    g = helper.make_graph([], "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs], [])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    append(model)
    onnx.checker.check_model(model)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _candidates(rng, k: int, depth: int, ties: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A round's candidates as the tree graph returns them (TreeGrower's generation order): cumulative log-probs,
    distinct sibling tokens, parents (-1: the root's children). ties: some children at log-prob 0 (their parent's
    score), the case where only the order of equal scores keeps a selection connected."""
    grower = TreeGrower(TreeParams(k, depth, 1))
    logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=(1,)))[:, :k], axis=1)[:, ::-1]
    ids = rng.choice(np.arange(3, 90), size=(1, k), replace=False)
    grower.add_root_children(logp[0].astype(np.float32), ids[0])
    for _ in range(depth):
        logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=(k,)))[:, :k], axis=1)[:, ::-1].astype(np.float32)
        if ties:
            logp[rng.random(k) < 0.5, 0] = 0.0
        ids = np.stack([rng.choice(np.arange(3, 90), size=k, replace=False) for _ in range(k)])
        grower.add_children(logp, ids)
    return grower.scores, grower.candidate_tokens, grower.candidate_parents


@pytest.mark.parametrize("k, depth, total", [(1, 3, 3), (2, 3, 6), (4, 3, 12), (2, 2, 6), (3, 1, 5)])
def test_selection_is_the_growers(k, depth, total):
    """The selected set, its tokens and depths, and each node's ancestors equal ``TreeGrower.select``'s tree (its
    nodes in generation order, ours by score: compared through the candidate each node is)."""
    _check_selection(k, depth, total, lambda m: append_selection(m, k, depth, total), all_tied=False)


@pytest.mark.parametrize("k, depth, total", [(1, 3, 3), (2, 3, 6), (4, 3, 12), (3, 1, 5)])
def test_selection_does_not_rest_on_a_topks_order_of_equal_scores(k, depth, total):
    """With a TopK that puts the higher index first among equal values (the emulator's, ``ties_the_other_way``: TensorRT
    documents no order for them), the selection is still the grower's: a child
    at log-prob 0 ties its parent, and a TopK over the scores themselves then took the child without its parent at
    the cut (planted: the TopK over the scores again fails here)."""
    _check_selection(k, depth, total, lambda m: ties_the_other_way(append_selection(m, k, depth, total)),
                     all_tied=True)


def _check_selection(k: int, depth: int, total: int, append, all_tied: bool) -> None:
    """Random candidates (every other trial with ties, or all with ``all_tied``) through the appended selection."""
    n = k + depth * k * k
    s = _session([(C.TREE_SCORES, TensorProto.FLOAT, ["B", n]), (C.TREE_TOKENS, TensorProto.INT64, ["B", n]),
                  (C.TREE_PARENTS, TensorProto.INT64, ["B", n])], append)
    rng = np.random.default_rng(k * 100 + depth * 10 + total)
    for trial in range(30):
        batch = [_candidates(rng, k, depth, ties=all_tied or trial % 2 == 1) for _ in range(2)]
        feeds = {C.TREE_SCORES: np.stack([b[0] for b in batch]).astype(np.float32),
                 C.TREE_TOKENS: np.stack([b[1] for b in batch]), C.TREE_PARENTS: np.stack([b[2] for b in batch])}
        tokens, depths, mask = s.run([C.SELECT_TOKENS, C.SELECT_DEPTHS, C.SELECT_MASK], feeds)
        for row, (scores, toks, parents) in enumerate(batch):
            grower = TreeGrower(TreeParams(k, depth, total))
            grower.load(scores, toks, parents)
            want = grower.select(total, root_token=0)
            # the host's node i (1..total) is candidate chosen[i-1]; ours are by score: match them by candidate
            order = np.argsort(-scores, kind="stable")[:total]
            chosen = sorted(order.tolist())
            ours = {c: i for i, c in enumerate(order.tolist())}
            assert sorted(ours) == chosen
            for i, c in enumerate(chosen, start=1):
                j = ours[c]
                assert tokens[row, j] == want.tokens[i] and depths[row, j] == want.depths[i]
                anc_host = {chosen[a - 1] for a in np.flatnonzero(want.mask[i]) if a > 0}
                anc_ours = {order[b] for b in np.flatnonzero(mask[row, j])}
                assert anc_ours == anc_host, (trial, c)
    assert candidate_levels(k, depth) == TreeGrower(TreeParams(k, depth, total))._levels


def _verify_call(trees: list[VerifyTree], logits_rows: list[np.ndarray], L: list[int], tt: int, stride: int | None):
    """The inputs of one verify call over these trees as the generator makes them (padding rows see only themselves;
    with ``stride`` each sequence's past sits at the common stride, ``_verify``'s batched layout)."""
    a = len(trees)
    past = L[0] if stride is None else stride
    ids = np.zeros((a, tt), np.int64)
    pos = np.zeros((a, tt), np.int64)
    mask = np.zeros((a, tt, past + tt), bool)
    logits = np.full((a, tt, 64), -5.0, np.float32)
    for b, vt in enumerate(trees):
        T = vt.num_nodes
        ids[b, :T], pos[b, :T] = vt.tokens, vt.depths + L[b]
        mask[b, :T, :L[b]] = True
        mask[b, :T, past:past + T] = vt.mask
        for i in range(T, tt):
            pos[b, i] = L[b]
            mask[b, i, past + i] = True
        logits[b, :T] = logits_rows[b]
    return {C.LOGITS: logits, C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask,
            C.LOGIT_INDICES: np.tile(np.arange(tt), (a, 1))}


def _acceptance_session(append=append_acceptance) -> ort.InferenceSession:
    return _session([(C.LOGITS, TensorProto.FLOAT, ["B", "R", 64]), (C.INPUT_IDS, TensorProto.INT64, ["B", "N"]),
                     (C.POSITION_IDS, TensorProto.INT64, ["B", "N"]),
                     (C.ATTENTION_MASK, TensorProto.BOOL, ["B", "N", "S"]),
                     (C.LOGIT_INDICES, TensorProto.INT64, ["B", "R"])], append)


def _random_tree(rng, nodes: int) -> VerifyTree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
    tokens = np.zeros(nodes, np.int64)
    for i in range(1, nodes):  # siblings carry distinct tokens
        taken = {int(tokens[c]) for c in range(1, i) if parents[c] == parents[i]}
        tokens[i] = rng.choice([t for t in range(3, 64) if t not in taken])
    return VerifyTree.from_parents(tokens, np.array(parents, np.int64))


def _logits_for(rng, vt: VerifyTree) -> np.ndarray:
    """Random logits whose argmax follows a random walk down the tree for a while, then leaves it."""
    logits = rng.standard_normal((vt.num_nodes, 64)).astype(np.float32)
    node = 0
    while True:
        kids = vt.children_of(node)
        if not len(kids) or rng.random() < 0.2:
            break
        child = int(rng.choice(kids))
        logits[node, vt.tokens[child]] = 10.0
        node = child
    return logits


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("argmax", ["onnx", "ties-last"])
def test_acceptance_is_accept_greedy(batched, argmax):
    """Random trees (chains and bushes, with padding rows; batched: two sequences at a common stride, the second's
    tree narrower): the accepted count, the path's rows and the tokens read from ``next_ids`` (each accepted token
    is its parent row's argmax, the bonus the last row's) equal ``accept_greedy``'s. ties-last: the same with the
    appended ArgMax and TopK putting the last of equal values first, as the emulator runs them (planted: with the
    deepest row's score alone, a round that accepts nothing took a padding row, each its own depth-0 root, for the
    root)."""
    s = _acceptance_session(append_acceptance if argmax == "onnx" else
                            lambda m: ties_the_other_way(append_acceptance(m)))
    rng = np.random.default_rng(7 + batched)
    accepted = 0
    for trial in range(60):
        a = 2 if batched else 1
        trees = [_random_tree(rng, int(rng.integers(1, 9))) for _ in range(a)]
        tt = max(vt.num_nodes for vt in trees) + int(rng.integers(0, 3))
        L = [int(x) for x in rng.integers(3, 20, size=a)]
        feeds = _verify_call(trees, [_logits_for(rng, vt) for vt in trees], L, tt, 24 if batched else None)
        nxt, count, rows = s.run([C.NEXT_IDS, C.ACCEPT_COUNT, C.ACCEPT_ROWS], feeds)
        for b, vt in enumerate(trees):
            want = accept_greedy(vt, feeds[C.LOGITS][b, :vt.num_nodes].argmax(-1))
            n = int(count[b])
            path = rows[b, :n + 1]
            assert n == want.num_accepted and path.tolist() == want.indices.tolist(), trial
            assert [int(nxt[b, r]) for r in path[:-1]] == want.tokens.tolist() and nxt[b, path[-1]] == want.bonus
            accepted += n
    assert accepted > 20  # the walks accepted something


def test_a_call_that_is_not_a_tree_accepts_nothing():
    """A prefill chunk (its last row's logits only) and a plain step: nothing accepted, the row's argmax next."""
    s = _acceptance_session()
    rng = np.random.default_rng(3)
    n = 5
    mask = np.tril(np.ones((n, n), bool))[None]
    logits = rng.standard_normal((1, 1, 64)).astype(np.float32)
    nxt, count, rows = s.run(None, {C.LOGITS: logits, C.INPUT_IDS: rng.integers(3, 64, (1, n)),
                                    C.POSITION_IDS: np.arange(n)[None], C.ATTENTION_MASK: mask,
                                    C.LOGIT_INDICES: np.array([[n - 1]])})
    assert count.tolist() == [0] and rows.tolist() == [[0]] and nxt[0, 0] == logits[0, 0].argmax()

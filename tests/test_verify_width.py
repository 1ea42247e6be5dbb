"""Verify width from the draft's confidence (TreeParams.threshold, runtime/tree.py ``TreeGrower.select``): only draft
nodes whose path probability reaches the threshold are verified, the best total_tokens of them, still a connected
tree; the setting is validated, kept in manifests only when set, and decoding with it stays lossless."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_export.errors import GenerationError
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.tree import TreeGrower
from eagle_export.tree_params import BatchTrees, TreeParams

ROOT = 99


@st.composite
def grown(draw):
    """A tree grown from random (sorted) draft log-probs, and a threshold."""
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 3))
    params = TreeParams(k, depth, draw(st.integers(1, k + depth * k * k)))
    g = TreeGrower(params)

    def rows(n):
        lp = -np.sort(np.array(draw(st.lists(st.floats(0, 4), min_size=n * k, max_size=n * k))).reshape(n, k),
                      axis=1)
        lp[:, 0] = np.where(draw(st.booleans()), 0.0, lp[:, 0])  # now and then a certain draft (log-prob 0)
        return lp, np.arange(n * k, dtype=np.int64).reshape(n, k) + 1
    g.add_root_children(*(a[0] for a in rows(1)))
    for _ in range(depth):
        g.add_children(*rows(k))
    return params, g, draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.6, 1.0]))


@settings(max_examples=200, deadline=None)
@given(grown())
def test_selection_is_the_best_eligible_nodes_and_connected(case):
    params, g, threshold = case
    vt = g.select(params.total_tokens, ROOT, threshold)
    scores, parents = g.scores.tolist(), g.candidate_parents.tolist()
    eligible = [c for c in range(len(scores)) if threshold == 0 or scores[c] >= math.log(threshold)]
    want = sorted(sorted(eligible, key=lambda c: (-scores[c], c))[:params.total_tokens])
    assert vt.num_nodes == len(want) + 1 and vt.tokens[0] == ROOT
    assert vt.tokens[1:].tolist() == [g.candidate_tokens[c] for c in want]
    index = {c: i for i, c in enumerate(want, 1)}
    assert vt.parents.tolist() == [-1] + [0 if parents[c] < 0 else index[parents[c]] for c in want]  # connected
    if threshold == 0:
        assert vt.tokens.tolist() == g.select(params.total_tokens, ROOT).tokens.tolist()


def test_an_unsure_draft_verifies_the_root_alone():
    g = TreeGrower(TreeParams(2, 1, 6))
    g.add_root_children(np.log([0.3, 0.2]), np.array([5, 6]))
    g.add_children(np.log([[0.5, 0.1], [0.9, 0.05]]), np.array([[7, 8], [9, 10]]))
    assert g.select(6, ROOT, 0.35).num_nodes == 1
    vt = g.select(6, ROOT, 0.14)  # 5 (0.3), 6 (0.2), 5->7 (0.15), 6->9 (0.18)
    assert vt.tokens.tolist() == [ROOT, 5, 6, 7, 9] and vt.parents.tolist() == [-1, 0, 0, 1, 2]
    assert g.select(3, ROOT, 0.14).tokens.tolist() == [ROOT, 5, 6, 9]  # the best 3 of the 4 eligible


def test_threshold_setting():
    t = TreeParams(2, 3, 8, threshold=0.05).validate()
    assert t.to_dict() == {"top_k": 2, "depth": 3, "total_tokens": 8, "threshold": 0.05}
    assert TreeParams(2, 3, 8).to_dict() == {"top_k": 2, "depth": 3, "total_tokens": 8}  # manifests stay as they were
    assert TreeParams.from_dict(t.to_dict()) == t and t.label.endswith("threshold 0.05")
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(GenerationError, match="threshold must be a probability"):
            TreeParams(2, 3, 8, threshold=bad).validate()
    with pytest.raises(GenerationError, match="optionally threshold"):
        TreeParams.from_dict({"top_k": 2, "depth": 3, "total_tokens": 8, "cutoff": 0.1})
    rows = [{"active": 1, "tree": t.to_dict()}, {"active": 2, "tree": None}]
    assert BatchTrees.from_list(rows).rows[0].tree == t
    with pytest.raises(GenerationError, match=re.escape("(and optionally threshold)")):
        BatchTrees.from_list([{"active": 1, "tree": {**t.to_dict(), "cutoff": 1}}])


def test_thresholded_decoding_is_lossless_and_narrower(models):
    """Greedy and sampled: the same tokens as plain decoding; the verify trees are narrower than total_tokens on
    average, by the threshold alone."""
    from eagle_export.runtime import SamplingParams

    _, _, art = models("mha")
    wide, cut = TreeParams(8, 2, 16), TreeParams(8, 2, 16, threshold=0.05)
    with EagleRuntime.open(art, threads=1, guard=False) as rt:
        vocab = rt.manifest.target.vocab_size
        rng = np.random.default_rng(2)
        for i in range(4):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 15))).tolist()
            sp = SamplingParams(1.0, seed=i) if i % 2 else None
            plain = rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False, use_draft=False, sampling=sp)
            full = rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False, tree=wide, sampling=sp)
            narrow = rt.generate(prompt_ids=prompt, max_new_tokens=24, stop_on_eos=False, tree=cut, sampling=sp)
            assert plain.tokens == full.tokens == narrow.tokens
            assert full.stats.drafted_tokens == 16 * full.stats.spec_rounds
            assert narrow.stats.drafted_tokens < 16 * narrow.stats.spec_rounds
            assert narrow.stats.verified_tokens == narrow.stats.drafted_tokens + narrow.stats.spec_rounds

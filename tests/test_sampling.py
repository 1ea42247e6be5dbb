"""Sampling, pure numpy: settings validation, process_logits against transformers' warpers,
sample_token, and recursive-rejection acceptance over deep trees on a synthetic target whose exact
output distribution is known (plus wrong acceptance rules that the same statistic must reject)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch
from stats import g_test
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle_export.errors import GenerationError
from eagle_export.runtime.accept import Accepted, accept_sampling
from eagle_export.runtime.sampling import LazyProbs, SamplingParams, process_logits, sample_token
from eagle_export.runtime.tree import VerifyTree

# ---- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.5), "temperature must be >= 0 (0 means greedy), got -0.5"),
    (dict(temperature=float("nan")), "temperature must be a number >= 0 (0 means greedy), got nan"),
    (dict(temperature=float("inf")), "temperature must be finite, got inf"),
    (dict(temperature="1"), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(top_p=0.0), "top_p must be a number in (0, 1] (1 disables it), got 0.0"),
    (dict(top_p=1.5), "top_p must be a number in (0, 1]"),
    (dict(top_p=-0.1), "top_p must be a number in (0, 1]"),
    (dict(top_p=float("nan")), "top_p must be a number in (0, 1] (1 disables it), got nan"),
    (dict(top_k=-1), "sampling top_k (--top-k-sampling) must be an integer >= 0 (0 disables it), got -1"),
    (dict(top_k=2.5), "sampling top_k (--top-k-sampling) must be an integer"),
    (dict(top_k=float("nan")), "sampling top_k (--top-k-sampling) must be an integer"),
    (dict(seed=-3), "seed must be a non-negative integer"),
    (dict(seed=1.5), "seed must be a non-negative integer"),
])
def test_bad_settings_are_clear_errors(kwargs, fragment):
    with pytest.raises(GenerationError) as e:
        SamplingParams(**kwargs).validate()
    assert fragment in str(e.value)


def test_good_settings_and_greedy():
    for p in (SamplingParams(), SamplingParams(0.0, 0.5, 3, 7), SamplingParams(2, 1, 0),
              SamplingParams(0.7, 0.9, 50, 0),
              SamplingParams(np.float32(0.5), np.float64(0.25), np.int64(4), np.int32(1))):
        assert p.validate() is p
    assert SamplingParams(0.0).is_greedy and SamplingParams(0).is_greedy
    assert not SamplingParams(1e-6).is_greedy
    assert SamplingParams(0.7, 0.9, 5, 3).to_dict() == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3}
    assert SamplingParams(0.7).with_seed(9) == SamplingParams(0.7, seed=9)
    with pytest.raises(ValueError, match="greedy"):
        process_logits(np.zeros(3), SamplingParams(0.0))


def test_rng_is_per_request_and_seeded():
    p = SamplingParams(seed=5)
    a, b = p.make_rng(), p.make_rng()
    assert a is not b and a.random() == b.random()
    assert SamplingParams(seed=6).make_rng().random() != SamplingParams(seed=5).make_rng().random()


# ---- processing: the rules of transformers' warpers ------------------------------------------------


def hf_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """transformers' warpers, in generate's order, on float64 scores."""
    s = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    s = TemperatureLogitsWarper(float(p.temperature))(None, s)
    if p.top_k:
        s = TopKLogitsWarper(int(p.top_k))(None, s)
    if p.top_p < 1:
        s = TopPLogitsWarper(float(p.top_p))(None, s)
    return torch.softmax(s, dim=-1).numpy()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_k", [0, 1, 3, 24, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_process_logits_equals_transformers_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 10) + 100 * top_k + int(1000 * top_p))
    logits = (rng.standard_normal((16, 24)) * 3).astype(np.float32)
    params = SamplingParams(temperature, top_p, top_k)
    got = process_logits(logits, params)
    want = hf_probs(logits, params)
    assert got.dtype == np.float64 and got.shape == logits.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens survive the filters
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(process_logits(logits[3], params), got[3], atol=0)  # 1-D works too


@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0])  # flat (nucleus > 256 tokens: more are sorted) to peaked
@pytest.mark.parametrize("top_p, top_k", [(0.5, 0), (0.9, 0), (0.99, 0), (0.95, 100)])
def test_process_logits_large_vocab_equals_transformers(scale, top_p, top_k):
    """Top-p sorts only the top tokens of a large vocabulary; the result must not change."""
    logits = (np.random.default_rng(7).standard_normal((3, 3000)) * scale).astype(np.float32)
    params = SamplingParams(0.8, top_p, top_k)
    got, want = process_logits(logits, params), hf_probs(logits, params)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("probs", [[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]])
def test_top_p_boundary_equals_transformers(probs):
    """Probabilities whose cumulative sums are exact in binary hit top-p's boundary: with top_p 0.75 the lowest
    token's cumulative 0.25 equals 1 - top_p, and transformers drops it (``cum <= 1 - top_p``). Random logits never
    land on the boundary, so a ``<`` there passes every other test."""
    logits = np.log(np.array([probs]))
    params = SamplingParams(1.0, top_p=0.75)
    got, want = process_logits(logits, params), hf_probs(logits, params)
    assert (got > 0).sum() == 2  # exactly one of the two 0.25 tokens is dropped, the one transformers drops
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


def test_process_logits_ties_and_inputs():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, -1.0]])
    # top-k 2 keeps both 3.0s; top-k 3 keeps everything >= the 3rd largest (2.0): both 2.0s as well.
    assert (process_logits(logits, SamplingParams(1.0, top_k=2)) > 0).tolist() == [[0, 1, 0, 1, 0, 0]]
    assert (process_logits(logits, SamplingParams(1.0, top_k=3)) > 0).tolist() == [[0, 1, 1, 1, 1, 0]]
    for k in (2, 3):
        np.testing.assert_allclose(process_logits(logits, SamplingParams(1.0, top_k=k)),
                                   hf_probs(logits, SamplingParams(1.0, top_k=k)), atol=1e-15)
    # top-p keeps at least the most likely token
    assert (process_logits(logits, SamplingParams(1.0, top_p=1e-9)) > 0).sum() >= 1
    # the caller's array is never modified (torch tensors work too)
    x = torch.tensor(logits[0], dtype=torch.float32)
    before = x.clone()
    process_logits(x, SamplingParams(0.5, 0.5, 2))
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match=r"\[rows, V\]"):
        process_logits(np.zeros((2, 3, 4)), SamplingParams())


def test_lazy_probs_processes_only_visited_rows():
    logits = np.random.default_rng(0).standard_normal((5, 8))
    seen = []
    lp = LazyProbs(lambda i: (seen.append(i), logits[i])[1], 5, SamplingParams(0.8, 0.9))
    assert len(lp) == 5 and seen == []
    np.testing.assert_allclose(lp[3], process_logits(logits[3], lp.params))
    lp[3]
    assert seen == [3]  # cached
    assert not lp[3].flags.writeable
    with pytest.raises(IndexError):
        lp[5]


# ---- sample_token ------------------------------------------------------------------------------


def test_sample_token_distribution_and_zeros():
    p = np.array([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    rng = np.random.default_rng(1)
    draws = np.array([sample_token(p, rng) for _ in range(20000)])
    counts = np.bincount(draws, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    assert g_test(counts, p).p > 1e-3
    # unnormalised weights are fine; a draw is one uniform
    assert sample_token(np.array([0.0, 2.0]), rng) == 1
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    sample_token(p, a)
    b.random()
    assert a.random() == b.random()
    for bad in (np.zeros(4), np.array([np.nan, 1.0])):
        with pytest.raises(ValueError, match="all-zero"):
            sample_token(bad, rng)


# ---- acceptance on a synthetic target: exact distributions over deep trees ------------------------

V = 6  # small vocabulary, so the exact joint of 3 tokens has 216 cells


class Synthetic:
    """A deterministic toy target p(next | prefix) and a toy draft (top-k of a noisy copy of p) that
    builds a full k-ary tree of the given depth, in the same order as the runtime's trees
    (parents before children, siblings by descending draft probability)."""

    def __init__(self, params: SamplingParams, top_k: int, depth: int, scale: float = 1.6, noise: float = 1.0):
        self.params, self.k, self.depth, self.scale, self.noise = params, top_k, depth, scale, noise
        self.probs = lru_cache(maxsize=None)(self._probs)
        self.tree = lru_cache(maxsize=None)(self._tree)

    def logits(self, prefix: tuple) -> np.ndarray:
        return self.scale * np.random.default_rng([11, *prefix]).standard_normal(V)

    def _probs(self, prefix: tuple) -> np.ndarray:
        return process_logits(self.logits(prefix), self.params)

    def _draft_children(self, prefix: tuple) -> list[int]:
        q = self.logits(prefix) + self.noise * np.random.default_rng([22, *prefix]).standard_normal(V)
        return np.argsort(-q, kind="stable")[: self.k].tolist()

    def _tree(self, prefix: tuple) -> tuple[VerifyTree, np.ndarray]:
        tokens, parents, paths = [prefix[-1]], [-1], [()]
        frontier = [0]
        for _ in range(self.depth + 1):
            nxt = []
            for node in frontier:
                for tok in self._draft_children(prefix + paths[node]):
                    tokens.append(tok)
                    parents.append(node)
                    paths.append(paths[node] + (tok,))
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        rows = np.stack([self.probs(prefix + path) for path in paths])
        rows.flags.writeable = False
        return VerifyTree.from_parents(np.array(tokens), np.array(parents)), rows

    def generate(self, prompt: tuple, n: int, rng, accept=accept_sampling) -> tuple[list[int], int]:
        """n tokens by repeated rounds (every token comes from an acceptance); returns tokens, drafts accepted."""
        out: list[int] = []
        prefix = prompt
        accepted = 0
        while len(out) < n:
            tree, rows = self.tree(prefix)
            acc = accept(tree, rows, rng)
            new = [int(t) for t in acc.tokens] + [acc.bonus]
            accepted += len(acc.tokens)
            out += new
            prefix += tuple(new)
        return out[:n], accepted

    def exact_joint(self, prompt: tuple, n: int) -> np.ndarray:
        joint = np.ones([V] * n)
        for idx in np.ndindex(*joint.shape):
            for i in range(n):
                joint[idx] *= self.probs(prompt + idx[:i])[idx[i]]
        return joint


def _path(tree: VerifyTree, node: int) -> np.ndarray:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return np.array(path[::-1], dtype=np.int64)


def always_accept(tree, probs, rng) -> Accepted:
    """WRONG: take the first child at every level (accept with probability 1)."""
    node = 0
    while len(kids := tree.children_of(node)):
        node = int(kids[0])
    path = _path(tree, node)
    return Accepted(path, tree.tokens[path[1:]].copy(), sample_token(np.asarray(probs[node]), rng))


def no_renormalise(tree, probs, rng) -> Accepted:
    """WRONG: accept each sibling with its original p(x), not p renormalised after the rejections."""
    node = 0
    while True:
        p0 = np.asarray(probs[node], dtype=np.float64)
        p = p0.copy()
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            if rng.random() < p0[x]:
                node = int(child)
                break
            p[x] = 0.0
        else:
            break
    path = _path(tree, node)
    return Accepted(path, tree.tokens[path[1:]].copy(), sample_token(p if p.sum() > 0 else p0, rng))


def bonus_not_residual(tree, probs, rng) -> Accepted:
    """WRONG: after rejecting every child, draw the bonus from the full p instead of the residual."""
    node = 0
    while True:
        p = np.asarray(probs[node], dtype=np.float64).copy()
        full = p.copy()
        for child in tree.children_of(node):
            x = int(tree.tokens[child])
            if rng.random() < p[x] / p.sum():
                node = int(child)
                break
            p[x] = 0.0
        else:
            break
    path = _path(tree, node)
    bonus_from = full if len(tree.children_of(node)) else p
    return Accepted(path, tree.tokens[path[1:]].copy(), sample_token(bonus_from, rng))


def leaf_bonus_from_parent(tree, probs, rng) -> Accepted:
    """WRONG: the correct walk, but after a fully accepted path (a leaf) the bonus is drawn from the leaf's
    parent's row instead of the leaf's own."""
    acc = accept_sampling(tree, probs, rng)
    leaf = int(acc.indices[-1])
    if len(tree.children_of(leaf)) or leaf == 0:
        return acc
    return Accepted(acc.indices, acc.tokens, sample_token(np.asarray(probs[int(tree.parents[leaf])]), rng))


PROMPT = (3, 1)
N_SYNTH = 10000  # samples per case (the runtime test, test_sampling_lossless.py, takes 20,000)
N_WRONG = 3000  # the wrong rules are off by far more than this needs
SYNTH_CASES = [
    pytest.param(SamplingParams(1.0), 2, 2, 1.6, id="t1-k2-d2"),
    pytest.param(SamplingParams(0.7, 0.9), 3, 1, 1.0, id="t0.7-p0.9-k3-d1"),
    pytest.param(SamplingParams(1.3, 0.95, 4), 2, 3, 1.6, id="t1.3-p0.95-topk4-k2-d3"),
]


def sample_counts(lm: Synthetic, n_tokens: int, seed: int, accept=accept_sampling,
                  samples: int = N_SYNTH) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    counts = np.zeros([V] * n_tokens, dtype=np.int64)
    accepted = 0
    for _ in range(samples):
        toks, a = lm.generate(PROMPT, n_tokens, rng, accept)
        counts[tuple(toks)] += 1
        accepted += a
    return counts, accepted


@pytest.mark.parametrize("params, top_k, depth, scale", SYNTH_CASES)
def test_recursive_rejection_is_lossless_on_deep_trees(params, top_k, depth, scale):
    """The joint of the first depth+1 tokens (one per draft level: the drafts of a fully accepted path, or a
    shorter path and its bonus, then the next round) equals the exact product of the target's conditionals; the
    wrong rules fail the same test. The bonus after a fully accepted path is the (depth+2)-th token: see
    test_bonus_after_a_fully_accepted_path."""
    lm = Synthetic(params, top_k, depth, scale)
    n = depth + 1
    want = lm.exact_joint(PROMPT, n)
    counts, accepted = sample_counts(lm, n, seed=1)
    res = g_test(counts, want)
    print(f"\nsynthetic {params} top_k={top_k} depth={depth}: {res}, "
          f"{accepted / N_SYNTH:.2f} drafts accepted per sample")
    assert accepted > N_SYNTH  # deep acceptance is exercised: more than one draft token per sample
    assert res.p > 1e-3, res
    for wrong in (always_accept, no_renormalise, bonus_not_residual):
        bad = g_test(sample_counts(lm, n, seed=2, accept=wrong, samples=N_WRONG)[0], want)
        print(f"  wrong rule {wrong.__name__}: {bad}")
        assert bad.p < 1e-6, (wrong.__name__, bad)


def bonus_counts(lm: Synthetic, seed: int, samples: int, accept=accept_sampling) -> tuple[dict, int]:
    """First rounds at PROMPT: for every fully accepted path (a leaf), the counts of the bonus token drawn after it."""
    rng = np.random.default_rng(seed)
    tree, rows = lm.tree(PROMPT)
    counts: dict[tuple, np.ndarray] = {}
    for _ in range(samples):
        acc = accept(tree, rows, rng)
        if len(acc.tokens) == lm.depth + 1:
            counts.setdefault(tuple(int(t) for t in acc.tokens), np.zeros(V, dtype=np.int64))[acc.bonus] += 1
    return counts, sum(int(c.sum()) for c in counts.values())


def conditional_fit(lm: Synthetic, counts: dict) -> object:
    """G-test of the bonus counts against p(. | PROMPT + path), each path weighted by how often it was observed."""
    total = sum(int(c.sum()) for c in counts.values())
    obs = np.stack(list(counts.values()))
    want = np.stack([c.sum() / total * lm.probs(PROMPT + path) for path, c in counts.items()])
    return g_test(obs, want)


@pytest.mark.parametrize("params, top_k, depth, scale", SYNTH_CASES)
def test_bonus_after_a_fully_accepted_path(params, top_k, depth, scale):
    """After the whole path to a leaf is accepted, the bonus is drawn from the target at the leaf, p(. | prompt +
    path): observed over the first rounds that accept a full path, and a bonus drawn from the leaf's parent's row
    fails the same test."""
    lm = Synthetic(params, top_k, depth, scale)
    counts, full = bonus_counts(lm, seed=3, samples=N_SYNTH)
    res = conditional_fit(lm, counts)
    print(f"\nsynthetic {params} top_k={top_k} depth={depth}: {full} of {N_SYNTH} first rounds accepted a full "
          f"path ({len(counts)} distinct); their bonus: {res}")
    assert full >= 500, f"only {full} fully accepted paths: the bonus after a full path is barely observed"
    assert res.p > 1e-3, res
    bad_counts, _ = bonus_counts(lm, seed=4, samples=N_SYNTH, accept=leaf_bonus_from_parent)
    bad = conditional_fit(lm, bad_counts)
    print(f"  wrong rule leaf_bonus_from_parent: {bad}")
    assert bad.p < 1e-6, bad


def test_accept_sampling_walks_exactly_the_visited_rows():
    lm = Synthetic(SamplingParams(1.0), 3, 2)
    tree, rows = lm.tree(PROMPT)
    rng = np.random.default_rng(0)
    seen: list[int] = []

    def fetch(i: int) -> np.ndarray:
        seen.append(i)
        return np.log(rows[i])

    for _ in range(200):
        seen.clear()
        acc = accept_sampling(tree, LazyProbs(fetch, tree.num_nodes, SamplingParams(1.0)), rng)
        assert seen == acc.indices.tolist()  # only the walked path is processed, once per node
        assert acc.indices[0] == 0
        assert all(tree.parents[b] == a for a, b in zip(acc.indices[:-1], acc.indices[1:], strict=True))
        np.testing.assert_array_equal(acc.tokens, tree.tokens[acc.indices[1:]])
        kids = tree.children_of(int(acc.indices[-1]))
        assert acc.bonus not in tree.tokens[kids]  # the residual excludes every rejected child
    with pytest.raises(ValueError, match="rows"):
        accept_sampling(tree, rows[:-1], rng)


def test_exact_joint_is_a_distribution():
    lm = Synthetic(SamplingParams(1.0), 2, 1)
    assert math.isclose(lm.exact_joint(PROMPT, 2).sum(), 1.0, rel_tol=1e-12)


def test_non_finite_logits_are_a_clear_error():
    with pytest.raises(GenerationError, match="non-finite logits"):
        process_logits(np.array([0.0, np.nan, 1.0]), SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(GenerationError, match="overflows"):
        process_logits(np.array([0.0, 1e300, 1.0]), SamplingParams(temperature=1e-10, seed=0))

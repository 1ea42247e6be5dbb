"""The runtime against the PyTorch oracle (runtime/oracle.py), round by round: same tree (tokens and
parents), same accepted length, same committed tokens. Hypothesis draws the tree settings, the
prompt, the length and the tiny model (one of them with capacity 40); explicit examples make
generations on that model reach capacity mid-generation (asserted: finish_reason "capacity", exactly
capacity - prompt tokens). The oracle is itself lossless, and it catches runtime bugs that leave the
output tokens intact (a token-level comparison alone would not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from model_table import EAGLE3_MODELS
from reference import Comparison, GreedyReference

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime import generator as generator_mod
from eagle_export.runtime.accept import Accepted
from eagle_export.runtime.oracle import EagleOracle, EagleRound, compare_with_oracle
from eagle_export.runtime.tree import Frontier, TreeGrower
from eagle_export.tree_params import TreeParams

TIE_GAP = 1e-4
VOCAB = 48  # the fixtures' small vocabulary
# name -> models(...) arguments: fixtures other tests build too, so the session exports nothing new.
MODELS = {
    "mha": ("mha", {}),
    "gqa-nobias": ("gqa", {"fc_bias": False}),
    "tied-ownembed": ("tied", {"fc_bias": True, "own_embedding": "random"}),
    "mha-capacity40": ("mha", {"max_seq_len": 40}),
    # A 2-layer head (HASS norms; the factory key of test_formats' "eagle1-hass-2layers"): its second layer's K/V of
    # the context rows depend on how those rows attended in the first, so a context-pass mask that is not causal
    # shows here and nowhere with a 1-layer head (whose cached K/V come from the rows' inputs alone).
    "gqa-2layers": ("gqa", {"head": (("hass", True), ("num_layers", 2))}),
}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one torch thread is fastest, and does not fight ONNX Runtime for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pairs(models, one_thread) -> dict[str, tuple[EagleRuntime, EagleOracle, int]]:
    out = {}
    for name, (preset, kw) in MODELS.items():
        target, draft, art = models(preset, **kw)
        rt = EagleRuntime.open(art, threads=1)
        out[name] = (rt, EagleOracle.load(target, draft), rt.manifest.max_seq_len)
    return out


def traced(rt: EagleRuntime, prompt: list[int], n: int, tree: TreeParams):
    rounds: list[EagleRound] = []
    res = rt.generate(prompt_ids=prompt, max_new_tokens=n, tree=tree, stop_on_eos=False,
                      on_round=lambda vt, acc: rounds.append(EagleRound.from_runtime(vt, acc)))
    return res, rounds


@st.composite
def cases(draw):
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 3))
    # a verify-width threshold now and then (runtime/tree.py): the oracle applies the same rule
    tree = TreeParams(top_k=k, depth=depth, total_tokens=draw(st.integers(1, k + depth * k * k)),
                      threshold=draw(st.sampled_from([0.0, 0.0, 0.02, 0.1, 0.3])))
    model = draw(st.sampled_from(sorted(MODELS)))
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=38))
    return model, tree, prompt, draw(st.integers(1, 14))


# Capacity 40 reached mid-generation: 40 - prompt tokens < the length asked for (the random prompts of `cases` are
# 1-38 tokens, about 6 on average, so they almost never get there).
CAPACITY_EXAMPLES = [
    ("mha-capacity40", TreeParams(4, 3, 12), [(5 * i + 3) % VOCAB for i in range(30)], 14),
    ("mha-capacity40", TreeParams(8, 3, 24), [(7 * i + 1) % VOCAB for i in range(33)], 14),
    ("mha-capacity40", TreeParams(1, 3, 3), [(11 * i + 2) % VOCAB for i in range(35)], 9),
    ("mha-capacity40", TreeParams(2, 0, 2), [(3 * i + 4) % VOCAB for i in range(38)], 5),
    ("mha-capacity40", TreeParams(3, 2, 10), [(13 * i + 5) % VOCAB for i in range(39)], 3),  # room for 1 token
]


def _with_capacity_examples(test):
    for case in CAPACITY_EXAMPLES:
        test = example(case=case)(test)
    return test


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
@_with_capacity_examples
def test_runtime_equals_oracle_round_by_round(pairs, case):
    name, tree, prompt, n = case
    rt, oracle, capacity = pairs[name]
    res, rounds = traced(rt, prompt, n, tree)
    want = oracle.generate(prompt, n, tree, capacity=capacity)
    if len(prompt) + n > capacity:
        assert res.finish_reason == "capacity" and len(res.tokens) == capacity - len(prompt), res
    else:
        assert res.finish_reason == "length" and len(res.tokens) == n, res
    cmp = compare_with_oracle(res.tokens, rounds, want, TIE_GAP)
    assert cmp.status in ("match", "tie"), f"{name} {tree}: {cmp.detail}"
    if cmp.status == "match":
        assert res.tokens == want.tokens and res.finish_reason == want.finish_reason
        assert res.stats.accept_lengths == [r.accepted for r in want.rounds]


def test_rounds_with_acceptance(pairs):
    """Fixed settings where drafts do get accepted, so multi-token commits are compared too."""
    rng = np.random.default_rng(3)
    accepted = 0
    for name in ("mha", "gqa-nobias", "gqa-2layers"):
        rt, oracle, capacity = pairs[name]
        for tree in (TreeParams(8, 3, 24), TreeParams(1, 3, 3), TreeParams(3, 2, 10)):
            for _ in range(2):
                prompt = rng.integers(3, VOCAB, int(rng.integers(2, 20))).tolist()
                res, rounds = traced(rt, prompt, 16, tree)
                cmp = compare_with_oracle(res.tokens, rounds, oracle.generate(prompt, 16, tree, capacity), TIE_GAP)
                assert cmp.status == "match", cmp.detail
                accepted += sum(r.accepted for r in rounds)
    print(f"\n{accepted} draft tokens accepted")
    assert accepted >= 8, f"only {accepted} draft tokens accepted: the comparison barely exercised commits"


def test_thresholded_rounds_equal_the_oracle(pairs):
    """A verify-width threshold: the runtime's and the oracle's trees are cut by the same rule, so rounds still match
    node for node, and the verify width varies from round to round (down to the root alone)."""
    rng = np.random.default_rng(11)
    widths: set[int] = set()
    for name in ("mha", "gqa-2layers"):
        rt, oracle, capacity = pairs[name]
        for tree in (TreeParams(8, 3, 24, threshold=0.02), TreeParams(3, 2, 10, threshold=0.1)):
            for _ in range(2):
                prompt = rng.integers(3, VOCAB, int(rng.integers(2, 20))).tolist()
                res, rounds = traced(rt, prompt, 16, tree)
                cmp = compare_with_oracle(res.tokens, rounds, oracle.generate(prompt, 16, tree, capacity), TIE_GAP)
                assert cmp.status in ("match", "tie"), f"{name} {tree}: {cmp.detail}"
                widths |= {len(r.tree_tokens) for r in rounds}
    assert len(widths) >= 4 and min(widths) < 5, widths


@pytest.mark.parametrize("name", ["llama-d2t", "qwen3-d2t-ownembed"])
def test_eagle3_runtime_equals_oracle_round_by_round(models, one_thread, name):
    """EAGLE-3 heads (multi-layer features, fc only on target features, draft vocabulary mapped with d2t)."""
    preset, kw = EAGLE3_MODELS[name]
    target, draft, art = models(preset, **kw)
    rt = EagleRuntime.open(art, threads=1)
    oracle = EagleOracle.load(target, draft)
    assert oracle.variant == "eagle3" and oracle.feature_layers == rt.manifest.target.feature_layers
    capacity, vocab = rt.manifest.max_seq_len, rt.manifest.target.vocab_size
    rng = np.random.default_rng(7)
    rounds_seen = 0
    for tree in (TreeParams(4, 3, 12), TreeParams(1, 3, 3), TreeParams(3, 2, 10)):
        for _ in range(2):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 20))).tolist()
            res, rounds = traced(rt, prompt, 16, tree)
            want = oracle.generate(prompt, 16, tree, capacity)
            cmp = compare_with_oracle(res.tokens, rounds, want, TIE_GAP)
            assert cmp.status in ("match", "tie"), f"{name} {tree}: {cmp.detail}"
            if cmp.status == "match":
                assert res.tokens == want.tokens
            rounds_seen += cmp.rounds_compared
    assert rounds_seen >= 12


def test_oracle_is_lossless(models, pairs):
    """The oracle's EAGLE tokens are transformers' greedy tokens (it is a reference, so check it too)."""
    target, _, _ = models("gqa", fc_bias=False)
    _, oracle, _ = pairs["gqa-nobias"]
    ref = GreedyReference(target)
    cmp = Comparison()
    rng = np.random.default_rng(5)
    for tree in (TreeParams(4, 3, 12), TreeParams(2, 0, 2)):
        for _ in range(3):
            prompt = rng.integers(3, VOCAB, int(rng.integers(1, 20))).tolist()
            ref.compare(prompt, oracle.generate(prompt, 20, tree).tokens, ref.generate(prompt, 20), cmp, str(tree))
    assert not cmp.failures, cmp.failures


def _first_mismatch(pairs, name, tree, tries=12):
    """Generate with the (patched) runtime until the oracle comparison finds a mismatch; tokens stay lossless."""
    rt, oracle, capacity = pairs[name]
    rng = np.random.default_rng(11)
    for _ in range(tries):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 20))).tolist()
        res, rounds = traced(rt, prompt, 24, tree)
        want = oracle.generate(prompt, 24, tree, capacity)
        assert res.tokens == want.tokens  # the bug leaves greedy output intact...
        cmp = compare_with_oracle(res.tokens, rounds, want, TIE_GAP)
        if cmp.status == "mismatch":
            return cmp  # ...and the round-by-round comparison still sees it
    return None


def test_oracle_catches_a_runtime_that_never_accepts(pairs, monkeypatch):
    """A runtime that rejects every draft token (bonus only) is lossless, but it is not EAGLE."""

    def reject_all(tree, argmax):
        return Accepted(indices=np.zeros(1, dtype=np.int64), tokens=tree.tokens[:0].copy(), bonus=int(argmax[0]))

    monkeypatch.setattr(generator_mod, "accept_greedy", reject_all)
    cmp = _first_mismatch(pairs, "mha", TreeParams(4, 3, 12))
    assert cmp is not None and "'accepted': 0" in cmp.detail


def test_oracle_catches_draft_seeing_other_branches(pairs, models, monkeypatch):
    """A draft mask that lets tree nodes see every earlier frontier row (not just their ancestors): the host's
    frontier masks, which the step graph drafts with (the runtime opened without its draft tree graphs, which build
    their masks inside; test_draft_tree checks those against the head grown level by level)."""
    original = TreeGrower._make_frontier  # the per-level Frontier views, made once per grower

    def leaky(self, level):
        f = original(self, level)
        return Frontier(tokens=f.tokens, parent_rows=f.parent_rows, tree_mask=np.ones_like(f.tree_mask),
                        level=f.level)

    monkeypatch.setattr(TreeGrower, "_make_frontier", leaky)
    # A fresh runtime: the shared one keeps its tree growers across generations, and one made for this tree by an
    # earlier test (hypothesis may draw it) holds frontiers from before the patch.
    preset, kw = MODELS["mha"]
    _, _, art = models(preset, **kw)
    _, oracle, capacity = pairs["mha"]
    fresh = {"mha": (EagleRuntime.open(art, threads=1, draft_tree=False), oracle, capacity)}
    assert _first_mismatch(fresh, "mha", TreeParams(3, 3, 12)) is not None

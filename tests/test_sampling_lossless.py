"""EAGLE sampling on ONNX Runtime draws from the target's exact distribution.

A tiny random target with a 24-token vocabulary (weights scaled so its next-token distributions
are neither flat nor one-hot) and a random EAGLE head. The exact joint distribution of the first
two generated tokens, P(t1, t2 | prompt), comes from transformers: forward passes of the original
checkpoint plus transformers' own warpers (temperature, top-p). 20,000 EAGLE generations per
setting (fixed seeds, so the test is deterministic) must pass a G-test against it (p > 1e-3), and
so must the `--no-draft` sampling path, and the two modes must agree with each other. The same
statistic must reject deliberately wrong acceptance rules.

t1 is drawn from the prefill's logits; t2 is the first acceptance of the tree's root: the token drawn from the
root's row, one of its top_k draft children (accepted) or another token (the bonus).
The tree has depth 0, so when t2 is an accepted draft the path is fully accepted and t3 is the bonus
after it: those t3 must follow transformers' P(t3 | prompt, t1, t2) (and a bonus drawn from the root's
row instead of the leaf's fails). Deeper levels of acceptance are checked exactly on a synthetic target
in test_sampling.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from stats import g_test, g_test_two_sample
from test_sampling import leaf_bonus_from_parent, no_renormalise
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from eagle_export.errors import GenerationError
from eagle_export.runtime import EagleRuntime, SamplingParams
from eagle_export.runtime import generator as generator_module
from eagle_export.runtime.accept import Accepted
from eagle_export.runtime.sampling import sample_token
from eagle_export.tree_params import TreeParams

V = 24
PROMPT = [3, 9]
TREE = TreeParams(top_k=8, depth=0, total_tokens=8)  # only the root's children matter for t2
N_EAGLE = 20000
N_NODRAFT = 5000
N_WRONG = 2000
P_MIN = 1e-3
SETTINGS = [
    pytest.param(SamplingParams(1.0), id="t1.0"),
    pytest.param(SamplingParams(0.7, top_p=0.9), id="t0.7-p0.9"),
]
# A 1-layer target keeps the 20,000 generations per setting fast; initializer_range 0.3 gives
# next-token entropies of about 2 nats (of ln 24 = 3.2) at this prompt.
MODEL = dict(vocab=V, max_seq_len=16, initializer_range=0.3, num_hidden_layers=1, hidden_size=32,
             intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model(models):
    return models("mha", **MODEL)


@pytest.fixture(scope="module")
def rt(model):
    return EagleRuntime.open(model[2], threads=1, guard=False)  # every round drafts (a random head)


@pytest.fixture(scope="module")
def hf_model(model):
    return AutoModelForCausalLM.from_pretrained(model[0], dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ref_logits(hf_model):
    """Target logits (float32, from the original checkpoint) for the prompt and for every prompt + [t1]."""
    m = hf_model
    with torch.no_grad():
        first = m(torch.tensor([PROMPT])).logits[0, -1]
        second = m(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1]
    return torch.cat([first[None], second]).double()  # [1 + V, V]


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in generate's order."""
    s = TemperatureLogitsWarper(float(p.temperature))(None, logits)
    if p.top_p < 1:
        s = TopPLogitsWarper(float(p.top_p))(None, s)
    return torch.softmax(s, dim=-1)


def exact_joint(ref_logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    probs = warp(ref_logits, p).numpy()
    return probs[0][:, None] * probs[1:]  # P(t1) * P(t2 | t1)


def entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)


def sample_pairs(rt: EagleRuntime, n: int, p: SamplingParams, seed0: int, use_draft: bool,
                 bonus: dict | None = None) -> tuple[np.ndarray, int]:
    """Counts of (t1, t2) over n seeded generations, and how many t2 were accepted drafts. With ``bonus`` (a dict),
    3 tokens are generated (t1 and t2 draw the same random numbers as with 2) and, where t2 was an accepted draft,
    bonus[(t1, t2)] counts t3: the bonus drawn after the fully accepted depth-0 path."""
    counts = np.zeros((V, V), dtype=np.int64)
    accepted = 0
    for i in range(n):
        res = rt.generate(prompt_ids=PROMPT, max_new_tokens=2 if bonus is None else 3, tree=TREE, use_draft=use_draft,
                          stop_on_eos=False, sampling=p.with_seed(seed0 + i))
        counts[res.tokens[0], res.tokens[1]] += 1
        first = res.stats.accept_lengths[0] if res.stats.accept_lengths else 0
        accepted += first
        if bonus is not None and first:
            bonus.setdefault((res.tokens[0], res.tokens[1]), np.zeros(V, dtype=np.int64))[res.tokens[2]] += 1
    return counts, accepted


def bonus_fit(hf_model, bonus: dict, p: SamplingParams):
    """G-test of the t3 counts against transformers' P(t3 | prompt, t1, t2), each (t1, t2) weighted as observed."""
    keys = list(bonus)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + list(k) for k in keys])).logits[:, -1].double()
    cond = warp(logits, p).numpy()
    obs = np.stack([bonus[k] for k in keys])
    return g_test(obs, obs.sum(1, keepdims=True) / obs.sum() * cond)


def test_reference_is_neither_flat_nor_one_hot(ref_logits):
    probs = warp(ref_logits, SamplingParams(1.0)).numpy()
    h1, h2 = float(entropy(probs[0])), float(np.sum(probs[0] * entropy(probs[1:])))
    print(f"\nentropy of t1 {h1:.2f}, of t2 given t1 {h2:.2f} nats (flat: {np.log(V):.2f})")
    assert 1.0 < h1 < 2.8 and 1.0 < h2 < 2.8
    # top-p 0.9 decisions are far from the 1 - top_p threshold, so float32 rounding differences
    # between ONNX Runtime and PyTorch logits cannot change which tokens survive.
    probs = warp(ref_logits, SamplingParams(0.7)).numpy()
    cum = np.cumsum(np.sort(probs, axis=-1), axis=-1)
    assert np.min(np.abs(cum - 0.1)) > 1e-4


@pytest.mark.parametrize("params", SETTINGS)
def test_eagle_sampling_has_the_target_distribution(rt, ref_logits, hf_model, params):
    want = exact_joint(ref_logits, params)
    t0 = time.perf_counter()
    bonus: dict = {}
    eagle, accepted = sample_pairs(rt, N_EAGLE, params, seed0=0, use_draft=True, bonus=bonus)
    t1 = time.perf_counter()
    plain, _ = sample_pairs(rt, N_NODRAFT, params, seed0=10**6, use_draft=False)
    t2 = time.perf_counter()
    fit_eagle, fit_plain, same = g_test(eagle, want), g_test(plain, want), g_test_two_sample(eagle, plain)
    fit_bonus = bonus_fit(hf_model, bonus, params)
    print(f"\n{params}: {N_EAGLE} EAGLE samples in {t1 - t0:.1f} s, t2 an accepted draft in {accepted} "
          f"({accepted / N_EAGLE:.0%}); {N_NODRAFT} no-draft samples in {t2 - t1:.1f} s"
          f"\n  EAGLE vs exact:    {fit_eagle}\n  no-draft vs exact: {fit_plain}\n  EAGLE vs no-draft: {same}"
          f"\n  t3 after an accepted t2 (the bonus after a full path) vs exact: {fit_bonus}")
    assert accepted > N_EAGLE // 10  # acceptance (not only the residual) is exercised
    assert fit_eagle.p > P_MIN, fit_eagle
    assert fit_plain.p > P_MIN, fit_plain
    assert same.p > P_MIN, same
    assert fit_bonus.n == accepted and fit_bonus.p > P_MIN, fit_bonus


def always_accept(tree, probs, rng) -> Accepted:
    """WRONG: accept the first child at every level (probability 1), bonus from the last node."""
    path = [0]
    while len(kids := tree.children_of(path[-1])):
        path.append(int(kids[0]))
    idx = np.asarray(path, dtype=np.int64)
    return Accepted(idx, tree.tokens[idx[1:]].copy(), sample_token(np.asarray(probs[path[-1]]), rng))


@pytest.mark.parametrize("wrong", [always_accept, no_renormalise])
def test_the_statistic_rejects_a_wrong_acceptance_rule(rt, ref_logits, monkeypatch, wrong):
    params = SamplingParams(1.0)
    monkeypatch.setattr(generator_module, "accept_sampling", wrong)
    counts, _ = sample_pairs(rt, N_WRONG, params, seed0=0, use_draft=True)
    res = g_test(counts, exact_joint(ref_logits, params))
    print(f"\nwrong rule {wrong.__name__}, {N_WRONG} samples: {res}")
    assert res.p < 1e-6, res


def test_the_statistic_rejects_a_bonus_from_the_parents_row(rt, hf_model, monkeypatch):
    """WRONG: after the fully accepted depth-0 path, t3 drawn from the root's row instead of the leaf's."""
    params = SamplingParams(1.0)
    monkeypatch.setattr(generator_module, "accept_sampling", leaf_bonus_from_parent)
    bonus: dict = {}
    sample_pairs(rt, N_WRONG, params, seed0=0, use_draft=True, bonus=bonus)
    res = bonus_fit(hf_model, bonus, params)
    print(f"\nwrong rule leaf_bonus_from_parent, {N_WRONG} samples: t3 after an accepted t2: {res}")
    assert res.p < 1e-6, res


# ---- reproducibility, greedy, bad settings ------------------------------------------------------

LONG = TreeParams(top_k=4, depth=3, total_tokens=12)
HOT = SamplingParams(0.8, 0.95, 10)


def run(rt, seed, use_draft=True, params=HOT):
    return rt.generate(prompt_ids=[5, 1, 7], max_new_tokens=12, tree=LONG, use_draft=use_draft, stop_on_eos=False,
                       sampling=params.with_seed(seed)).tokens


@pytest.mark.parametrize("use_draft", [True, False], ids=["eagle", "no-draft"])
def test_same_seed_same_tokens(rt, model, use_draft):
    a = [run(rt, s, use_draft) for s in range(6)]
    assert [run(rt, s, use_draft) for s in range(6)] == a  # same runtime, again
    fresh = EagleRuntime.open(model[2], threads=1)
    assert [run(fresh, s, use_draft) for s in range(6)] == a  # a new runtime (new buffers, sessions)
    assert len({tuple(x) for x in a}) > 1  # seeds matter


def test_concurrent_generations_keep_their_own_random_state(rt, model):
    """Two runtimes sampling in two threads at once give what each gives alone."""
    want = {s: run(rt, s) for s in range(8)}
    other = EagleRuntime.open(model[2], threads=1)
    got: dict[int, list[int]] = {}
    errors = []

    def worker(runtime, seeds):
        try:
            for s in seeds:
                got[s] = run(runtime, s)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r, range(i, 8, 2))) for i, r in enumerate((rt, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


@pytest.mark.parametrize("use_draft", [True, False], ids=["eagle", "no-draft"])
def test_temperature_zero_is_greedy(models, use_draft):
    rt = EagleRuntime.open(models("mha")[2], threads=1, guard=False)  # the same rounds every run
    for prompt in ([5, 1, 7], [30, 2, 2, 9, 11]):
        greedy = rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=use_draft, stop_on_eos=False)
        for params in (SamplingParams(0.0), SamplingParams(0.0, top_p=0.2, top_k=1, seed=3)):
            res = rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=use_draft, stop_on_eos=False,
                              sampling=params)
            assert res.tokens == greedy.tokens
            assert res.stats.accept_lengths == greedy.stats.accept_lengths


@pytest.mark.parametrize("sampling, fragment", [
    (SamplingParams(-1.0), "temperature must be >= 0"),
    (SamplingParams(float("nan")), "temperature must be a number"),
    (SamplingParams(1.0, top_p=0.0), "top_p must be a number in (0, 1]"),
    (SamplingParams(1.0, top_k=-2), "must be an integer >= 0"),
    (SamplingParams(0.0, top_p=2.0), "top_p must be a number in (0, 1]"),  # checked even when greedy
    ({"temperature": 1.0}, "sampling must be a SamplingParams"),
])
def test_bad_sampling_settings_raise(rt, sampling, fragment):
    with pytest.raises(GenerationError) as e:
        rt.generate(prompt_ids=PROMPT, max_new_tokens=2, sampling=sampling)
    assert fragment in str(e.value)

"""A guarded chain's length per round (runtime/chain_length.py): the pure choice between the base chain and its short
one, then the runtime drafting the chosen chain, lossless."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.chain_length import TRUSTED, ChainLength, chain, short_of
from eagle_export.runtime.guard import Guard, GuardPolicy
from eagle_export.tree_params import TreeParams

BASE, SHORT = chain(8), chain(3)  # the 6-layer pair's tuned 1/8/8 (drafted as 1/7/8) and its short chain


def costs(base: float | None, short: float | None):
    """``measured(t, n)`` with fixed figures (None: not measured)."""
    return lambda t, n: base if t == BASE else short


def test_short_of_is_a_chain_of_a_fraction_of_the_tokens():
    assert short_of(TreeParams(1, 8, 8), 0.4) == SHORT == TreeParams(1, 2, 3)
    assert short_of(chain(6), 0.4) == chain(2) == TreeParams(1, 1, 2)
    assert short_of(chain(6), 0.1) == chain(1) == TreeParams(1, 1, 1)  # never depth 0: the tree graph has none
    # a chain of fewer than MIN_BASE tokens keeps its length: the demo's tuned 1/3/4 with a 2-token alternative lost
    # 4.8% on the built-in prompts (its rounds are hardly dearer than the short chain's, and it drafts deep there)
    assert short_of(chain(5), 0.4) is None and short_of(chain(4), 0.4) is None
    assert short_of(TreeParams(2, 3, 8), 0.4) is None  # a branching tree keeps its shape
    assert short_of(TreeParams(1, 7, 8, 0.05), 0.4) is None  # a threshold already narrows it per round
    assert short_of(BASE, 0.0) is None


def test_what_each_chain_would_commit_comes_from_the_rounds():
    """The short chain's tokens are exact from the base's rounds; the base's, where the head drafts nothing or a
    whole loop (0 and 8 accepted in turn: 5 a round), come from the tokens past the short chain's end (planted: a
    geometric p over every token says 2.4)."""
    c = ChainLength(BASE, SHORT)
    for i in range(40):
        c.after(BASE, 8 if i % 2 else 0, costs(None, None))
    assert c.tokens(SHORT) == pytest.approx(1 + 1.5, abs=0.1)
    assert c.tokens(BASE) == pytest.approx(5.0, abs=0.2)
    every = ChainLength(BASE, SHORT)
    for _ in range(10):
        every.after(BASE, 8, costs(None, None))
    assert every.tokens(SHORT) == pytest.approx(4.0) and every.tokens(BASE) == pytest.approx(9.0, abs=0.05)


def test_a_hard_text_moves_to_the_short_chain_and_a_draftable_one_back():
    """Costs as measured on the 6-layer pair (8 tokens 2.6 ms, 3 tokens 1.65 ms): rounds that accept 1 make the short
    chain pay (2 tokens at 1.65 against 2 at 2.6); rounds that accept everything bring the base back, also from the
    short chain, whose rounds do not see past its end (its estimate decays towards the short levels' acceptance)."""
    c = ChainLength(BASE, SHORT)
    measured = costs(2.6e-3, 1.65e-3)
    assert c.after(BASE, 1, measured) == SHORT and c.switches == 1
    for _ in range(3):
        assert c.after(SHORT, 1, measured) == SHORT
    ran = SHORT
    for _ in range(30):
        ran = c.after(ran, ran.total_tokens, measured)
    assert ran == BASE and c.switches == 2
    for _ in range(5):
        assert c.after(BASE, 8, measured) == BASE  # deep rounds: no move


def test_where_the_short_chain_is_hardly_cheaper_the_base_stays():
    """The fixture's 16-layer target: 2 draft tokens 2.25 ms against 4 at 2.4 ms. Even rounds that accept nothing
    do not make the short chain 10% faster once both are measured (planted: a 5% margin moves it)."""
    base, short = chain(4), chain(2)
    c = ChainLength(base, short)
    for _ in range(20):
        assert c.after(base, 0, lambda t, n: 2.4e-3 if t == base else 2.25e-3) == base
    # an unmeasured short chain is tried on the model (half fixed, half by tokens: 0.75 of the base's here)
    tried = ChainLength(base, short)
    assert tried.after(base, 0, lambda t, n: 2.4e-3 if t == base else None) == short


def test_a_cost_the_request_no_longer_measures_needs_more_rounds():
    """The chain a request left is trusted from TRUSTED measured rounds on, the one it drafts from one: a figure of
    one slow first round on a session does not keep a request off a chain it no longer runs (and measures)."""
    c = ChainLength(BASE, SHORT)
    asked = []

    def measured(t, n):
        asked.append((t, n))
        return 2.6e-3 if t == BASE else None

    c.after(BASE, 1, measured)
    assert (BASE, 1) in asked and (SHORT, TRUSTED) in asked and TRUSTED > 1


def test_rejudge_takes_back_the_switch_to_plain_rounds():
    g = Guard(GuardPolicy(cost_ratio=5.0))
    for _ in range(3):
        mode = g.after("spec", 1, 5.0)
    assert mode == "plain" and g.switches == 1
    assert g.rejudge() == "spec" and g.switches == 0 and g.spec_seen == 0 and g.interval == 0


@pytest.fixture(scope="module")
def fixture_runtimes(trained):
    art = trained("eagle1")
    # A pinned cost: the base chain 3 plain steps a round, the short one modelled from it (0.5 + 0.5 x 2 / 6 of it)
    policy = GuardPolicy(cost_ratio=3.0)
    return (EagleRuntime.open(art, threads=1, guard=policy),
            EagleRuntime.open(art, threads=1, guard=GuardPolicy(cost_ratio=3.0, chain_short=0.0)))


def test_the_runtime_drafts_the_chosen_chain_and_stays_lossless(fixture_runtimes):
    """The trained fixture's EAGLE-1/2 head, chain 1/6/6 (drafted 1/5/6) and its short chain 1/1/2: on text the head
    drafts badly, rounds verify the short chain (2 draft tokens, not 6) and every token is the target's greedy one;
    with chain_short 0 none does (planted: a runtime that always drafts the base chain verifies 6 every round)."""
    rt, off = fixture_runtimes
    tree = TreeParams(1, 6, 6)
    rng = np.random.default_rng(5)
    prompts = [rt.encode("def fibonacci(n):"), rng.integers(3, 2000, 24).tolist(), rng.integers(3, 2000, 40).tolist()]
    shorts = 0
    for ids in prompts:
        plain = rt.generate(prompt_ids=ids, max_new_tokens=48, stop_on_eos=False, use_draft=False)
        got = rt.generate(prompt_ids=ids, max_new_tokens=48, stop_on_eos=False, tree=tree)
        ref = off.generate(prompt_ids=ids, max_new_tokens=48, stop_on_eos=False, tree=tree)
        assert got.tokens == plain.tokens == ref.tokens
        st = got.stats
        assert st.drafted_tokens == 2 * st.short_rounds + 6 * (st.spec_rounds - st.short_rounds)
        assert ref.stats.short_rounds == 0
        shorts += st.short_rounds
    assert shorts > 0


def test_batched_rounds_mix_both_chains_and_stay_lossless(tmp_path):
    """Two sequences a round, one on the short chain and one on the base in the same rounds (one tree graph call cut to
    the deeper chain: the short one reads its first levels): every request's tokens are its plain decoding's, and
    both chains ran (planted: a short slot loading the deeper call's candidates as its own fails the tokens or the
    grower's check)."""
    from eagle_export.export.exporter import ExportOptions, export_artifact
    from eagle_export.tools.commands.demo import FIXTURE, fixture_tree

    art = export_artifact(FIXTURE / "target", FIXTURE / "eagle1", tmp_path / "fx",
                          ExportOptions(max_seq_len=128, tree=fixture_tree("eagle1"), max_batch=2), progress=False)
    rt = EagleRuntime.open(art, threads=1, max_batch=2, guard=GuardPolicy(cost_ratio=3.0))
    alone = EagleRuntime.open(art, threads=1, guard=False)
    rng = np.random.default_rng(11)
    prompts = [rt.encode("def fibonacci(n):"), rng.integers(3, 2000, 30).tolist(),
               rt.encode("import numpy as np\n\ndef softmax(x):"), rng.integers(3, 2000, 17).tolist()]
    streams = [rt.submit(prompt_ids=p, max_new_tokens=40, stop_on_eos=False, tree=TreeParams(1, 6, 6)) for p in prompts]
    results = [s.wait(timeout=300) for s in streams]
    for p, r in zip(prompts, results, strict=True):
        assert r.tokens == alone.generate(prompt_ids=p, max_new_tokens=40, stop_on_eos=False, use_draft=False).tokens
        assert r.stats.drafted_tokens == 2 * r.stats.short_rounds + 6 * (r.stats.spec_rounds - r.stats.short_rounds)
    assert max(rt.scheduler.active_per_round) == 2
    assert sum(r.stats.short_rounds for r in results) > 0
    assert sum(r.stats.spec_rounds - r.stats.short_rounds for r in results) > 0

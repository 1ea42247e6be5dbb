"""The speculation guard (runtime/guard.py): its decisions as a pure function of the figures it is fed, then the
runtime following them on a head that stops matching mid-stream (tests/bigram.py with ``wrong`` tokens) and on random
heads, with a fixed cost ratio so that no clock decides anything: tokens stay plain decoding's (greedy and sampled,
same seed), the draft cache catches up over the plain rounds, and the stats count both kinds of round."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eagle_export.errors import GenerationError
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.runtime import EagleRuntime, GuardPolicy, SamplingParams
from eagle_export.runtime.guard import MIXED, PLAIN, SPEC, Guard, RoundCosts
from eagle_export.runtime.scheduler import RequestStream
from eagle_export.tree_params import TreeParams


def feed(guard: Guard, rounds: list[int], ratio: float | None) -> list[str]:
    """The mode of every round (the first is SPEC), each speculative round committing ``rounds[i]`` tokens."""
    modes = []
    for c in rounds:
        ran = guard.mode
        modes.append(ran)
        guard.after(ran, c if ran == SPEC else 1, ratio)
    return modes


def runs(modes: list[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for m in modes:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


def test_a_collapsed_draft_goes_plain_and_probes_at_doubling_intervals():
    # tau 1 at a cost of 2 plain steps: 0.5x. Judged after 3 rounds; the first interval is what keeps a 2-round probe
    # within 2% of the plain rounds between probes: ceil(2 * (2 - 1) / 0.02) = 100; then doubled after each failed
    # probe.
    g = Guard(GuardPolicy())
    modes = feed(g, [1] * 800, 2.0)
    assert runs(modes) == [(SPEC, 3), (PLAIN, 100), (SPEC, 2), (PLAIN, 200), (SPEC, 2), (PLAIN, 400), (SPEC, 2),
                           (PLAIN, 91)]
    assert g.switches == 1 and g.interval == 800
    g = Guard(GuardPolicy(max_interval=150))
    assert runs(feed(g, [1] * 400, 2.0))[:6] == [(SPEC, 3), (PLAIN, 100), (SPEC, 2), (PLAIN, 150), (SPEC, 2),
                                                 (PLAIN, 143)]


def test_the_first_interval_follows_the_probe_cost():
    # A dear round (4.8 plain steps) gets a longer interval; a cheap one the policy's first_interval.
    for ratio, budget, first in ((4.8, 0.03, math.ceil(2 * 3.8 / 0.03)), (1.25, 0.1, 8)):
        g = Guard(GuardPolicy(budget=budget))
        assert runs(feed(g, [1] * 300, ratio))[:2] == [(SPEC, 3), (PLAIN, first)]


def test_a_paying_draft_is_left_alone_and_one_that_recovers_comes_back():
    g = Guard(GuardPolicy())
    assert set(feed(g, [4] * 1000, 2.0)) == {SPEC}  # 2x plain decoding
    # Collapse at round 20, recovery at round 60: the probes at rounds 33 and 55 fail, the one at 97 finds it and
    # speculation resumes for good, judged afresh (no switch back).
    g = Guard(GuardPolicy(alpha=0.5, first_interval=10, budget=1.0, confidence=0.0))
    modes = feed(g, [4] * 20 + [1] * 40 + [4] * 100, 2.0)
    assert runs(modes) == [(SPEC, 23), (PLAIN, 10), (SPEC, 2), (PLAIN, 20), (SPEC, 2), (PLAIN, 40), (SPEC, 63)]
    assert g.switches == 1 and g.interval == 0


def test_hysteresis_between_leave_and_enter():
    # tau / ratio = 0.9: above leave (0.85), below enter (1): speculation that runs stays, a probe does not resume it.
    g = Guard(GuardPolicy())
    assert set(feed(g, [9] * 200, 10.0)) == {SPEC}
    g = Guard(GuardPolicy(first_interval=4, budget=1.0))
    modes = feed(g, [1] * 3 + [9] * 60, 10.0)
    assert runs(modes)[:4] == [(SPEC, 3), (PLAIN, 18), (SPEC, 2), (PLAIN, 36)]  # 2 * (10 - 1) / 1 = 18 plain rounds


def test_a_noisy_draft_needs_more_evidence_than_a_dead_one():
    # ratio 2.5: break-even tau 2.125 (x leave 0.85). Nine rounds committing 8, 1, 2, 1, 1, 2, 1, 1, 2 average 2.1,
    # but with that spread they are no proof (2 standard errors above it: about 3.6): the paying rounds that follow
    # keep speculation on. Without the confidence term the guard switches off after the ninth round. A draft
    # committing 1 every round is off after the third either way (no spread).
    rounds = [8, 1, 2, 1, 1, 2, 1, 1, 2, 1] + [8] * 20
    assert set(feed(Guard(GuardPolicy()), rounds, 2.5)) == {SPEC}
    assert runs(feed(Guard(GuardPolicy(confidence=0.0)), rounds, 2.5)) == [(SPEC, 9), (PLAIN, 21)]
    assert runs(feed(Guard(GuardPolicy()), [1] * 10, 2.5))[:2] == [(SPEC, 3), (PLAIN, 7)]


def test_the_margin_is_the_requests_own_spread_not_its_distance_from_the_prior():
    """A head that committed 3 a round for the requests before (the prior), a request whose rounds commit 1 every time
    at a ratio of 2.3, below the window's collapse threshold (1 / 2.3 > 0.85 / 2): it is off once the running tau,
    prior and all, is below the break-even (5 rounds), whatever the prior's variance; a request whose rounds alternate
    1 and 5 (mean 3) on the same prior stays on. Planted: the margin from the running variance, which counts the drop
    from the prior's 3 to 1 as noise, kept it on 11 rounds (13 with a prior variance of 4)."""
    for var in (0.0, 4.0):
        assert runs(feed(Guard(GuardPolicy(), prior=(3.0, var, 39)), [1] * 30, 2.3))[:2] == [(SPEC, 5), (PLAIN, 25)]
    assert set(feed(Guard(GuardPolicy(), prior=(3.0, 0.0, 39)), [1, 5] * 30, 2.3)) == {SPEC}


def test_a_collapse_after_a_good_stretch_is_caught_by_the_window():
    # Ten rounds of 8 keep the running tau high for many rounds after a collapse; the last 3 rounds' mean (1) below
    # half the break-even (0.85 x 3 / 2) switches off after the third collapsed round.
    assert runs(feed(Guard(GuardPolicy()), [8] * 10 + [1] * 14, 3.0)) == [(SPEC, 13), (PLAIN, 11)]
    assert runs(feed(Guard(GuardPolicy(window=4)), [8] * 10 + [1] * 14, 3.0)) == [(SPEC, 14), (PLAIN, 10)]
    assert set(feed(Guard(GuardPolicy(window=100)), [8] * 10 + [1] * 14, 3.0)) == {SPEC}  # the running tau alone


def test_shadow_reads_start_a_probe_when_the_draft_would_pay():
    g = Guard(GuardPolicy())
    feed(g, [1] * 3, 2.0)
    assert g.mode == PLAIN and g.plain_left == 100
    assert g.shadow(3, 31, 3, 2.0) == PLAIN  # 1 in 10 would commit 1.1 tokens a round: 0.55x
    assert g.shadow(28, 31, 3, 2.0) == SPEC  # 9 in 10: 1 + .9 + ... + .9^4 = 4.1 tokens a round, 2x: probe now
    assert g.probing == 2
    assert g.shadow(0, 31, 3, 2.0) == SPEC  # not in plain rounds: nothing to do
    assert feed(g, [4, 4], 2.0) == [SPEC, SPEC] and g.mode == SPEC and g.interval == 0  # the probe pays: back on


def test_the_runtimes_running_tau_starts_a_request():
    # A head whose rounds commit 4.6 on average (variance 6) on this runtime: a request whose first 3 rounds commit 1
    # each is not convicted by them (mean with the prior's 4 pseudo-rounds: 3.1 at a break-even of 1.7); without a
    # prior it is. A request on a head that never paid here (prior 1.0) starts with plain rounds.
    first = [1, 1, 1] + [5] * 20
    assert set(feed(Guard(GuardPolicy(), prior=(4.6, 6.0, 39)), first, 2.0)) == {SPEC}
    assert runs(feed(Guard(GuardPolicy()), first, 2.0))[:2] == [(SPEC, 3), (PLAIN, 20)]
    g = Guard(GuardPolicy(), prior=(1.0, 0.0, 39))
    assert g.start(2.0) == PLAIN and g.switches == 0  # a head that never paid here: plain from the first round
    assert Guard(GuardPolicy(), prior=(4.6, 6.0, 39)).start(2.0) == SPEC and Guard(GuardPolicy()).start(2.0) == SPEC
    c = RoundCosts()
    tree = TreeParams(1, 6, 7)
    assert c.prior(tree) is None
    for x in (8, 1, 8, 1):
        c.note_tau(tree, x)
    assert c.prior(tree) == (4.5, 12.25, 4)  # the plain mean and variance of the first rounds
    assert c.prior(TreeParams(2, 2, 4)) is None


def test_shadow_reads_come_early_after_a_switch_then_every_shadow_every():
    g = Guard(GuardPolicy())
    assert not g.shadow_due(100)  # speculating: no reads
    feed(g, [1] * 3, 2.0)
    assert [g.shadow_due(n) for n in (7, 8)] == [False, True]  # the first at 16 / 2 rows
    g.shadow(0, 7, 3, 2.0)
    assert [g.shadow_due(n) for n in (15, 16)] == [False, True]  # then 16 later ...
    g.shadow(0, 15, 3, 2.0)
    assert [g.shadow_due(n) for n in (31, 32)] == [False, True]  # ... and twice as far each time it reads badly
    assert not Guard(GuardPolicy(shadow_every=0)).shadow_due(10 ** 6)
    g.shadow(31, 31, 3, 2.0)  # reads well: probe
    feed(g, [1, 1], 2.0)  # ... which fails: back to plain rounds, the reads' spacing doubled for the failed probe
    assert g.mode == PLAIN and [g.shadow_due(n) for n in (7, 8)] == [False, False]
    assert [g.shadow_due(n) for n in (31, 32)] == [False, True]


def test_shadow_reads_keep_their_measured_cost_within_the_read_budget():
    """A read that costs a plain step (a draft call as dear as a target step, the tiny fixture's case) comes at most
    every 1 / read_budget plain rounds; a cheap one (a real size's) follows the schedule; the cost never pushes a
    read past max_interval."""
    g = Guard(GuardPolicy(read_budget=0.05))
    feed(g, [1] * 3, 2.0)
    assert g.mode == PLAIN and g.shadow_due(8) and g.shadow_due(8, None)
    assert [g.shadow_due(n, 1.0) for n in (19, 20)] == [False, True]  # 1.0 / 0.05 rounds apart
    assert [g.shadow_due(n, 0.2) for n in (7, 8)] == [False, True]  # 0.2 / 0.05 = 4: the schedule's 8 decides
    assert g.shadow_due(1024, 1e9) and not g.shadow_due(1023, 1e9)
    assert not Guard(GuardPolicy(shadow_every=0)).shadow_due(10 ** 6, 0.0)


def test_without_a_plain_figure_plain_rounds_measure_it():
    """Three plain rounds calibrate (the figure is their median: the first plain round after speculative ones is the
    slowest); calibration_rounds 1 gives one. Catches a calibration that ends after its first round."""
    for rounds, want in ((3, [SPEC] * 3 + [PLAIN] * 3 + [SPEC]), (1, [SPEC] * 3 + [PLAIN, SPEC])):
        g = Guard(GuardPolicy(calibration_rounds=rounds))
        modes = []
        for i in range(12):
            ran = g.mode
            modes.append(ran)
            g.after(ran, 1, None if i < 3 else 2.0)
        assert modes[:len(want)] == want  # then the next round is judged with the figure
        assert g.mode == PLAIN and g.switches == 1


def test_a_plain_figure_of_the_warm_up_is_measured_again():
    """A plain figure last recorded within a fresh runtime's first WARM rounds (its sessions' first calls are slow) is
    dropped once the runtime is past them, so the guard calibrates again; one recorded after is kept. Catches the
    warm-up figure kept (a runtime serving only drafting requests then read every speculative round 1.3-1.6x
    cheaper than it was)."""
    c = RoundCosts()
    for t in (2.0, 1.9, 1.8):  # the calibration of a fresh runtime's first request
        c.record(1, None, t * 1e-3, 10)
    for _ in range(RoundCosts.WARM):
        c.record(1, "tree", 3e-3, 20)
    assert c.stale(1, 20)  # past the warm-up: stale, and the figure is gone
    assert c.ratio(1, "tree") is None
    for t in (1.2, 1.0, 1.0):  # calibrated again
        c.record(1, None, t * 1e-3, 40)
    assert not c.stale(1, 40) and c.ratio(1, "tree") == pytest.approx(3.0)


def test_policy_checks():
    for bad, msg in ((dict(leave=-1), "leave"), (dict(enter=0.5), "enter"), (dict(min_rounds=0), "min_rounds"),
                     (dict(probe_rounds=1.5), "probe_rounds"), (dict(first_interval=9, max_interval=8), "max_interval"),
                     (dict(budget=0), "budget"), (dict(cost_ratio=0), "cost_ratio"), (dict(alpha=True), "alpha"),
                     (dict(confidence=-1), "confidence"), (dict(shadow_every=-1), "shadow_every"),
                     (dict(read_budget=0), "read_budget"), (dict(shadow_window=0), "shadow_window"),
                     (dict(calibration_rounds=0), "calibration_rounds")):
        with pytest.raises(GenerationError, match=msg):
            GuardPolicy(**bad).validate()


def test_round_costs():
    c = RoundCosts()
    tree = TreeParams(2, 2, 4)
    assert c.ratio(1, tree) is None and c.stale(1, 10)
    c.record(1, tree, 0.004, 10)
    assert c.ratio(1, tree) is None  # no plain round yet
    c.record(1, None, 0.002, 10)
    assert c.ratio(1, tree) == pytest.approx(2.0) and not c.stale(1, 80) and c.stale(1, 85)
    c.record(1, tree, 0.006, 12)  # the median of the rounds so far: (4 ms + 6 ms) / 2
    assert c.ratio(1, tree) == pytest.approx(0.005 / 0.002)
    assert c.ratio(1, TreeParams(1, 1, 1)) is None and c.ratio(2, tree) is None
    c.record(2, MIXED, 0.009, 10)
    c.record(2, None, 0.003, 10)
    assert c.ratio(2, tree) == pytest.approx(3.0)  # a batch of different trees stands in for any of them


def test_round_costs_of_shadow_reads():
    c = RoundCosts()
    assert c.read_ratio(1) is None
    c.record_read(1, 0.003, 10)
    assert c.read_ratio(1) is None  # no plain round yet
    c.record(1, None, 0.001, 10)
    assert c.read_ratio(1) == pytest.approx(3.0) and c.read_ratio(2) is None
    c.record_read(1, 0.005, 20)  # the median of the reads so far
    assert c.read_ratio(1) == pytest.approx(4.0)


def test_a_slow_round_does_not_move_the_ratio():
    """A round that lost a scheduler slice (12 ms against 3 ms rounds) leaves the ratio where the rounds around it put
    it: a running average would move it by a plain step and a half."""
    c = RoundCosts()
    tree = TreeParams(1, 6, 7)
    for _ in range(8):
        c.record(1, None, 0.001, 10)
        c.record(1, tree, 0.003, 10)
    c.record(1, tree, 0.012, 10)
    c.record(1, None, 0.009, 10)
    assert c.ratio(1, tree) == pytest.approx(3.0)
    for _ in range(RoundCosts.WINDOW):  # the rounds do get slower: the figure follows within a window
        c.record(1, tree, 0.006, 10)
    assert c.ratio(1, tree) == pytest.approx(6.0)


def test_a_slow_request_does_not_move_the_ratio():
    """A slow moment as long as one request's speculative rounds (12 rounds at 3x, as on a shared 2-vCPU machine)
    leaves the ratio where the rounds before it put it: over a window of 9 it read 9 plain steps, and every request
    after it started plain. Once the rounds stay slower for half a window, the figure follows."""
    c = RoundCosts()
    tree = TreeParams(2, 4, 12)
    for _ in range(RoundCosts.WINDOW):
        c.record(1, None, 0.001, 10)
        c.record(1, tree, 0.003, 10)
    for _ in range(12):
        c.record(1, tree, 0.009, 10)
    assert c.ratio(1, tree) == pytest.approx(3.0)
    assert c.spec_seconds(1, tree) == pytest.approx(0.003)
    for _ in range(RoundCosts.WINDOW // 2 - 12 + 1):
        c.record(1, tree, 0.009, 10)
    assert c.ratio(1, tree) == pytest.approx(9.0)


def test_a_stale_speculative_figure_does_not_keep_requests_plain():
    """A runtime whose first speculative rounds ran in a slow moment (9 plain steps a round) switches its request
    off, and its prior says speculation loses; once no speculative round has refreshed that figure for SPEC_STALE
    rounds, the ratio is unknown again: a new request starts speculating and a plain request's shadow read probes."""
    c = RoundCosts()
    tree = TreeParams(2, 4, 8)
    c.record(1, None, 0.001, 10)
    g = Guard(GuardPolicy())
    for x in (3, 1, 3):
        c.record(1, tree, 0.009, 10)
        c.note_tau(tree, x)
        g.after(SPEC, x, c.ratio(1, tree))
    assert g.mode == PLAIN and Guard(GuardPolicy(), prior=c.prior(tree)).start(c.ratio(1, tree)) == PLAIN
    for _ in range(RoundCosts.SPEC_STALE):
        c.record(1, None, 0.001, 10)
    assert c.ratio(1, tree) is not None  # not yet
    c.record(1, None, 0.001, 10)
    assert c.ratio(1, tree) is None
    assert Guard(GuardPolicy(), prior=c.prior(tree)).start(c.ratio(1, tree)) == SPEC
    g.shadow(5, 8, 4, c.ratio(1, tree))  # a read that would not pay at 9 plain steps a round probes
    assert g.mode == SPEC and g.probing
    c.record(1, tree, 0.003, 10)  # the probe measures the figure afresh
    assert c.ratio(1, tree) == pytest.approx(3.0)


def test_a_stale_figure_measured_again_alike_is_dropped_ever_more_rarely():
    """A head that loses for good (3 plain steps a round, every time): its figure is dropped after SPEC_STALE rounds,
    the probe that follows measures it again alike, and the next drop waits twice as long, up to SPEC_STALE_MAX (with
    a fixed horizon the probes cost 128-token requests 7% on a shallow target). A figure measured afresh far lower
    (the dropped one came from a slow moment) brings the horizon back to SPEC_STALE."""
    c = RoundCosts()
    tree = TreeParams(4, 3, 12)
    c.record(1, None, 0.001, 10)

    def spec(seconds: float) -> None:
        c.record(1, tree, seconds, 10)
        assert c.ratio(1, tree) is not None

    def dropped_after(seconds: float) -> int:
        """Plain rounds until the figure is dropped; then one speculative round of ``seconds`` measures it again."""
        n = 0
        while c.ratio(1, tree) is not None:
            c.record(1, None, 0.001, 10)
            n += 1
        spec(seconds)
        return n

    spec(0.003)
    horizons = [dropped_after(0.003) for _ in range(7)]
    assert horizons == [129, 257, 513, 1025, 2049, 2049, 2049]
    assert dropped_after(0.0009) == 2049  # measured again far lower (a round of 0.9 plain steps): back to the start
    assert dropped_after(0.003) == 129


# ---- the runtime ------------------------------------------------------------------------------------------------

CYCLE_LEN, WRONG = 300, (60, 140)  # the head drafts garbage after cycle[60:140], right before and after
N_NEW = 250
# judged quickly, probes often; no shadow reads (replay() feeds a pure Guard the rounds alone)
FAST = GuardPolicy(alpha=0.5, first_interval=4, budget=1.0, cost_ratio=2.0, shadow_every=0)


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    """(artifact, cycle): a bigram target following a 300-token cycle and a head right on it except after
    cycle[60:140] (nothing accepted there), whose cache rows depend on the features it is fed; exported with the
    default tree (4, 3, 12) and capacity 320."""
    from bigram import make_bigram_pair

    root = tmp_path_factory.mktemp("switching")
    cycle = (np.random.default_rng(7).permutation(np.arange(10, 10 + CYCLE_LEN))).tolist()
    target, draft = make_bigram_pair(root, cycle, wrong=cycle[WRONG[0]:WRONG[1]], feature_weight=0.05)
    art = export_artifact(target, draft, root / "artifact", ExportOptions(max_seq_len=320), progress=False)
    return art, cycle


def replay(policy: GuardPolicy, accept_lengths: list[int]) -> tuple[int, int]:
    """(speculative rounds, switches) of a pure Guard fed the runtime's rounds (a plain round accepts nothing)."""
    g, spec = Guard(policy), 0
    for a in accept_lengths:
        ran = g.mode
        if ran == PLAIN:
            assert a == 0
        spec += ran == SPEC
        g.after(ran, a + 1, policy.cost_ratio)
    return spec, g.switches


def test_guard_follows_a_draft_that_stops_and_resumes_matching(switching):
    art, cycle = switching
    with EagleRuntime.open(art, threads=1, guard=FAST) as rt:
        res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
        plain = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False, use_draft=False)
    assert res.tokens == plain.tokens == cycle[1:N_NEW + 1]
    st = res.stats
    assert st.spec_rounds + st.plain_rounds == st.rounds == len(st.accept_lengths)
    assert (st.spec_rounds, st.guard_switches) == replay(FAST, st.accept_lengths)
    assert st.guard_switches == 1 and st.plain_rounds >= 40  # off once through the wrong stretch ...
    assert st.accept_lengths[-6:-1] == [4] * 5  # ... and back on after it, every draft accepted again
    assert st.drafted_tokens == 12 * st.spec_rounds and st.verified_tokens == 13 * st.spec_rounds + st.plain_rounds
    assert st.acceptance_rate == pytest.approx(st.accepted_tokens / st.drafted_tokens)
    assert plain.stats.plain_rounds == plain.stats.rounds and plain.stats.drafted_tokens == 0
    with EagleRuntime.open(art, threads=1, guard=False) as rt:
        always = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
    assert always.tokens == plain.tokens and always.stats.plain_rounds == 0 and always.stats.guard_switches == 0
    assert always.stats.spec_rounds > st.spec_rounds


def test_shadow_reads_bring_speculation_back_before_any_probe(switching):
    """Probes so rare that none falls inside 250 tokens: without shadow reads the request stays plain after the wrong
    stretch; with a read every 16 plain rounds, the first read after it finds the draft right again and it drafts to
    the end, every draft accepted."""
    art, cycle = switching
    rare = dict(alpha=0.5, first_interval=1000, max_interval=1000, cost_ratio=2.0)
    tails = {}
    for every in (0, 16):
        with EagleRuntime.open(art, threads=1, guard=GuardPolicy(**rare, shadow_every=every)) as rt:
            res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
        assert res.tokens == cycle[1:N_NEW + 1] and res.stats.guard_switches == 1
        tails[every] = res.stats.spec_flags[-10:], res.stats.accept_lengths[-6:-1]
    assert tails[0] == ([False] * 10, [0] * 5)
    assert tails[16] == ([True] * 10, [4] * 5)


def test_a_shadow_read_judges_the_draft_on_its_last_tokens(switching):
    """A read that lags over the end of the wrong stretch (22-28 wrong tokens, then right ones) at a cost of 4 plain
    steps a round: over all its tokens the draft's depth-1 acceptance (about 0.7) says a round would not pay, over
    its last 16 (all right) that it would; only the windowed read brings the request back before it ends."""
    art, cycle = switching
    rare = dict(first_interval=1000, max_interval=1000, cost_ratio=4.0, shadow_every=96)
    tails = {}
    for window in (16, 10 ** 6):
        with EagleRuntime.open(art, threads=1, guard=GuardPolicy(**rare, shadow_window=window)) as rt:
            res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
        assert res.tokens == cycle[1:N_NEW + 1] and res.stats.guard_switches == 1
        tails[window] = res.stats.spec_flags[-5:]
    assert tails[16] == [True] * 5
    assert tails[10 ** 6] == [False] * 5


def test_a_traced_request_drafts_every_round(switching):
    art, cycle = switching
    seen = []
    with EagleRuntime.open(art, threads=1, guard=FAST) as rt:
        res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=120, stop_on_eos=False,
                          on_round=lambda vt, acc: seen.append(vt.num_nodes))
    assert res.stats.plain_rounds == 0 and len(seen) == res.stats.rounds


@pytest.mark.parametrize("tree", [None, TreeParams(2, 3, 6)], ids=["tree-graph", "step-graph"])
def test_draft_cache_catches_up_over_guarded_plain_rounds(switching, tree):
    """A head that always pays, judged at 10x the cost: every judgement turns it off, every probe fails, and each
    leaving round's accepted path (5 tokens) goes to the lag rows. The draft cache and context row end as a run that
    drafted every round leaves them. The default tree is grown by the draft tree graph as the lag catches up; (2, 3, 6)
    level by level with the step graph."""
    art, cycle = switching
    policy = GuardPolicy(min_rounds=1, probe_rounds=1, first_interval=2, budget=1.0, cost_ratio=10.0)

    def drive(guard, rounds):
        rt = EagleRuntime.open(art, threads=1, guard=guard)
        gen = rt.generator
        gen.join(gen.check([cycle[0]], 280, tree, True, False), RequestStream())
        s = gen.active[0]
        for _ in range(rounds):
            gen.round()
            if s.L >= 60 and not s.lag:  # before the wrong stretch, after a speculative round
                break
        out = (s.L, [c[0, :s.L].clone() for c in gen.dcache.rows(0, s.L)], gen.ctx_ids[0].copy(), s.stats)
        rt.close()
        return out

    L, rows, ctx, st = drive(policy, 200)
    assert st.guard_switches >= 1 and st.plain_rounds > st.spec_rounds
    L_ref, rows_ref, ctx_ref, _ = drive(False, 200)
    n = min(L, L_ref)
    for a, b in zip(rows, rows_ref, strict=True):
        torch.testing.assert_close(a[:n], b[:n], rtol=1e-4, atol=1e-5)
    if L == L_ref:
        assert (ctx == ctx_ref).all()


def test_guarded_sampling_is_plain_sampling_for_a_seed(models):
    """Sampled tokens do not depend on which rounds drafted: one uniform per committed token either way, so EAGLE
    with the guard switching often, EAGLE drafting every round and plain decoding give the same tokens for a seed."""
    _, _, art = models("mha")
    busy = GuardPolicy(min_rounds=1, probe_rounds=1, first_interval=2, budget=1.0, cost_ratio=1.5)
    rng = np.random.default_rng(11)
    with EagleRuntime.open(art, threads=1, guard=busy) as rt, EagleRuntime.open(art, threads=1, guard=False) as raw:
        vocab = rt.manifest.target.vocab_size
        switched = 0
        for i in range(6):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 12))).tolist()
            params = SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i)
            tree = TreeParams(8, 2, 16)  # wide, so that drafts are accepted now and then
            g = rt.generate(prompt_ids=prompt, max_new_tokens=40, stop_on_eos=False, sampling=params, tree=tree)
            a = raw.generate(prompt_ids=prompt, max_new_tokens=40, stop_on_eos=False, sampling=params, tree=tree)
            p = raw.generate(prompt_ids=prompt, max_new_tokens=40, stop_on_eos=False, sampling=params,
                             use_draft=False)
            assert g.tokens == a.tokens == p.tokens, i
            switched += g.stats.guard_switches
            assert a.stats.accepted_tokens > 0 or i  # speculation did accept something
        assert switched > 0


def test_measured_guard_calibrates_then_counts(switching):
    """With measured costs a fresh runtime has no plain figure: after 3 speculative rounds three plain rounds measure
    it. Which rounds follow depends on the clock; the tokens and the accounting do not."""
    art, cycle = switching
    with EagleRuntime.open(art, threads=1) as rt:
        res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
    st = res.stats
    assert res.tokens == cycle[1:N_NEW + 1]
    assert st.accept_lengths[:6] == [4, 4, 4, 0, 0, 0] and st.plain_rounds >= 3
    assert st.spec_rounds + st.plain_rounds == st.rounds
    assert st.draft_s > 0 and st.target_s > 0 and st.host_s > 0
    assert st.draft_s + st.target_s + st.host_s <= st.decode_s + 1e-3


def test_measured_reads_are_spaced_by_their_cost(switching):
    """A request the guard keeps plain after its calibration (leave and enter out of reach, no probe within the
    request): the runtime measures what its shadow reads cost, and with a read budget so small that one read is all it
    affords, the draft runs fewer passes than with the schedule alone (read_budget 1: a read every 1-3 plain rounds
    at most). Same tokens either way."""
    art, cycle = switching
    forwards, tokens = {}, {}
    for budget in (1.0, 1e-6):
        policy = GuardPolicy(leave=10.0, enter=10.0, first_interval=1024, max_interval=1024, read_budget=budget)
        with EagleRuntime.open(art, threads=1, guard=policy) as rt:
            res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
            read_cost = rt.generator.costs.read_ratio(1)
        assert res.stats.spec_rounds == 4 and res.stats.plain_rounds > 200  # 3, a calibration, 1 judged: plain
        assert read_cost is not None and read_cost > 0
        forwards[budget], tokens[budget] = res.stats.draft_forwards, res.tokens
    assert tokens[1.0] == tokens[1e-6] == cycle[1:N_NEW + 1]
    assert forwards[1e-6] < forwards[1.0]


def test_runtime_reads_on_the_guards_schedule(switching):
    """A request the guard keeps plain (leave and enter out of reach, no probe, a pinned cost): its draft reads the
    lagging tokens when ``Guard.read_need`` says, 8 then 16, 32 and 64 tokens later (120 of its ~240 plain tokens),
    not the 128 after those: four draft passes more than with reads off. The runtime keeps the next read's lag count
    between rounds (``Slot.read_at``); a count kept past a read, or one that does not follow the doubling, reads
    more or fewer times."""
    art, cycle = switching
    forwards = {}
    for every in (16, 0):
        policy = GuardPolicy(leave=10.0, enter=10.0, first_interval=1024, max_interval=1024, cost_ratio=2.0,
                             shadow_every=every)
        with EagleRuntime.open(art, threads=1, guard=policy) as rt:
            res = rt.generate(prompt_ids=[cycle[0]], max_new_tokens=N_NEW, stop_on_eos=False)
        assert res.tokens == cycle[1:N_NEW + 1]
        assert res.stats.spec_rounds == 3 and res.stats.plain_rounds > 200
        forwards[every] = res.stats.draft_forwards
    assert forwards[16] - forwards[0] == 4


def test_guarded_batch_keeps_each_sequence_plain_decodings(models):
    """Four slots, requests joining and leaving, each with its own guard switching often (mixed rounds: some slots
    draft, some run plain, some leave with their accepted path in the lag rows, lag rows flushed and read): every
    request's tokens, greedy or sampled, are those of plain decoding alone with its seed."""
    _, _, art = models("mha", max_batch=4)
    busy = GuardPolicy(min_rounds=1, probe_rounds=1, first_interval=2, budget=1.0, cost_ratio=1.5)
    rng = np.random.default_rng(5)
    with EagleRuntime.open(art, threads=1, max_batch=4, guard=busy) as rt, EagleRuntime.open(art, threads=1) as one:
        vocab = rt.manifest.target.vocab_size
        reqs = []
        for i in range(8):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 20))).tolist()
            params = SamplingParams(temperature=0.9, seed=i) if i % 2 else None
            reqs.append((prompt, int(rng.integers(20, 80)), params))
        streams = [rt.submit(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, sampling=sp,
                             tree=TreeParams(8, 2, 16) if i % 3 == 0 else None) for i, (p, n, sp) in enumerate(reqs)]
        results = [s.wait(timeout=300) for s in streams]
        for (p, n, sp), res in zip(reqs, results, strict=True):
            plain = one.generate(prompt_ids=p, max_new_tokens=n, stop_on_eos=False, sampling=sp, use_draft=False)
            assert res.tokens == plain.tokens
            st = res.stats
            assert st.spec_rounds + st.plain_rounds == st.rounds
        # most requests ran plain rounds: switched off, or (once the runtime's running tau said so) started plain
        assert sum(r.stats.guard_switches for r in results) >= 1
        assert sum(1 for r in results if r.stats.plain_rounds) >= 4
        assert max(r.stats.plain_rounds for r in results) > rt.generator._lag_rows  # the lag rows filled up


def test_the_first_read_after_a_collapse_is_not_spaced_by_its_cost():
    """A switch the window made alone (three bad rounds after a good stretch: a dip, which a paying draft has now and
    then) is read again at half of shadow_every whatever a read costs; a switch the running tau made (a draft that
    loses on average) waits for the reads' budget, as do the later reads after a dip. Catches the first read after
    a dip spaced by its cost (30 tokens on the fixture, most of a 64-token request run plain), or every read freed."""
    dip = Guard(GuardPolicy(read_budget=0.05))
    feed(dip, [8] * 10 + [1] * 3, 3.0)
    assert dip.mode == PLAIN and dip.dip
    assert [dip.shadow_due(n, 1.0) for n in (7, 8)] == [False, True]  # not 1.0 / 0.05 = 20
    dip.shadow(0, 8, 3, 3.0)  # read badly: stays plain; the next read waits for the budget
    assert dip.mode == PLAIN and [dip.shadow_due(n, 1.0) for n in (19, 20)] == [False, True]
    slow = Guard(GuardPolicy(read_budget=0.05))
    feed(slow, [1] * 3, 3.0)
    assert slow.mode == PLAIN and not slow.dip
    assert [slow.shadow_due(n, 1.0) for n in (19, 20)] == [False, True]

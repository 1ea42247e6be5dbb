"""A speculating request's chain length, per round: the artifact's chain, or a short one while the text is hard.

A chain (top_k 1) of T draft tokens commits more tokens a round the longer it is, and costs more (T draft passes,
T + 1 verify rows). The best T depends on how deep the head drafts, which depends on the text: a chain tuned where
the head drafts 8 tokens deep (a target that loops) loses on text where it drafts 2, and the guard then runs it
plain, where a chain of 3 still paid. Per request, ``ChainLength`` estimates what each of two chains would commit
from the request's own rounds (``ChainLength.tokens``) and, after each speculative round, picks the next round's
chain: the base (the request's tree) or ``short`` (its total_tokens times ``GuardPolicy.chain_short``, at least 1),
by tokens a round over the round's cost. A cost the runtime measured (``RoundCosts.spec_seconds``: the median wall
time of its recent rounds of that chain) is used where there is one; else it is modelled from the other chain's as
half fixed, half in proportion to the draft tokens (``MODEL_FIXED``). The model is a guess that lets a request try
the other chain: a round's cost is far from proportional to its draft tokens (the fixture's 16-layer target: 2 draft
tokens 2.25 ms against 4 at 2.4 ms; a 6-layer one: 3 at 1.65 ms against 8 at 2.6 ms), and the tried chain's own
rounds are measured from then on. The base is the chain that was tuned: moving to the short one needs a gain of
``TO_SHORT`` (measured) or ``TO_SHORT_MODELLED``, moving back ``TO_BASE`` (a short chain's few cheaper rounds on a
16-layer target are worth less than the base's deep rounds it misses when the text turns draftable).

Pure: the caller gives each round's accepted count and the costs. Which chain drafts never changes a token (a
chain's first T tokens are the longer chain's, and selection and acceptance are lossless either way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eagle_export.tree_params import TreeParams

Measured = Callable[[TreeParams, int], float | None]  # (chain, rounds at least) -> its measured round cost

HALF_LIFE = 8.0  # speculative rounds over which a round's weight in the estimates halves
TO_SHORT = 0.10  # a switch to the short chain needs this gain, its cost measured
TO_SHORT_MODELLED = 0.15  # ... its cost modelled
TO_BASE = 0.02  # a switch back to the base chain needs this gain
WHOLE = 2  # the short chain accepted whole this many rounds in a row: back to the base, whatever the estimates
DEEP_PRIOR = 1.0  # pseudo-tokens of the short levels' acceptance in the deep levels' (which decays to it unseen)
MIN_ROUNDS = 1  # speculative rounds seen before the first switch
MIN_BASE = 6  # a chain of fewer draft tokens keeps its length (see below)
TRUSTED = 2  # rounds a chain's measured cost must be the median of to be used once the request left that chain
MODEL_FIXED = 0.5  # an unmeasured chain's cost: this share of the other chain's, plus the rest scaled by draft tokens
P_MAX = 0.999  # p is kept below 1 (a chain that accepted everything so far)
DECAY = 0.5 ** (1.0 / HALF_LIFE)


def chain(total_tokens: int) -> TreeParams:
    """The chain of ``total_tokens`` draft tokens as the runtime drafts it (``TreeParams.trimmed``)."""
    return TreeParams(1, total_tokens, total_tokens).trimmed()


def short_of(base: TreeParams, fraction: float) -> TreeParams | None:
    """The short alternative of a chain ``base``: ``fraction`` of its total_tokens, rounded, at least 1; None where
    there is none (not a chain, a threshold, shorter than ``MIN_BASE``, or no shorter chain)."""
    if base.top_k != 1 or base.threshold or fraction <= 0 or base.total_tokens < MIN_BASE:
        return None
    n = max(1, round(base.total_tokens * fraction))
    return chain(n) if n < base.total_tokens else None


def expected_tokens(p: float, draft: int) -> float:
    """Tokens a round of a chain of ``draft`` tokens commits when each is accepted with ``p`` after its parent."""
    return float(draft + 1) if p >= 1.0 else (1.0 - p ** (draft + 1)) / (1.0 - p)


@dataclass
class ChainLength:
    """One request's choice between its chain ``base`` and the shorter ``short`` (``short_of``); ``tree`` is the chain
    its next speculative round drafts.

    What each chain would commit a round comes from the request's rounds, each weighing less by half every
    ``HALF_LIFE`` rounds. The short chain's is exact from a round of either chain: ``1 + min(accepted, T_short)``
    (a chain's first tokens are the longer chain's). The base chain's adds, for the rounds that reached the short
    chain's end, the tokens beyond it: ``p + ... + p^(T_base - T_short)``, ``p`` the acceptance of the tokens past
    the short chain's end, counted on the base chain's rounds that reached it (kept while the request drafts the short
    chain, which does not see them, but decaying as every estimate does, towards the short chain's own acceptance:
    a head that drafted badly past the short chain's end once is tried there again). A geometric ``p`` over every
    token said too little where a head drafts either nothing or a whole loop (rounds of 0 and 8 accepted: the base
    commits 5 a round, such a ``p`` said 2.4)."""

    base: TreeParams
    short: TreeParams
    tree: TreeParams = field(init=False)
    rounds: float = 0.0  # decayed speculative rounds
    upto: float = 0.0  # decayed sum of min(accepted, short's draft tokens)
    reached: float = 0.0  # decayed rounds that accepted the whole short chain
    deep_hits: float = 0.0  # decayed tokens accepted past the short chain's end (base rounds)
    deep_misses: float = 0.0  # decayed rejections past the short chain's end (base rounds)
    seen: int = 0  # speculative rounds seen
    switches: int = 0  # times the chain changed
    whole: int = 0  # the short chain's latest rounds in a row that accepted it whole

    def __post_init__(self) -> None:
        self.tree = self.base

    def tokens(self, t: TreeParams) -> float | None:
        """What a round of chain t (base or short) would commit, estimated (None: no round yet)."""
        if self.rounds <= 0:
            return None
        short = 1.0 + self.upto / self.rounds
        if t == self.short:
            return short
        pool = self.upto / (self.upto + self.rounds - self.reached)  # the short levels' acceptance
        p = min((self.deep_hits + DEEP_PRIOR * pool) / (self.deep_hits + self.deep_misses + DEEP_PRIOR), P_MAX)
        return short + self.reached / self.rounds * (expected_tokens(p, self.base.total_tokens
                                                                    - self.short.total_tokens) - 1.0)

    def cost(self, t: TreeParams, measured: Measured) -> float | None:
        """Chain t's round cost (in ``measured``'s unit): measured, else modelled from the other chain's measured cost
        (``MODEL_FIXED``); None: neither measured. The chain the request drafts now is measured from one round on (its
        next rounds refresh the figure); the other from ``TRUSTED`` on (one noisy round does not keep a request off
        a chain it no longer runs, and so no longer measures)."""
        return self._cost(t, measured)[0]

    def _cost(self, t: TreeParams, measured: Measured) -> tuple[float | None, bool]:
        """(``cost``, whether that cost was measured rather than modelled)."""
        m = measured(t, 1 if t == self.tree else TRUSTED)
        if m is not None:
            return m, True
        other = self.short if t == self.base else self.base
        o = measured(other, 1 if other == self.tree else TRUSTED)
        if o is None:
            return None, False
        return o * (MODEL_FIXED + (1.0 - MODEL_FIXED) * t.total_tokens / other.total_tokens), False

    def after(self, ran: TreeParams, accepted: int, measured: Measured) -> TreeParams:
        """One speculative round that drafted chain ``ran`` and accepted ``accepted`` of its draft tokens;
        ``measured(t, n)``: chain t's measured round cost, in any unit common to both chains, if the median of at
        least n rounds (None: not so measured). Returns the next round's chain."""
        decay, ts = DECAY, self.short.total_tokens
        on_base = ran == self.base
        self.rounds = self.rounds * decay + 1.0
        self.upto = self.upto * decay + min(accepted, ts)
        self.reached = self.reached * decay + (accepted >= ts)
        deep = on_base and accepted >= ts
        self.deep_hits = self.deep_hits * decay + (accepted - ts if deep else 0)
        self.deep_misses = self.deep_misses * decay + (deep and accepted < self.base.total_tokens)
        self.seen += 1
        if accepted > ts and self.tree is self.base:  # past the short chain's end: no reason to leave the base now
            self.whole = 0
            return self.tree
        self.whole = self.whole + 1 if not on_base and accepted >= ts else 0
        if self.whole >= WHOLE and self.tree is self.short:  # the text turned draftable: the estimates lag behind
            self.tree, self.whole = self.base, 0
            self.switches += 1
            return self.tree
        if self.seen < MIN_ROUNDS:
            return self.tree
        other = self.short if self.tree == self.base else self.base
        here, (there, known) = self.cost(self.tree, measured), self._cost(other, measured)
        if here is None or there is None or here <= 0 or there <= 0:
            return self.tree
        gain = (self.tokens(other) / there) / (self.tokens(self.tree) / here)
        margin = TO_BASE if other == self.base else TO_SHORT if known else TO_SHORT_MODELLED
        if gain > 1.0 + margin:
            self.tree = other
            self.switches += 1
        return self.tree

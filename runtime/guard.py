"""The speculation guard: per request, run plain rounds while speculation loses, and probe back now and then.

A speculative round commits ``tau`` tokens (its accepted draft tokens plus the bonus) and costs ``ratio`` plain
steps (``ratio``: the wall time of the runtime's recent speculative rounds over that of its recent plain rounds,
``RoundCosts``). Speculation pays while ``tau / ratio`` (its speed as a multiple of plain decoding's) stays at least
1. The guard keeps an average of a request's ``tau`` over its speculative rounds and:

- after ``min_rounds`` speculative rounds, switches the request to plain rounds when the estimate ``tau / ratio``
  falls below ``leave`` (hysteresis: a request that pays a little is left alone) by ``confidence`` standard errors
  of the running tau, taken from the spread of the request's own rounds (a draft whose rounds commit 1 or 8 tokens at
  random needs more rounds to convict than one that commits 1 every round), or, a collapse after a good stretch, when
  its last ``window`` rounds' mean is below half the break-even;
- meanwhile, every ``shadow_every`` plain rounds the draft reads the tokens committed since (the context pass that
  keeps its cache in step, run anyway): how often its top-k held the next token estimates what a round would commit
  (``shadow``), and a draft that would pay again is probed at once; reads are spaced by what they cost
  (``read_budget``), except the first after a collapse (``dip``), which comes at half of ``shadow_every``;
- after ``interval`` plain rounds, probes: ``probe_rounds`` speculative rounds, whose mean ``tau`` decides. At least
  ``enter`` and the request speculates again (the interval starts over); below it, back to plain rounds with the
  interval doubled (at most ``max_interval``). An interval is never shorter than what keeps a probe's expected
  loss within ``budget`` of the plain rounds between probes: ``probe_rounds * (ratio - 1) / budget``;
- with no plain-round figure yet (a fresh runtime), runs ``calibration_rounds`` plain rounds to measure one
  (``calibrate``; the first plain round after speculative ones is slow, and the figure is the rounds' median), then
  goes on speculating;
- a request's running tau starts from the runtime's running tau for its tree (``RoundCosts.prior``, weighing as
  ``prior_rounds`` rounds), so one whose first rounds commit little, on a head that pays, is not switched off at once;
  where that prior says speculation loses, a request starts with plain rounds (``start``).

Everything here is a pure function of the figures it is given (no clock, no graph): ``RoundCosts`` holds what the
runtime measured, and a test can give ``Guard.after`` any figures it likes. Which rounds ran plain never changes a
token: greedy output is the target's either way, and a sampled request draws one uniform per committed token in
both kinds of round (runtime/accept.py), so the same seed gives the same tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from eagle_export.errors import GenerationError

SPEC = "spec"  # the next round drafts
PLAIN = "plain"  # the next round is a plain one-token step
MIXED = "mixed"  # RoundCosts' key of a batched round whose drafting sequences had different trees
MIN_READ = 4  # lagging tokens a shadow read needs at least (fewer say little about the draft)


@dataclass(frozen=True)
class GuardPolicy:
    """The guard's settings (docs/runtime.md, "The speculation guard"). ``cost_ratio``: a fixed cost of a
    speculative round in plain steps instead of the measured one (None: measured); with it, the guard's decisions
    depend on the tokens alone (the tests use it; a deployment may pin a ratio it measured)."""

    leave: float = 0.85  # speculation's estimated speed (x plain) below which a request switches to plain rounds
    enter: float = 1.0  # a probe's estimate at or above which it speculates again
    alpha: float = 0.1  # weight of the newest speculative round in the running tau (the plain mean until 1/alpha)
    confidence: float = 2.0  # standard errors the running tau must be below the break-even by to switch off
    min_rounds: int = 3  # speculative rounds before the guard first judges a request
    probe_rounds: int = 2  # speculative rounds per probe
    first_interval: int = 8  # plain rounds before the first probe (at least)
    max_interval: int = 1024  # plain rounds between probes, at most
    budget: float = 0.02  # a probe's expected loss, at most this share of the plain rounds between probes
    shadow_every: int = 16  # in plain rounds, the draft reads the tokens every this many (0: never; see shadow())
    read_budget: float = 0.03  # shadow reads at most this share of the plain rounds' time (their measured cost)
    shadow_window: int = 16  # a shadow read judges the draft on the last this many tokens it read
    prior_rounds: int = 4  # the runtime's running tau for the tree starts a request's, weighing as this many rounds
    window: int = 3  # a collapse: the last this many speculative rounds' mean below half the break-even switches off
    calibration_rounds: int = 3  # plain rounds that measure a plain step where there is no figure (their median)
    cost_ratio: float | None = None
    # A guarded chain's short alternative, as a fraction of its total_tokens (runtime/chain_length.py; 0: none): each
    # speculative round of a chain request drafts the base chain or that one, whichever pays more on its text.
    chain_short: float = 0.4

    def validate(self) -> GuardPolicy:
        def real(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise GenerationError(f"guard {name} must be a number in [{lo}, {hi}], got {v!r}")

        def count(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GenerationError(f"guard {name} must be an integer >= 1, got {v!r}")

        real("leave", 0.0, 10.0)
        real("enter", self.leave, 10.0)
        real("alpha", 1e-6, 1.0)
        real("confidence", 0.0, 10.0)
        real("budget", 1e-6, 1.0)
        real("read_budget", 1e-6, 1.0)
        real("chain_short", 0.0, 1.0)
        for name in ("min_rounds", "probe_rounds", "first_interval", "max_interval", "prior_rounds", "window",
                     "shadow_window", "calibration_rounds"):
            count(name)
        if isinstance(self.shadow_every, bool) or not isinstance(self.shadow_every, int) or self.shadow_every < 0:
            raise GenerationError(f"guard shadow_every must be an integer >= 0, got {self.shadow_every!r}")
        if self.max_interval < self.first_interval:
            raise GenerationError(f"guard max_interval {self.max_interval} is below first_interval "
                                  f"{self.first_interval}")
        if self.cost_ratio is not None:
            real("cost_ratio", 1e-6, 1e6)
        return self


DEFAULT_POLICY = GuardPolicy()


@dataclass
class Guard:
    """One request's guard. ``after(ran, committed, ratio)`` after each of its rounds returns the next round's mode
    (``SPEC`` or ``PLAIN``); ``mode`` is that mode until the next call."""

    policy: GuardPolicy = field(default_factory=GuardPolicy)
    mode: str = SPEC
    tau: float | None = None  # running tau over speculative rounds (None: none yet)
    spec_seen: int = 0  # speculative rounds since the guard last (re)started judging
    plain_left: int = 0  # plain rounds before the next probe
    interval: int = 0  # the current interval between probes (0: not switched yet)
    probing: int = 0  # speculative rounds of the current probe still to run (0: not probing)
    probe_sum: int = 0  # committed tokens of the current probe so far
    calibrating: int = 0  # the next this many plain rounds only measure a plain step
    switches: int = 0  # times the guard turned speculation off
    # (tau, variance, rounds it averages) of the runtime's earlier speculative rounds of this tree
    prior: tuple[float, float, float] | None = None
    reads: int = 0  # shadow reads since the last switch to plain rounds
    failed: int = 0  # probes failed since the last switch to plain rounds (each doubles the shadow reads' spacing)
    dip: bool = False  # the last switch to plain rounds was the window's alone (a collapse the running tau hid)
    recent: list[int] = field(default_factory=list)  # the last ``window`` speculative rounds' committed tokens
    weight: float = field(default=0.0, init=False)  # pseudo-rounds of the prior still in the running tau
    # The request's own rounds since it was last judged afresh, averaged as tau is but without the prior: their
    # variance is what the confidence margin is made of (``stderr``).
    own_tau: float = field(default=0.0, init=False)  # their running mean
    own_var: float = field(default=0.0, init=False)  # their running variance

    def __post_init__(self) -> None:
        self._restart()

    def start(self, ratio: float | None) -> str:
        """Before a request's first round: if the runtime's earlier requests on this tree say speculation loses (the
        prior's tau, ``confidence`` standard errors up, below ``leave`` x ``ratio``), it starts with plain rounds (its
        shadow reads and probes find out whether it pays after all). Returns the first round's mode."""
        p = self.policy
        if self.prior is not None and ratio is not None:
            tau, var, n = self.prior
            if (tau + p.confidence * math.sqrt(var / max(n, 1.0))) / ratio < p.leave:
                self._to_plain(p.first_interval, ratio)
        return self.mode

    def _restart(self) -> None:
        """Judge afresh: the running tau starts from the prior (weighing prior_rounds rounds), or from nothing."""
        self.spec_seen = 0
        self.recent = []
        self.own_tau = self.own_var = 0.0
        if self.prior is not None:
            self.tau = self.prior[0]
            self.weight = float(self.policy.prior_rounds)
        else:
            self.tau, self.weight = None, 0.0

    def after(self, ran: str, committed: int, ratio: float | None) -> str:
        """Account one round of this request and return the mode of its next one.

        ran: what the round was (``SPEC``: it verified a draft tree; ``PLAIN``: a one-token step); committed: tokens
        it committed (accepted draft tokens + the bonus); ratio: what a speculative round costs in plain steps
        (None: not known yet)."""
        p = self.policy
        if ran == PLAIN:
            if self.calibrating:  # a plain step measured: speculate on after the last
                self.calibrating -= 1
                if not self.calibrating:
                    self.mode = SPEC
            elif self.mode == PLAIN:
                self.plain_left -= 1
                if self.plain_left <= 0:
                    self.mode, self.probing, self.probe_sum = SPEC, p.probe_rounds, 0
            return self.mode
        if self.probing:
            self.probe_sum += committed
            self.probing -= 1
            if self.probing:
                return self.mode
            tau = self.probe_sum / p.probe_rounds
            if ratio is None or tau / ratio >= p.enter:  # it pays again: speculate, judged afresh
                self._restart()
                self.interval, self.mode = 0, SPEC
            else:
                failed = self.failed + 1
                self._to_plain(min(2 * self.interval, p.max_interval), ratio)
                self.failed = failed
            return self.mode
        self._add(committed)
        if self.spec_seen < p.min_rounds:
            return self.mode
        if ratio is None:  # no plain figure yet: plain rounds measure it
            self.calibrating, self.mode = p.calibration_rounds, PLAIN
        else:
            slow = (self.tau + p.confidence * self.stderr) / ratio < p.leave
            collapse = len(self.recent) == p.window and sum(self.recent) / p.window / ratio < p.leave / 2
            if slow or collapse:
                self._to_plain(p.first_interval, ratio)
                self.switches += 1
                self.dip = not slow
        return self.mode

    def rejudge(self) -> str:
        """This round's verdict switched the request to plain rounds, but it drafts another chain from its next round
        (runtime/chain_length.py): the switch is taken back and the new chain judged afresh from its own rounds, as
        after a probe that paid. (On the 6-layer pair the 8-token chain's first rounds commit 1.3 tokens at 5 plain
        steps a round: the guard left after 3 of them, where the 3-token chain paid 1.07x.) Returns the mode."""
        self.switches -= 1
        self.dip = False
        self.mode, self.interval, self.plain_left = SPEC, 0, 0
        self._restart()
        return self.mode

    def shadow_due(self, lagged: int, read_cost: float | None = None) -> bool:
        """Is a shadow read due, with ``lagged`` tokens unread? (``read_need``.)"""
        need = self.read_need(read_cost)
        return need is not None and lagged >= need

    def read_need(self, read_cost: float | None = None) -> int | None:
        """The unread tokens from which a shadow read is due (None: none is, in this state). The first after a switch
        comes at half of ``shadow_every`` (at least ``MIN_READ``), so that a dip is over sooner; the next
        ``shadow_every`` later, and each later one twice as far as the one before, twice more for every probe that
        failed since (a draft that keeps reading badly, or reads well but does not pay, is read and probed ever more
        rarely; the lag rows' own flushes, every few hundred tokens, are reads too). read_cost: what a read costs in
        plain rounds (measured; None: unknown): reads are never closer than what keeps that cost within
        ``read_budget`` of the plain rounds between them (where a draft call costs a plain step, a read every 8
        tokens made plain rounds 12% slower), except the first after a switch the window alone made (``dip``: three
        bad rounds, which a draft that pays has now and then; on the fixture's demo EAGLE-3 head, `def main():`'s
        first rounds): spaced by its cost it came 30 tokens later, most of a 64-token request run plain behind a draft
        that drafted perfectly again after its dip. It changes only with the state (a read, a switch, a probe) and
        the cost, so a caller may keep it between rounds (``Generator._keep_lag``)."""
        p = self.policy
        if not p.shadow_every or self.mode != PLAIN or self.calibrating:
            return None
        if self.reads == 0 and not self.failed:
            need = max(MIN_READ, p.shadow_every // 2)
        else:
            need = max(MIN_READ, min(p.shadow_every << (max(self.reads - 1, 0) + self.failed), p.max_interval))
        if read_cost is not None and not (self.dip and self.reads == 0):
            need = max(need, min(math.ceil(read_cost / p.read_budget), p.max_interval))
        return need

    def shadow(self, hits: int, seen: int, depth: int, ratio: float | None) -> str:
        """In plain rounds: the draft has just read ``seen`` committed tokens (the lag rows' context pass), and its
        top_k held the next token ``hits`` times. With that depth-1 acceptance ``a`` at every level, a round of a tree
        ``depth`` levels deep would commit ``1 + a + ... + a^(depth + 1)`` tokens; if that pays (``enter``), probe
        now rather than at the end of the interval. Returns the next round's mode."""
        if self.mode != PLAIN or self.calibrating or seen <= 0:
            return self.mode
        self.reads += 1
        a = hits / seen
        tau = sum(a ** d for d in range(depth + 2))
        if ratio is None or tau / ratio >= self.policy.enter:
            self.mode, self.probing, self.probe_sum = SPEC, self.policy.probe_rounds, 0
        return self.mode

    def _add(self, committed: int) -> None:
        """One speculative round into the running tau (from the prior, its pseudo-rounds counted) and into the
        request's own mean and variance (from its first round): exponentially weighted (weight alpha), the plain mean
        and variance while fewer than 1/alpha rounds were seen, so the first rounds weigh alike."""
        self.spec_seen += 1
        self.recent.append(committed)
        del self.recent[:-self.policy.window]
        v = max(self.policy.alpha, 1.0 / self.spec_seen)
        d = committed - self.own_tau
        self.own_tau += v * d
        self.own_var = (1 - v) * (self.own_var + v * d * d)
        w = max(self.policy.alpha, 1.0 / (self.spec_seen + self.weight))
        self.tau = float(committed) if self.tau is None else self.tau + w * (committed - self.tau)

    @property
    def stderr(self) -> float:
        """The running tau's standard error, from the spread of the request's own rounds over how many of them it
        averages. Not the prior's: a request whose rounds commit 1 every time, on a head that committed 3 for the
        requests before, is no noisier for the difference; counted as noise, that distance kept such a request at a
        ratio of 2.3 speculating for 10 rounds (the window's collapse rule needs a ratio above 2.35), most of an
        undraftable stretch (docs/runtime.md, "The speculation guard")."""
        n = min(self.spec_seen, 2 / self.policy.alpha - 1)
        return math.sqrt(self.own_var / n) if n > 0 else 0.0

    def _to_plain(self, interval: int, ratio: float) -> None:
        p = self.policy
        self.reads = self.failed = 0
        self.dip = False
        floor = math.ceil(p.probe_rounds * max(ratio - 1.0, 0.0) / p.budget)
        self.interval = max(interval, min(floor, p.max_interval))
        self.plain_left, self.mode = self.interval, PLAIN


@dataclass
class _Recent:
    """The last ``RoundCosts.WINDOW`` round times of one kind; ``value`` is their median."""

    times: list[float]
    at: int  # committed rows (of the longest sequence) when last updated
    n: int  # RoundCosts.rounds when last updated
    count: int = 1  # rounds ever pushed
    median: float | None = None  # ``value``, kept until the next push

    @property
    def value(self) -> float:
        if self.median is None:
            self.median = statistics.median(self.times)
        return self.median


class RoundCosts:
    """The runtime's measured round times: the median of the last ``WINDOW`` speculative rounds per (sequences, tree)
    and of the last ``WINDOW`` plain rounds per number of sequences. A median, not an average: on a shared CPU a round
    now and then loses a scheduler slice (4-13 ms against a 1.1 ms plain step, measured beside another process's
    spinning threads), and one such round in a running average moved the ratio by 1-2 plain steps and switched
    paying requests off. Rounds that join, switch or catch up are measured too; the median leaves them out.
    ``ratio`` is what the guard reads.

    A speculative figure not updated for ``SPEC_STALE`` rounds is dropped: while a runtime's requests run plain rounds
    nothing refreshes it, and one measured in a slow moment (the first calls of a session, another process's threads
    spinning) would otherwise keep every later request plain (its shadow reads and probes judge against it). Without
    it ``ratio`` is None, which the guard reads as "unknown": a request starts speculating, a shadow read probes, and
    the probe's rounds measure the figure afresh. Where they measure it again at what it was (at least ``CONFIRMED``
    of the dropped ratio: not a slow moment after all), the next drop waits twice as many rounds, up to
    ``SPEC_STALE_MAX``; where they measure it much lower, ``SPEC_STALE`` again. So a draft that loses pays for those
    rounds ever more rarely: with a fixed horizon a head trained for another target, on a shallow target, cost 128-token
    requests 7% (every other request speculated for the 3 rounds it takes to judge, 0.90x plain decoding)."""

    # Rounds of each kind the median is over. A slow moment on a shared CPU lasts a request or two (on a 2-vCPU AMD
    # EPYC the same tree's ratio moved 1.95-4.5 from one request to the next): over 9 rounds a median measured inside
    # one made the guard run whole requests of a paying draft plain (EAGLE-3 22 of 90 bench-like requests with a
    # process spinning a core at random beside it, 5 of 90 over 33 rounds: tools/lab/guard_noise_ab.py --spinner).
    WINDOW = 33
    SPEC_STALE = 128  # rounds (of any kind) after which a speculative figure not updated since is dropped (at first)
    SPEC_STALE_MAX = 16 * SPEC_STALE  # the longest that horizon grows
    CONFIRMED = 0.8  # a figure measured afresh at this fraction of the dropped one or more confirms it
    TAU_ALPHA = 0.05  # weight of the newest round in the running tau across requests
    STALE = 2.0  # a plain figure measured at L rows is refreshed (``stale``) past STALE * L + 64 rows
    WARM = 32  # rounds a fresh runtime takes to warm up: a plain figure last measured within them is measured again

    def __init__(self) -> None:
        self._spec: dict[tuple, _Recent] = {}
        self._plain: dict[int, _Recent] = {}
        self._read: dict[int, _Recent] = {}  # the draft's lag passes in plain rounds (shadow reads), per sequences
        self._tau: dict = {}  # tree -> [running tau, running variance, rounds] over every request's speculative rounds
        self._horizon: dict[tuple, int] = {}  # (sequences, tree) -> rounds after which its figure is stale
        self._dropped: dict[tuple, float] = {}  # (sequences, tree) -> the ratio its figure had when dropped
        self.rounds = 0  # rounds recorded

    def note_tau(self, tree, committed: int) -> None:
        """One speculative round of a request with this tree committed so many tokens."""
        t = self._tau.get(tree)
        if t is None:
            self._tau[tree] = [float(committed), 0.0, 1]
            return
        t[2] += 1
        w = max(self.TAU_ALPHA, 1.0 / t[2])  # the plain mean until 1 / TAU_ALPHA rounds
        d = committed - t[0]
        t[0] += w * d
        t[1] = (1 - w) * (t[1] + w * d * d)

    def prior(self, tree) -> tuple[float, float, float] | None:
        """(tau, variance, rounds averaged) of this runtime's speculative rounds with this tree so far (None: none
        yet): where a new request's guard starts from."""
        t = self._tau.get(tree)
        return None if t is None else (t[0], t[1], min(t[2], 2 / self.TAU_ALPHA - 1))

    def record(self, active: int, tree, seconds: float, rows: int) -> None:
        """One round of ``active`` sequences: ``tree`` is the drafting sequences' tree (None: a round without a
        draft; ``"mixed"``: several trees), ``rows`` the longest sequence's committed rows."""
        if not seconds > 0:
            return
        self.rounds += 1
        if tree is None:
            self._push(self._plain, active, seconds, rows)
        else:
            self._push(self._spec, (active, tree), seconds, rows)

    def record_read(self, active: int, seconds: float, rows: int) -> None:
        """One shadow read (the draft's pass over a plain request's lagging tokens) in a round of ``active``
        sequences took ``seconds``."""
        if seconds > 0:
            self._push(self._read, active, seconds, rows)

    def _push(self, table: dict, key, seconds: float, rows: int) -> None:
        """``seconds`` into ``table[key]``'s last ``WINDOW`` times."""
        old = table.get(key)
        if old is None:
            table[key] = _Recent([seconds], rows, self.rounds)
            return
        old.times.append(seconds)
        del old.times[:-self.WINDOW]
        old.at, old.n = rows, self.rounds
        old.count += 1
        old.median = None

    def read_ratio(self, active: int) -> float | None:
        """A shadow read's cost in plain rounds at this many sequences (None: either unmeasured)."""
        r, p = self._read.get(active), self._plain.get(active)
        return None if r is None or p is None else r.value / p.value

    def ratio(self, active: int, tree) -> float | None:
        """A speculative round's time over a plain round's at this many sequences (None: one of them unmeasured, or
        the speculative one dropped as stale)."""
        p = self._plain.get(active)
        for key in ((active, tree), (active, MIXED)):
            s = self._spec.get(key)
            if s is None:
                continue
            if self.rounds - s.n > self._horizon.get(key, self.SPEC_STALE):
                del self._spec[key]
                if p is not None:
                    self._dropped[key] = s.value / p.value
            elif key in self._dropped and p is not None:  # measured afresh since the drop: was it a slow moment?
                again = s.value / p.value >= self.CONFIRMED * self._dropped.pop(key)
                h = self._horizon.get(key, self.SPEC_STALE)
                self._horizon[key] = min(2 * h, self.SPEC_STALE_MAX) if again else self.SPEC_STALE
        s = self._spec.get((active, tree)) or self._spec.get((active, MIXED))
        if s is None or p is None:
            return None
        return s.value / p.value

    def spec_seconds(self, active: int, tree, samples: int = 1) -> float | None:
        """The median wall time of the last speculative rounds of ``tree`` at this many sequences, the runtime's first
        one of them left out (None: fewer than ``samples`` of them): what a request's chain length compares
        (runtime/chain_length.py), with no plain figure needed. The first round on a session is slow (9.6 ms against
        2.6 ms later, the 6-layer pair's 8-token chain). No horizon, unlike ``ratio``'s: a chain's time against
        another's moves little, and an old figure of the short chain that made it look dear keeps requests on the
        tuned chain (dropped every 128 rounds, it sent the demo's paying requests to try the short chain again and
        again: 3.7% of their speed)."""
        s = self._spec.get((active, tree))
        if s is None:
            return None
        if s.count == len(s.times):  # the first round is still among them
            return statistics.median(s.times[1:]) if len(s.times) > samples else None
        return s.value if len(s.times) >= samples else None

    def stale(self, active: int, rows: int) -> bool:
        """Has the plain figure at this many sequences been measured at a much shorter length, or while the runtime
        warmed up (or never)? A figure of the warm-up is dropped once the runtime is past it: a fresh runtime's first
        plain rounds took 1.5-6.5 ms against 1.3 ms later (fixture, fp32), and a runtime serving only drafting
        requests measures its plain figure only when its guard calibrates, which on a fresh runtime is in its first
        request: that figure, kept, made every speculative round look 1.3-1.6x cheaper than it was."""
        p = self._plain.get(active)
        if p is not None and p.n <= self.WARM < self.rounds:
            del self._plain[active]
            return True
        return p is None or rows > self.STALE * p.at + 64

"""Per-sequence bookkeeping of batched decoding: requests, their stop rule, slots and the cache-row layout.

Pure Python and numpy, no graph calls: the batched loop (``generator.py``'s ``Generator``) asks these objects what each
sequence needs, and the tests check them without a model.

Cache-row layout (docs/runtime.md, "Batched decoding"): every cache is one allocation of ``B x rows_per_slot``
rows per buffer. The ``A`` active sequences sit in slots ``0 .. A-1`` (kept compact: a finished sequence's slot
is refilled by the last one), slot ``b`` at rows ``[b * stride, (b + 1) * stride)``. A graph call over ``A >= 2``
slots binds rows ``[0, A * stride)`` as one contiguous ``past`` of shape ``[A, stride, ...]``; each slot's
committed rows are a prefix of its region, and the mask hides the rest. One slot binds exactly its committed
rows (no padding), as a single sequence always did. The stride follows the longest sequence in steps of
``LayoutPlan.step`` rows, so padding stays bounded; growing or shrinking it moves the regions (a copy of the
committed rows, once per ``step`` rows of growth).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle_export.errors import GenerationError

from .sampling import SamplingParams


class StopRule:
    """Which of a round's tokens a request keeps, and why it ends: EOS (when asked), max_new_tokens, capacity.

    ``room`` is how many tokens still fit in the sequence (capacity - prompt). Tokens after a stop are dropped.
    """

    def __init__(self, max_new: int, room: int, eos: set[int] | frozenset[int] | None):
        self.max_new, self.room, self.eos = max_new, room, eos
        self.limit = min(max_new, room)
        self.out: list[int] = []

    def emit(self, new: list[int]) -> tuple[list[int], str | None]:
        """Append tokens up to EOS / max_new / capacity; return those kept and why generation ends, if it does."""
        reason = None
        if self.eos:
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new, reason = new[: i + 1], "eos"
                    break
        remaining = self.limit - len(self.out)
        if len(new) > remaining or (reason is None and len(new) == remaining):
            new = new[:remaining]
            reason = "length" if self.max_new <= self.room else "capacity"
        self.out.extend(new)
        return new, reason


@dataclass
class LayoutPlan:
    """The stride (rows per slot region) of one cache: ``need`` rounded up to a granule that grows with it
    (need / 16 to need / 8, at least ``step`` rows), kept while it fits with less than two granules of slack.

    Proportional granules bound both costs: the stride's own slack stays within about a quarter of the longest
    sequence (on top of the sequences' raggedness), and the regions move (a copy of every committed row) only
    when the longest sequence has grown by a granule, a bounded number of times per doubling.

    rows_per_slot: the stride's maximum: a sequence's cache rows, at most the graph's past_len maximum (a batched
    call binds [A, stride] as its past); step: the rounding of the stride.
    """

    rows_per_slot: int
    step: int = 16
    stride: int = 0
    moves: int = 0  # re-layouts so far (each copies the committed rows of every active slot)

    def __post_init__(self) -> None:
        if self.rows_per_slot < 1 or self.step < 1:
            raise ValueError("rows_per_slot and step must be >= 1")
        if not self.stride:
            self.stride = min(self.rows_per_slot, self.step)

    def granule(self, need: int) -> int:
        """The rounding of the stride for ``need`` rows: a power of two in (need / 16, need / 8], at least ``step``."""
        return max(self.step, 1 << max(0, need.bit_length() - 4))

    def wanted(self, need: int) -> int:
        """The stride for a batch whose longest slot needs ``need`` rows, or the current one if it still fits."""
        if need > self.rows_per_slot:
            raise ValueError(f"a slot needs {need} rows, more than the {self.rows_per_slot} it can hold")
        g = self.granule(need)
        if need <= self.stride < need + 2 * g:
            return self.stride  # fits, and less than two granules of slack: keep it (no move)
        return min(self.rows_per_slot, -(-need // g) * g)


def move_order(old: int, new: int, count: int) -> range:
    """Slot order for moving ``count`` regions from stride ``old`` to ``new`` in place without clobbering one that
    is not yet moved: last slot first when regions move up, first slot first when they move down."""
    return range(count - 1, -1, -1) if new > old else range(count)


@dataclass
class Padding:
    """Bound versus used rows in batched calls: what the common stride costs (``bench --concurrency`` reports it)."""

    bound: int = 0  # past rows bound, summed over calls and slots
    used: int = 0  # of those, rows a slot really attends to (its committed rows, plus its tree rows on a level)

    def add(self, bound: int, used: int) -> None:
        self.bound += bound
        self.used += used

    @property
    def fraction(self) -> float:
        """Share of bound past rows that are padding (0 with one sequence at a time)."""
        return 1.0 - self.used / self.bound if self.bound else 0.0


@dataclass
class Request:
    """One submitted generation, checked: what the scheduler needs to run it in a slot."""

    prompt: np.ndarray  # int64 ids
    max_new_tokens: int
    tree: object | None  # TreeParams, or None for --no-draft
    stop_on_eos: bool
    sampling: SamplingParams | None  # None: greedy
    rng: np.random.Generator | None = None
    on_round: object | None = None  # trace hook: called with (VerifyTree, Accepted) after each verify round
    logprobs: int | None = None  # None: none (no cost); N: each kept token's log-prob and N alternatives to the sink
    # The tree came from the artifact (no explicit tree): rounds follow its per-batch table (manifest batch_trees)
    # where it has one; ``tree`` is then the default tree the request starts from.
    tuned: bool = False
    # The speculation guard's settings (runtime/guard.py) for a request that drafts; None: every round drafts (the
    # runtime was opened with guard=False, or the request traces its rounds with on_round).
    guard: object | None = None


def check_max_new(max_new_tokens) -> int:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return max_new_tokens

"""The target's K/V cache behind one set of verbs, whichever layout the backend's target graph uses.

Two layouts (docs/graph-contract.md): the standard target graph reads a slot's committed rows as its past and returns
the call's new rows in a scratch, so keeping rows is a copy from the scratch (``ScratchTargetKV``); the fused graph
(contract 4) binds each slot's whole region as past and present and writes the call's rows in place after the past,
so keeping rows is a move down to follow the committed ones, and nothing happens after a prefill
(``InPlaceTargetKV``). The generator's round steps call these verbs (``bindings``, ``past``, ``wrote``, ``keep``,
``commit``, ``commit_root``, ``move_slot``) and never ask which layout it has.
"""

from __future__ import annotations

import numpy as np

from .kv_cache import FusedKVCache, KVCache
from .slots import LayoutPlan


class ScratchTargetKV:
    """The standard graph's cache: slot b's committed rows are rows ``[b * stride, b * stride + L)`` of ``cache``
    (the stride is ``plan``'s, which the generator moves as sequences grow), a call's new rows land in the scratch."""

    # A batch of trees is one call: its past is every region at the common stride.
    per_sequence_trees = False

    def __init__(self, cache: KVCache, plan: LayoutPlan, past_names: list[str], present_names: list[str]):
        self.cache, self.plan = cache, plan
        self._past_names, self._present_names = past_names, present_names

    @property
    def layout(self) -> LayoutPlan | None:
        """The layout the generator re-strides as sequences grow (None: every slot has a fixed region)."""
        return self.plan

    def memo_slot(self, slot: int) -> int:
        """The part of a call's first slot its fixed bindings depend on (none here: the past is bound per call)."""
        return 0

    def bindings(self, slot: int, a: int, n: int) -> tuple[dict, dict]:
        """A call's fixed cache bindings (inputs, outputs) over ``a`` slots from ``slot``, ``n`` new rows each: the
        scratch takes the new rows."""
        return {}, dict(zip(self._present_names, self.cache.new_block_views(a, n), strict=True))

    def past(self, a: int, past: int, slot: int) -> dict:
        """A call's past bindings: one slot's ``past`` committed rows, or ``a`` regions of ``past`` rows from row 0."""
        views = (self.cache.views(slot * self.plan.stride, past) if a == 1 else self.cache.block_views(a, past))
        return dict(zip(self._past_names, views, strict=True))

    def batch_past(self, lengths: list[int]) -> int:
        """The past a call over several sequences binds: the stride."""
        return self.plan.stride

    def wrote(self, b: int, past: int) -> None:
        """Slot b's last call wrote its rows after ``past`` bound rows (the scratch holds them: nothing to note)."""

    def keep(self, slot: int, start: int, count: int) -> None:
        """A prefill chunk's rows into the cache: slot ``slot``'s rows [start, start + count) = scratch rows
        [0, count)."""
        self.cache.write(slot * self.plan.stride + start, count)

    def room(self, b: int, L: int, last: bool) -> int:
        """Rows slot b may write after its L committed ones: up to the next slot's region (the last active slot, or a
        single sequence, has a whole sequence's rows). A continuing sequence always fits: its committed rows stay
        below capacity - 1 <= the stride; rows cut here belong to a sequence that ends in this round (its emitted
        tokens reach the capacity), and are never read."""
        return (self.cache.capacity if last else self.plan.stride) - L

    def commit(self, b: int, L: int, rows: np.ndarray, r0: int, last: bool) -> None:
        """Slot b's accepted path (verify rows ``rows`` of its call, whose first row is scratch row ``r0``) after its
        L committed rows."""
        self.cache.write_rows(b * self.plan.stride + L, rows[:self.room(b, L, last)], src=r0)

    def commit_root(self, b: int, L: int, r0: int, last: bool) -> None:
        """Slot b's one-row call (a plain step: scratch row ``r0``) after its L committed rows."""
        self.cache.write(b * self.plan.stride + L, min(1, self.room(b, L, last)), src=r0)

    def move_slot(self, src: int, dst: int, count: int) -> None:
        """Slot ``dst``'s first ``count`` rows = slot ``src``'s (a finished sequence's slot refilled by the last)."""
        self.cache.move(src * self.plan.stride, dst * self.plan.stride, count)


class InPlaceTargetKV:
    """The fused graph's cache (contract 4): every slot has a whole region of ``cache.capacity`` rows, bound as both
    past and present; a call writes its rows after the past it was given (``wrote``), and committing moves the
    accepted ones down to follow the committed rows."""

    # ONNX Runtime's GroupQueryAttention writes more than one row over a past for one sequence per call only: a batch
    # of trees is a call per sequence.
    per_sequence_trees = True
    layout = None

    def __init__(self, cache: FusedKVCache, past_names: list[str], present_names: list[str]):
        self.cache = cache
        self._past_names, self._present_names = past_names, present_names
        self._past = [0] * cache.slots  # per slot: the row after which its last call wrote its rows

    def memo_slot(self, slot: int) -> int:
        return slot

    def bindings(self, slot: int, a: int, n: int) -> tuple[dict, dict]:
        caches = self.cache.bind(slot, a)
        return (dict(zip(self._past_names, caches, strict=True)),
                dict(zip(self._present_names, caches, strict=True)))

    def past(self, a: int, past: int, slot: int) -> None:
        """Nothing per call: the whole regions are the fixed bindings."""
        return None

    def batch_past(self, lengths: list[int]) -> int:
        """The past a call over several one-row sequences binds: the longest committed prefix (each slot's whole
        region is bound, and the call writes its rows after that past)."""
        return max(lengths)

    def wrote(self, b: int, past: int) -> None:
        self._past[b] = past

    def keep(self, slot: int, start: int, count: int) -> None:
        """Nothing: the graph wrote the prefill chunk's rows in place."""

    def room(self, b: int, L: int, last: bool) -> int:
        return self.cache.capacity - L

    def commit(self, b: int, L: int, rows: np.ndarray, r0: int, last: bool) -> None:
        self.cache.commit(b, L, rows[:self.room(b, L, last)] + self._past[b])

    def commit_root(self, b: int, L: int, r0: int, last: bool) -> None:
        if self._past[b] != L:  # a plain step wrote its row after exactly the L committed ones: already in place
            self.cache.commit(b, L, [self._past[b]][:self.room(b, L, last)])

    def move_slot(self, src: int, dst: int, count: int) -> None:
        self.cache.move_slot(src, dst, count)


# Either layout's verbs: what the generator holds as ``tkv``.
TargetKV = ScratchTargetKV | InPlaceTargetKV


"""runtime/target_kv.py: the two target cache layouts keep the same rows for the same calls.

Each test writes what a target call would leave (the standard graph: its new rows in the scratch; the fused graph: its
rows in the slot's region after the past it was bound) and checks what the verbs keep. Planted bugs each test
catches: an in-place commit without the call's past offset, a commit past the slot's room (it would overwrite the
next slot's rows), a root step committed from the wrong row (or taken as in place when a batch's past put it
elsewhere), a slot move that copies the wrong region.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_export.runtime.kv_cache import FusedKVCache, KVCache
from eagle_export.runtime.slots import LayoutPlan
from eagle_export.runtime.target_kv import InPlaceTargetKV, ScratchTargetKV

LAYERS, HEADS, DIM, SLOTS, ROWS, STRIDE = 2, 1, 4, 2, 32, 16
NAMES = (["past_k", "past_v", "past_k1", "past_v1"], ["present_k", "present_v", "present_k1", "present_v1"])


def row_value(i: int) -> np.ndarray:
    """A row no other row equals: every layer's K and V filled with a value of its own."""
    return np.arange(2 * LAYERS * HEADS * DIM, dtype=np.float32).reshape(2 * LAYERS, HEADS, DIM) + 100.0 * i


class Scratch:
    """The standard graph's layout, with helpers that play the target call and read the committed rows."""

    def __init__(self):
        self.cache = KVCache(LAYERS, HEADS, DIM, ROWS, torch.float32, new_rows=16, slots=SLOTS)
        plan = LayoutPlan(ROWS, step=STRIDE)
        plan.stride = STRIDE
        self.kv = ScratchTargetKV(self.cache, plan, *NAMES)

    def call(self, slot: int, past: int, values: list[int], r0: int = 0) -> None:
        for i, v in enumerate(values):
            self.cache._np_new[:, 0, r0 + i] = row_value(v)
        self.kv.wrote(slot, past)

    def committed(self, slot: int, count: int) -> np.ndarray:
        base = slot * STRIDE
        return self.cache._np_all[:, 0, base:base + count].transpose(1, 0, 2, 3)


class InPlace:
    """The fused graph's layout, likewise."""

    def __init__(self):
        self.cache = FusedKVCache(LAYERS, HEADS, DIM, ROWS, torch.float32, SLOTS, lambda s, d: torch.zeros(s, dtype=d))
        self.kv = InPlaceTargetKV(self.cache, *NAMES)

    def call(self, slot: int, past: int, values: list[int], r0: int = 0) -> None:
        for i, v in enumerate(values):
            self.cache._np_all[:, slot, :, past + i] = row_value(v)
        self.kv.wrote(slot, past)

    def committed(self, slot: int, count: int) -> np.ndarray:
        return self.cache._np_all[:, slot, :, :count].transpose(2, 0, 1, 3)


LAYOUTS = [pytest.param(Scratch, id="scratch"), pytest.param(InPlace, id="in-place")]


def expect(values: list[int]) -> np.ndarray:
    return np.stack([row_value(v) for v in values])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_verify_keeps_its_accepted_path_after_the_committed_rows(layout):
    x = layout()
    x.call(1, 0, [1, 2, 3])  # a prefill of three rows in slot 1 ...
    x.kv.keep(1, 0, 3)  # ... kept (a copy from the scratch, or nothing: already in place)
    x.call(1, 3, [10, 11, 12, 13], r0=4)  # a tree of four rows over those three, its first row at scratch row 4
    x.kv.commit(1, 3, np.array([0, 2, 3]), r0=4, last=True)  # root, then nodes 2 and 3 accepted
    assert np.array_equal(x.committed(1, 6), expect([1, 2, 3, 10, 12, 13]))
    x.call(1, 6, [20], r0=4)  # a plain step: one row
    x.kv.commit_root(1, 6, r0=4, last=True)
    assert np.array_equal(x.committed(1, 7), expect([1, 2, 3, 10, 12, 13, 20]))
    assert not x.committed(0, 7).any()  # slot 0 untouched



@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plain_step_in_a_batch_keeps_its_row_after_its_own_committed_rows(layout):
    """A call over several one-row sequences binds the longest one's past: a shorter slot's row is written after that
    past and must move down to follow its own rows (planted: a root step taken as in place whatever the past)."""
    x = layout()
    x.call(0, 0, [1, 2])
    x.kv.keep(0, 0, 2)
    x.call(0, 5, [9])  # bound at the batch's past of 5 rows: the in-place layout wrote it at row 5
    x.kv.commit_root(0, 2, r0=0, last=False)
    assert np.array_equal(x.committed(0, 3), expect([1, 2, 9]))

def test_a_slot_that_is_not_the_last_keeps_no_row_past_its_region():
    """The standard layout's regions sit at the stride: slot 0's path is cut at the stride, slot 1's rows survive.
    The in-place layout has a whole region per slot: nothing is cut short of its capacity."""
    x = Scratch()
    x.call(1, 0, [7])
    x.kv.keep(1, 0, 1)
    L = STRIDE - 2
    x.call(0, L, [1, 2, 3])
    x.kv.commit(0, L, np.array([0, 1, 2]), r0=0, last=False)
    assert np.array_equal(x.committed(0, STRIDE)[L:], expect([1, 2]))
    assert np.array_equal(x.committed(1, 1), expect([7]))
    assert x.kv.room(0, L, last=True) == ROWS - L  # the last slot has a whole sequence's rows
    y = InPlace()
    assert y.kv.room(0, L, last=False) == ROWS - L


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_finished_slot_is_refilled_by_the_last_ones_rows(layout):
    x = layout()
    x.call(1, 0, [4, 5, 6])
    x.kv.keep(1, 0, 3)
    x.kv.move_slot(1, 0, 3)
    assert np.array_equal(x.committed(0, 3), expect([4, 5, 6]))


def test_the_layouts_bind_as_their_graphs_take_them():
    """The standard graph's past changes per call and its present is the scratch; the fused graph's past and present
    are the same whole regions, bound once (nothing per call)."""
    s, f = Scratch(), InPlace()
    ins, outs = s.kv.bindings(0, 1, 4)
    assert ins == {} and list(outs) == NAMES[1]
    assert list(s.kv.past(1, 5, 1)) == NAMES[0] and s.kv.past(1, 5, 1)["past_k"][2][1] == 5  # 5 rows bound
    ins, outs = f.kv.bindings(1, 1, 4)
    assert list(ins) == NAMES[0] and list(outs) == NAMES[1] and list(ins.values()) == list(outs.values())
    assert f.kv.past(1, 5, 1) is None
    assert (s.kv.batch_past([3, 9]), f.kv.batch_past([3, 9])) == (STRIDE, 9)

"""Preallocated K/V buffers: allocated once per runtime session, bound in place, written row by row.

Layout per layer and per K/V: [batch, capacity, kv_heads, head_dim] (the contract's BSHD). With
batch 1 the rows [0, n) are one contiguous block, so a graph reads the valid prefix in place.

A cache for ``slots`` sequences (batched decoding) holds ``slots x capacity`` rows per buffer in the same one
allocation; the batched loop places each sequence's region at a stride it chooses and binds ``[A, stride]``
blocks (``block_views``); see ``slots.py`` for the layout.

A graph's new K/V (its ``present_*`` outputs) land in a separate scratch, always at row 0, and the
runtime then copies the rows it keeps into the cache: all of them after a prefill chunk or a draft
call, only the accepted path after a verify. The scratch's address never changes, so a backend that
keeps its bindings rebinds only the ``past_*`` views (whose length grows) from call to call; binding
2 x layers moving cache views per call cost more than this copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from eagle_export.dtypes import BY_TORCH

from .views import BufferView, RowBuffers, row_runs


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str = "cpu", batch: int = 1, new_rows: int = 1,
                 zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None, slots: int = 1):
        """zeros: the backend's allocator (``Backend.zeros``: aligned device memory); default torch.zeros on device.
        slots: sequences held, ``capacity`` rows each (one allocation of slots x capacity rows per buffer)."""
        if batch != 1:
            raise ValueError("a KVCache's buffers are [1, rows, ...]: give slots for several sequences")
        self.capacity = capacity  # rows per sequence
        self.slots = slots
        capacity *= slots
        self.num_layers = num_layers
        self.new_capacity = new_rows
        # One allocation [2 * layers, batch, rows, kv_heads, head_dim] each for the cache and the new-rows scratch;
        # every buffer is a contiguous slice, so one indexing call moves rows of every layer.
        if zeros is None:
            zeros = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        self._all, self.buffers = _stacked(2 * num_layers, capacity, kv_heads, head_dim, dtype, zeros)
        self._new, self.new_buffers = _stacked(2 * num_layers, new_rows, kv_heads, head_dim, dtype, zeros)
        self._rows = RowBuffers(self.buffers)
        self._new_rows = RowBuffers(self.new_buffers)
        # On the CPU the copies go through numpy views of the same memory: a small torch op there can wake torch's
        # thread pool, which then competes with the graph runtime's threads (measured 15x slower in the loop).
        cpu = self._all.device.type == "cpu" and dtype != torch.bfloat16
        self._np_all = self._all.numpy() if cpu else None
        self._np_new = self._new.numpy() if cpu else None

    @property
    def allocations(self) -> list[torch.Tensor]:
        """What it allocated: the cache, then the new-rows scratch."""
        return [self._all, self._new]

    def rows(self, start: int, count: int) -> list[torch.Tensor]:
        """Contiguous views of cache rows [start, start + count) of every buffer (no copy)."""
        return self._rows.tensors(start, count)

    def views(self, start: int, count: int) -> list[BufferView]:
        """The same rows as BufferViews (address arithmetic, no tensor made): for backends that bind by address."""
        return self._rows.views(start, count)

    def new_rows(self, count: int) -> list[torch.Tensor]:
        """Rows [0, count) of the new-rows scratch of every buffer: where a graph writes its ``present_*``."""
        return self._new_rows.tensors(0, count)

    def new_views(self, count: int) -> list[BufferView]:
        return self._new_rows.head(count)

    def block_views(self, slots: int, rows: int) -> list[BufferView]:
        """Rows [0, slots * rows) of every buffer as [slots, rows, ...] views: a batched call's past."""
        return self._rows.block(0, slots, rows)

    def new_block_views(self, slots: int, rows: int) -> list[BufferView]:
        return self._new_rows.block(0, slots, rows)

    def write(self, start: int, count: int, src: int = 0) -> None:
        """Cache rows [start, start + count) = scratch rows [src, src + count), in every buffer."""
        self._rows.check(start, count)
        self._new_rows.check(src, count)
        if self._np_all is not None:
            self._np_all[:, :, start:start + count] = self._np_new[:, :, src:src + count]
        else:
            self._all[:, :, start:start + count].copy_(self._new[:, :, src:src + count])

    def move(self, src: int, dst: int, count: int) -> None:
        """Cache rows [dst, dst + count) = cache rows [src, src + count) (may overlap), in every buffer."""
        self._rows.check(src, count)
        self._rows.check(dst, count)
        if src == dst or not count:
            return
        if self._np_all is not None:
            self._np_all[:, :, dst:dst + count] = self._np_all[:, :, src:src + count].copy()
        else:
            self._all[:, :, dst:dst + count] = self._all[:, :, src:src + count].clone()

    def write_rows(self, start: int, rows: np.ndarray, src: int = 0) -> None:
        """Cache rows [start, start + len(rows)) = scratch rows ``src + rows`` (the accepted path), in every buffer.

        Copied run by run (consecutive scratch rows as one slice): a chain's path is a single run, and a slice
        copy is several times cheaper than a gather.
        """
        r = np.asarray(rows, dtype=np.int64).tolist()
        if src:
            r = [x + src for x in r]
        n = len(r)
        self._rows.check(start, n)
        if n and (min(r) < 0 or max(r) >= self.new_capacity):
            raise IndexError(f"scratch rows {r} outside {self.new_capacity} rows")
        dst, src = (self._np_all, self._np_new) if self._np_all is not None else (self._all, self._new)
        for i, j, first in row_runs(r):
            dst[:, :, start + i:start + j] = src[:, :, first:first + j - i]

ALIGN = 256  # bytes: TensorRT wants every bound tensor this aligned, so each buffer starts at such an offset


def _stacked(count: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             zeros: Callable) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``count`` buffers [1, rows, kv_heads, head_dim] as slices of one allocation (flat order [k0, v0, k1, ...]).

    Each buffer's rows are padded so the next buffer starts ALIGN-aligned (when the allocation is).
    """
    row_bytes = kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    step = ALIGN // math.gcd(row_bytes, ALIGN)  # rows per aligned block
    padded = -(-rows // step) * step
    whole = zeros((count, 1, padded, kv_heads, head_dim), dtype)
    return whole, [whole[i, :, :rows] for i in range(count)]


class FusedKVCache:
    """The fused target graph's cache (graph contract 4): per layer and per K/V one buffer
    ``[slots, kv_heads, rows, head_dim]`` (BNSH), bound whole as both past and present, so the graph writes each
    call's new rows in place and no call copies the cache.

    All ``2 x layers`` buffers are slices of one allocation ``[2 * layers, slots, kv_heads, rows, head_dim]``, so one
    indexing call moves rows in every layer. Slot b's committed rows are rows ``[0, L)`` of its region; a call over
    the first ``a`` slots writes its new rows after the call's common ``past`` (``bind``). After a verify, the
    accepted rows move down to follow the committed ones (``commit``): at most depth + 1 rows per layer.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, rows: int, dtype: torch.dtype, slots: int,
                 zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]):
        self.capacity = rows
        self.slots = slots
        self._all = zeros((2 * num_layers, slots, kv_heads, rows, head_dim), dtype)
        self.buffers = [self._all[i] for i in range(2 * num_layers)]
        self._np_all = self._all.numpy() if self._all.device.type == "cpu" and dtype != torch.bfloat16 else None
        slot_bytes = kv_heads * rows * head_dim * self._all.element_size()
        self._slot_bytes = slot_bytes
        self._addresses = [b.data_ptr() for b in self.buffers]
        dev = self._all.device
        self._tail = (kv_heads, rows, head_dim)
        self._type, self._dev, self._idx = BY_TORCH[dtype].name, dev.type, dev.index or 0
        self._memo: dict[tuple[int, int], list[BufferView]] = {}

    @property
    def allocations(self) -> list[torch.Tensor]:
        """What it allocated: the cache (there is no scratch)."""
        return [self._all]

    def bind(self, first: int, count: int) -> list[BufferView]:
        """Slots [first, first + count) of every buffer, [count, kv_heads, rows, head_dim]: a call's past and present
        (the same views)."""
        key = (first, count)
        got = self._memo.get(key)
        if got is None:
            if first < 0 or count < 1 or first + count > self.slots:
                raise IndexError(f"slots [{first}, {first + count}) outside {self.slots}")
            off, shape = first * self._slot_bytes, (count, *self._tail)
            got = self._memo[key] = [BufferView(a + off, self._type, shape, self._dev, self._idx)
                                     for a in self._addresses]
        return got

    def _arr(self):
        return self._np_all if self._np_all is not None else self._all

    def commit(self, slot: int, dst: int, src_rows) -> None:
        """Slot ``slot``'s rows [dst, dst + n) = its rows ``src_rows`` (n of them, ascending, each >= dst): the
        accepted path of a verify written after ``past``, moved to follow the committed rows. Copied run by run (a
        chain's path is one run); rows already in place are not touched."""
        r = [int(x) for x in src_rows]
        n = len(r)
        if n and (dst < 0 or dst + n > self.capacity or r[0] < dst or r[-1] >= self.capacity):
            raise IndexError(f"rows {r} -> [{dst}, {dst + n}) outside {self.capacity} rows")
        if not n or r[-1] == dst + n - 1:  # ascending, each >= dst: the last in place means all are (a chain's path)
            return
        a = self._arr()
        for i, j, first in row_runs(r):
            if first != dst + i:  # overlapping ranges: numpy copies through a buffer, torch needs a clone
                src = a[:, slot, :, first:first + j - i]
                a[:, slot, :, dst + i:dst + j] = src if self._np_all is not None else src.clone()

    def move_slot(self, src: int, dst: int, count: int) -> None:
        """Slot ``dst``'s rows [0, count) = slot ``src``'s (a finished sequence's slot refilled by the last one)."""
        if src != dst and count:
            a = self._arr()
            a[:, dst, :, :count] = a[:, src, :, :count]

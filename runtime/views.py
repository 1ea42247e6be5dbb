"""Bound memory, described once for every backend: ``BufferView`` and the arithmetic that makes views.

A backend binds raw memory: an address, an element type and a shape. ``BufferView`` is that description, used
by ONNX Runtime's IO binding and TensorRT's tensor addresses alike. A verify call binds two cache views per
layer, and making each as a torch slice costs more than ONNX Runtime's bind itself. The loop's buffers never
move, so a view of rows [start, start + count) is just ``base + start * row_bytes`` with a shape:
``RowBuffers`` computes that arithmetic for a set of same-shaped buffers, and ``HostScratch`` for the flat
host arrays that feed ids, positions and masks.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from eagle_export.dtypes import BY_TORCH, DTYPES


def row_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``rows`` (ints) as runs of consecutive values: (i, j, first) for ``rows[i:j] == range(first, first + j - i)``.
    A copy of rows run by run is a slice per run (a chain's path is one), several times cheaper than a gather, and
    on a device no index tensor is made from host rows (a blocking host-to-device copy)."""
    runs, i, n = [], 0, len(rows)
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        runs.append((i, j, rows[i]))
        i = j
    return runs


class BufferView(NamedTuple):
    """A contiguous block of memory: address, element type (the contract's dtype name), shape, and where it
    lives: ``device`` "cpu" (host memory) or "cuda", with the device ``index``."""

    address: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    index: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


_new_view = tuple.__new__  # BufferView from a tuple without NamedTuple's Python-level __new__ (hot loop)


class SplitInputs(Mapping):
    """A call's inputs as one mapping (every backend reads it as one) that also says which part is fixed: ``fixed``,
    a read-only mapping the caller makes once per call shape (the fused target graph's 2 x layers cache views), and
    ``changing``, what the caller fills per call (the mask; the standard graph's past views), with no name in both.
    A backend that keeps its bindings may skip looking at ``fixed`` when it is the same object it bound last run
    (nothing can change it). Nothing is copied per call (a merged dict of 37 names was a visible part of a plain
    step's host work on the fixture)."""

    __slots__ = ("fixed", "changing")

    def __init__(self, fixed: Mapping, changing: dict):
        self.fixed, self.changing = fixed, changing

    def __getitem__(self, name: str):
        return self.changing[name] if name in self.changing else self.fixed[name]

    def __iter__(self):
        yield from self.fixed
        yield from self.changing

    def __len__(self) -> int:
        return len(self.fixed) + len(self.changing)


def tensor_address(t: torch.Tensor) -> int:
    """Where the tensor's data starts. torch reports 0 for an empty tensor (e.g. the cache prefix before the
    first prefill, past_len 0); a backend wants a non-null address for every tensor, so an empty view gets the
    address it would start at (the buffer's own, aligned base for a cache prefix)."""
    if t.numel() == 0:
        return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return t.data_ptr()


def view_of(x: torch.Tensor | np.ndarray | BufferView) -> BufferView:
    """The BufferView of a contiguous tensor or array (a BufferView is returned as it is)."""
    if type(x) is BufferView:
        return x
    if isinstance(x, torch.Tensor):
        if not x.is_contiguous():
            raise ValueError("bound tensors must be contiguous")
        dev = x.device
        return BufferView(tensor_address(x), BY_TORCH[x.dtype].name, tuple(x.shape), dev.type, dev.index or 0)
    if not x.flags.c_contiguous:
        raise ValueError("bound arrays must be contiguous")
    return BufferView(x.ctypes.data, x.dtype.name, x.shape, "cpu", 0)


def host_array(v: BufferView) -> np.ndarray:
    """A numpy array over the host memory a view describes (no copy). Not for bfloat16 (numpy has no such type)."""
    if v.device != "cpu":
        raise ValueError(f"a {v.device} view is not host memory")
    typ = DTYPES[v.dtype].numpy
    if typ is None:
        raise ValueError(f"numpy has no {v.dtype} type")
    n = math.prod(v.shape)
    if n == 0:
        return np.zeros(v.shape, dtype=typ)
    raw = (ctypes.c_char * (n * np.dtype(typ).itemsize)).from_address(v.address)
    return np.frombuffer(raw, dtype=typ).reshape(v.shape)


class RowBuffers:
    """Same-shaped preallocated tensors [1, rows, *tail]; row ranges as torch views or as BufferViews."""

    def __init__(self, buffers: list[torch.Tensor]):
        if not buffers:
            raise ValueError("RowBuffers needs at least one buffer")
        first = buffers[0]
        for b in buffers:
            if b.shape != first.shape or b.dtype != first.dtype or b.device != first.device or not b.is_contiguous():
                raise ValueError("RowBuffers holds contiguous buffers of one shape, dtype and device")
            if b.shape[0] != 1:
                raise ValueError("RowBuffers holds batch-1 buffers [1, rows, ...]")
        self.buffers = buffers
        self.rows = first.shape[1]
        self._tail = tuple(first.shape[2:])
        self._row_bytes = first[0, :1].numel() * first.element_size()
        # The address of a buffer's row 0 (even when the buffer has no rows); it never moves.
        self._addresses = [tensor_address(b) for b in buffers]
        dev = first.device
        self._type, self._dev, self._idx = BY_TORCH[first.dtype].name, dev.type, dev.index or 0
        self._heads: dict[int, list[BufferView]] = {}

    def check(self, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > self.rows:
            raise IndexError(f"rows [{start}, {start + count}) outside {self.rows} rows")

    def tensors(self, start: int, count: int) -> list[torch.Tensor]:
        """Contiguous torch views of rows [start, start + count) of every buffer (no copy)."""
        self.check(start, count)
        return [b[:, start:start + count] for b in self.buffers]

    def views(self, start: int, count: int) -> list[BufferView]:
        """The same rows as BufferViews, by address arithmetic."""
        self.check(start, count)
        off, shape, t, d, i = start * self._row_bytes, (1, count, *self._tail), self._type, self._dev, self._idx
        return [_new_view(BufferView, (a + off, t, shape, d, i)) for a in self._addresses]

    def block(self, start: int, slots: int, count: int) -> list[BufferView]:
        """Rows [start, start + slots * count) of every buffer viewed as [slots, count, *tail] (a batched call's
        rows, slot b at rows start + b * count ...), by address arithmetic."""
        self.check(start, slots * count)
        off, shape, t, d, i = start * self._row_bytes, (slots, count, *self._tail), self._type, self._dev, self._idx
        return [_new_view(BufferView, (a + off, t, shape, d, i)) for a in self._addresses]

    def head(self, count: int) -> list[BufferView]:
        """``views(0, count)``, made once per count (the loop binds the same leading rows call after call)."""
        got = self._heads.get(count)
        if got is None:
            got = self._heads[count] = self.views(0, count)
        return got


class HostScratch:
    """One flat host array reused for a graph input whose shape changes between calls (ids, positions, masks)."""

    def __init__(self, size: int, dtype: type):
        self.array = np.zeros(size, dtype=dtype)
        self._address = self.array.ctypes.data
        self._type = self.array.dtype.name

    def _size(self, shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        if n > self.array.size:
            raise IndexError(f"shape {shape} needs {n} elements, the scratch holds {self.array.size}")
        return n

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """The first prod(shape) elements as an array of that shape (a view: fill it, then bind it)."""
        return self.array[:self._size(shape)].reshape(shape)

    def view(self, shape: tuple[int, ...]) -> BufferView:
        """The BufferView of ``take(shape)`` (same memory)."""
        self._size(shape)
        return _new_view(BufferView, (self._address, self._type, shape, "cpu", 0))

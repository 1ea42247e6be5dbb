"""Preallocated K/V buffers: allocated once per runtime session, bound in place, committed row by row.

Layout per layer and per K/V: [batch, capacity, kv_heads, head_dim] (the contract's BSHD). With
batch 1 the rows [0, n) are one contiguous block, so a graph reads the valid prefix in place and
writes its new rows straight into [n, n + T): no step copies or allocates cache-sized memory.
"""

from __future__ import annotations

import numpy as np
import torch

from .views import BufferView, RowBuffers


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: str = "cpu", batch: int = 1):
        if batch != 1:
            raise ValueError("the runtime decodes one sequence per session (batch 1)")
        self.capacity = capacity
        self.num_layers = num_layers
        shape = (batch, capacity, kv_heads, head_dim)
        # Flat order [k0, v0, k1, v1, ...], as in the contract.
        self.buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)
        ]
        self._rows = RowBuffers(self.buffers)

    def rows(self, start: int, count: int) -> list[torch.Tensor]:
        """Contiguous views of rows [start, start + count) of every buffer (no copy)."""
        return self._rows.tensors(start, count)

    def views(self, start: int, count: int) -> list[BufferView]:
        """The same rows as BufferViews (address arithmetic, no tensor made): for backends that bind by address."""
        return self._rows.views(start, count)

    def commit(self, start: int, src_offsets: np.ndarray) -> None:
        """Move rows start + src_offsets[i] to start + i (the accepted path), in every buffer.

        src_offsets is ascending with src_offsets[i] >= i; rows already in place are skipped,
        so a path that is a prefix of the tree order moves nothing.
        """
        src_offsets = np.asarray(src_offsets, dtype=np.int64)
        n = len(src_offsets)
        moved = np.nonzero(src_offsets != np.arange(n))[0]
        if len(moved) == 0:
            return
        self._rows.check(start, int(src_offsets.max()) + 1)
        first = int(moved[0])
        src = torch.from_numpy(src_offsets[first:] + start).to(self.buffers[0].device)
        for b in self.buffers:
            b[:, start + first:start + n] = b.index_select(1, src)

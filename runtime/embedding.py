"""The draft's input embeddings, gathered on the host from the artifact's one copy of the table.

Contract version 3: the draft step graph takes its tokens' embedding rows (``input_embeds``), not their ids, so
the table is not copied into the draft graph (nor into a draft engine). It is the target's embedding, in the
target graph's data file, or a head's own table in a file of its own; the manifest's ``draft_embedding`` says
where. ``TokenEmbedding`` maps that region read-only: opening costs no memory, and each token looked up pulls in
only the pages around its row, pages the target's own session maps from the same file anyway. (The kernel maps
a whole page-cache folio per fault, about 1.5 MB on this project's machine, so the process's RSS grows by that
per distinct token until the table is mapped; the pages are the page cache's, counted once by the cgroup.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from eagle_export.dtypes import DTYPES
from eagle_export.errors import ManifestError
from eagle_export.manifest import Manifest, TableRef


class TokenEmbedding:
    """Rows of one embedding table, looked up by token id (``gather``) into a buffer the caller owns."""

    def __init__(self, directory: str | Path, ref: TableRef):
        self.ref = ref
        path = Path(directory) / ref.file
        dt = DTYPES[ref.dtype]
        storage = np.uint16 if dt.numpy is None else dt.numpy  # bfloat16: its bits, viewed as bfloat16 by torch
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ManifestError(f"{path}: the draft's embedding table is missing ({e}): re-export") from None
        if ref.offset + ref.nbytes > size:
            raise ManifestError(f"{path} holds {size} bytes, too few for the draft's embedding table "
                                f"({ref.nbytes} bytes at offset {ref.offset}; truncated?): re-export")
        if ref.offset % dt.itemsize:  # an unaligned table (small graphs' data files): read a copy
            raw = np.fromfile(path, dtype=np.uint8, count=ref.nbytes, offset=ref.offset).view(storage)
            table = raw.reshape(ref.shape)
        else:
            # Copy-on-write: a writable array (torch wants one) whose pages stay the file's; nothing writes them.
            table = np.memmap(path, dtype=storage, mode="c", offset=ref.offset, shape=ref.shape)
        t = torch.from_numpy(table)
        self.table = t.view(torch.bfloat16) if dt.numpy is None else t
        self.vocab_size, self.hidden_size = ref.vocab_size, ref.hidden_size
        self.dtype = self.table.dtype
        # A plain ndarray view of the table for ``gather`` (bfloat16 has none). Not the np.memmap itself: numpy's
        # subclass machinery made each lookup about 6x slower.
        self._np = None if dt.numpy is None else self.table.numpy()

    @classmethod
    def open(cls, directory: str | Path, manifest: Manifest) -> TokenEmbedding:
        return cls(directory, manifest.draft_embedding)

    def gather(self, ids: np.ndarray, out: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """out[i] = row ids[i] of the table. ids: int64 token ids (any shape, flattened); out: [len(ids), H] on
        any device (a device buffer is filled from a host gather), or a host array.

        The decode loop passes a numpy view of its host buffer: between ONNX Runtime calls a torch call is slow (its
        dispatch runs with cold caches: slicing the buffer and index_select took 75-100 us for a few rows, numpy's
        take 12 us; docs/runtime.md, "Where a round's time goes")."""
        idx = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if isinstance(out, np.ndarray):
            if self._np is None:
                raise TypeError("a bfloat16 table is gathered into torch tensors only")
            np.take(self._np, idx, axis=0, out=out)
            return out
        if out.device.type == "cpu":
            return torch.index_select(self.table, 0, torch.from_numpy(idx), out=out)
        return out.copy_(self.table.index_select(0, torch.from_numpy(idx)))

    def rows(self, ids) -> torch.Tensor:
        """A new [..., H] tensor of the rows of ``ids`` (tests, validate, tools)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = torch.empty((ids.size, self.hidden_size), dtype=self.dtype)
        return self.gather(ids, out).reshape(*ids.shape, self.hidden_size)

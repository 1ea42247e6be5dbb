"""Reading and writing ONNX external-data files with plain file reads into one reused buffer.

Why not memory maps: a mapped file's pages count in the process's resident set while the map is open (ru_maxrss
included), so hashing or copying a 6 GB data file through a map made a 3B export peak near 7 GiB resident; read()
into a reused buffer goes through the page cache, which the kernel reclaims and the resident set does not count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from onnx import TensorProto, helper, numpy_helper

# How the exporter aligns each tensor in a data file (the lean export, the quantizing pass, share_weights alike):
# large tensors start at a multiple of ALIGN_LARGE, so ONNX Runtime can map them straight from the file (it maps
# external data whose offset is aligned to the allocation granularity) instead of reading a copy.
ALIGN_LARGE = 64 * 1024
ALIGN_LARGE_FROM = 1 << 20  # bytes; smaller tensors are aligned to ALIGN_SMALL only (tiny graphs stay tiny)
ALIGN_SMALL = 64
CHUNK_BYTES = 16 << 20  # bytes read at a time when copying or hashing a stored tensor


def external(t: TensorProto) -> dict[str, str] | None:
    """The external-data entries (location, offset, length) of ``t``, or None when its data is inline."""
    if t.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in t.external_data}


def set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    """Point ``t`` at ``length`` bytes at ``offset`` of ``location`` (its inline data cleared)."""
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


class Files:
    """Open data files of one directory, by name, read with positioned reads; one reused chunk buffer."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._open: dict[str, BinaryIO] = {}
        self._buf = bytearray(CHUNK_BYTES)

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def file(self, location: str) -> BinaryIO:
        if location not in self._open:
            self._open[location] = open(self.directory / location, "rb")
        return self._open[location]

    def chunks(self, location: str, offset: int, length: int) -> Iterator[memoryview]:
        """The bytes [offset, offset + length) of ``location``, CHUNK_BYTES at a time, each a view of the reused
        buffer (valid until the next chunk)."""
        f = self.file(location)
        f.seek(offset)
        view = memoryview(self._buf)
        left = length
        while left:
            n = f.readinto(view[:min(left, CHUNK_BYTES)])
            if not n:
                raise EOFError(f"{location}: {left} of {length} bytes at offset {offset} are past the file's end")
            left -= n
            yield view[:n]

    def read(self, location: str, offset: int, length: int) -> bytearray:
        """The bytes as a new bytearray of their own (one tensor's: the caller holds it)."""
        out = bytearray(length)
        f = self.file(location)
        f.seek(offset)
        if f.readinto(out) != length:
            raise EOFError(f"{location}: {length} bytes at offset {offset} are past the file's end")
        return out

    def array(self, t: TensorProto) -> np.ndarray:
        """An external float/int initializer's values (a copy of its own), read without a memory map."""
        ext = external(t)
        if ext is None:
            return numpy_helper.to_array(t)
        raw = self.read(ext["location"], int(ext.get("offset", 0)), int(ext["length"]))
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.frombuffer(raw, dtype=dtype).reshape(tuple(t.dims))


class DataWriter:
    """An external-data file written front to back; each tensor aligned as the exporter aligns them."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "wb")
        self.offset = 0

    def __enter__(self) -> DataWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def _start(self, length: int) -> int:
        align = ALIGN_LARGE if length >= ALIGN_LARGE_FROM else ALIGN_SMALL
        pad = -self.offset % align
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        return self.offset

    def write(self, data) -> int:
        """Append ``data`` (bytes-like); returns its offset."""
        n = memoryview(data).nbytes
        at = self._start(n)
        self._f.write(data)
        self.offset += n
        return at

    def copy(self, files: Files, location: str, offset: int, length: int) -> int:
        """Append ``length`` bytes of ``location`` from ``offset``, a chunk at a time; returns their new offset."""
        at = self._start(length)
        for chunk in files.chunks(location, offset, length):
            self._f.write(chunk)
        self.offset += length
        return at

    def store(self, t: TensorProto, location: str) -> None:
        """Move ``t``'s inline raw data to this file (``location``: the name the graph refers to it by)."""
        n = len(t.raw_data)
        set_external(t, location, self.write(t.raw_data), n)

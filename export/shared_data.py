"""Two graphs of one artifact that hold the same weights store them once: the fused target graph's initializers
that are byte-for-byte the standard graph's point into the standard graph's data file.

Both target graphs are traced from the same weights (``export/fused.py`` reuses the model's own ``nn.Linear``s and
embedding), so every matrix is stored identically by both; only the fused graph's own tensors (its rotary caches,
anything laid out differently) stay in its data file. Matching is by content (length, then a hash of the bytes), so
it holds whichever path wrote the graphs (torch.onnx's constant folding or the lean path's streaming).
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import onnx

from .weights import ALIGN_LARGE, ALIGN_LARGE_FROM, ALIGN_SMALL


def _external(init: onnx.TensorProto) -> dict[str, str] | None:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in init.external_data}


def _set_external(init: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del init.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = init.external_data.add()
        e.key, e.value = k, v


def _index(graph: onnx.ModelProto, directory: Path) -> dict[tuple[int, bytes], tuple[str, int]]:
    """(length, digest) -> (file, offset) of every external initializer of ``graph``."""
    out: dict[tuple[int, bytes], tuple[str, int]] = {}
    maps: dict[str, mmap.mmap] = {}
    try:
        for init in graph.graph.initializer:
            ext = _external(init)
            if ext is None or int(ext.get("length", 0)) == 0:
                continue
            loc, off, n = ext["location"], int(ext.get("offset", 0)), int(ext["length"])
            if loc not in maps:
                with open(directory / loc, "rb") as f:
                    maps[loc] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            out.setdefault((n, hashlib.blake2b(maps[loc][off:off + n], digest_size=16).digest()), (loc, off))
    finally:
        for m in maps.values():
            m.close()
    return out


def share_weights(graph_path: Path, other_graph: Path) -> int:
    """Point every external initializer of ``graph_path`` whose bytes equal one of ``other_graph``'s at that one;
    rewrite ``graph_path``'s own data file with the rest. Both graphs lie in the same directory. Returns the bytes
    the graph's own data file keeps."""
    directory = graph_path.parent
    model = onnx.load(str(graph_path), load_external_data=False)
    known = _index(onnx.load(str(other_graph), load_external_data=False), directory)
    own = graph_path.name + ".data"
    src_path = directory / own
    tmp = directory / (own + ".tmp")
    offset = 0
    with open(src_path, "rb") as fsrc, open(tmp, "wb") as fdst:
        src = mmap.mmap(fsrc.fileno(), 0, access=mmap.ACCESS_READ) if src_path.stat().st_size else None
        try:
            for init in model.graph.initializer:
                ext = _external(init)
                if ext is None:
                    continue
                if ext["location"] != own:
                    continue  # already elsewhere
                off, n = int(ext.get("offset", 0)), int(ext["length"])
                data = src[off:off + n] if n else b""
                hit = known.get((n, hashlib.blake2b(data, digest_size=16).digest())) if n else None
                if hit is not None:
                    _set_external(init, hit[0], hit[1], n)
                    continue
                align = ALIGN_LARGE if n >= ALIGN_LARGE_FROM else ALIGN_SMALL
                pad = -offset % align
                fdst.write(b"\0" * pad)
                offset += pad
                fdst.write(data)
                _set_external(init, own, offset, n)
                offset += n
        finally:
            if src is not None:
                src.close()
    if offset:
        tmp.replace(src_path)
    else:  # everything is shared: no data file of its own
        tmp.unlink()
        src_path.unlink()
    onnx.save_model(model, str(graph_path))
    return offset

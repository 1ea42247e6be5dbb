"""Two graphs of one artifact that hold the same weights store them once: the fused target graph's initializers
that are byte-for-byte the standard graph's point into the standard graph's data file.

Both target graphs are traced from the same weights (``export/graphs/fused.py`` reuses the model's own ``nn.Linear``s
and embedding), so every matrix is stored identically by both; only the fused graph's own tensors (its rotary caches,
anything laid out differently) stay in its data file. Matching is by content (length, then a hash of the bytes), so
it holds whichever path wrote the graphs (torch.onnx's constant folding or the lean path's streaming).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

from eagle_export.export.data.datafile import DataWriter, Files, external, set_external


def _digest(files: Files, location: str, offset: int, length: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for chunk in files.chunks(location, offset, length):
        h.update(chunk)
    return h.digest()


def _index(graph: onnx.ModelProto, files: Files) -> dict[tuple[int, bytes], tuple[str, int]]:
    """(length, digest) -> (file, offset) of every external initializer of ``graph``."""
    out: dict[tuple[int, bytes], tuple[str, int]] = {}
    for init in graph.graph.initializer:
        ext = external(init)
        if ext is None or int(ext.get("length", 0)) == 0:
            continue
        loc, off, n = ext["location"], int(ext.get("offset", 0)), int(ext["length"])
        out.setdefault((n, _digest(files, loc, off, n)), (loc, off))
    return out


def share_weights(graph_path: Path, other_graph: Path) -> int:
    """Point every external initializer of ``graph_path`` whose bytes equal one of ``other_graph``'s at that one;
    rewrite ``graph_path``'s own data file with the rest. Both graphs lie in the same directory. Returns the bytes
    the graph's own data file keeps. Files are read a chunk at a time (export/data/datafile.py: no memory maps)."""
    directory = graph_path.parent
    model = onnx.load(str(graph_path), load_external_data=False)
    own = graph_path.name + ".data"
    src_path = directory / own
    tmp = directory / (own + ".tmp")
    with Files(directory) as files, DataWriter(tmp) as out:
        known = _index(onnx.load(str(other_graph), load_external_data=False), files)
        for init in model.graph.initializer:
            ext = external(init)
            if ext is None or ext["location"] != own:
                continue  # inline, or already elsewhere
            off, n = int(ext.get("offset", 0)), int(ext["length"])
            hit = known.get((n, _digest(files, own, off, n))) if n else None
            if hit is not None:
                set_external(init, hit[0], hit[1], n)
                continue
            set_external(init, own, out.copy(files, own, off, n), n)
        offset = out.offset
    if offset:
        tmp.replace(src_path)
    else:  # everything is shared: no data file of its own
        tmp.unlink()
        src_path.unlink()
    onnx.save_model(model, str(graph_path))
    return offset

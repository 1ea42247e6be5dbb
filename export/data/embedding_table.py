"""Where the draft's token-embedding table lies in an artifact (contract version 3).

The draft step graph takes its tokens' embedding rows as an input, so the table is stored once: the target's
embedding, found here in the target graph's data file (the ``Gather`` that reads ``input_ids``), or, when the
head brings its own table and it differs from the target's, a file of its own written here. The manifest records
the answer (``TableRef``) and the runtime maps it (``runtime/embedding.py``).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

from eagle_export import contract as C
from eagle_export.dtypes import dtype_name
from eagle_export.errors import EagleExportError
from eagle_export.manifest import TableRef

#: The file a head's own (different) embedding table is written to, beside the graphs.
OWN_TABLE_FILE = "draft_embed_tokens.bin"

_ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                onnx.TensorProto.BFLOAT16: "bfloat16"}


def locate_target_embedding(graph_path: Path) -> TableRef:
    """The table of the target graph's one ``Gather`` over ``input_ids``: its data file, offset, shape and type.

    The graph is read without its data. Raises EagleExportError when the table is not one external initializer
    (a graph this exporter did not write)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    gathers = [n for n in model.graph.node
               if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == C.INPUT_IDS and n.input[0] in inits]
    if len(gathers) != 1:
        raise EagleExportError(f"{graph_path.name}: expected one Gather of an initializer over {C.INPUT_IDS}, found "
                               f"{len(gathers)}: cannot locate the target's embedding table")
    node = gathers[0]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    table = inits[node.input[0]]
    where = {e.key: e.value for e in table.external_data}
    if table.data_location != onnx.TensorProto.EXTERNAL or "location" not in where or len(table.dims) != 2 \
            or axis != 0 or table.data_type not in _ONNX_DTYPES:
        raise EagleExportError(f"{graph_path.name}: the embedding table {table.name!r} is not a row-major 2-D float "
                               "initializer in the graph's data file")
    vocab, hidden = table.dims
    ref = TableRef(file=where["location"], offset=int(where.get("offset", 0)), vocab_size=int(vocab),
                   hidden_size=int(hidden), dtype=_ONNX_DTYPES[table.data_type], shared=True)
    length = int(where.get("length", ref.nbytes))
    if length != ref.nbytes:
        raise EagleExportError(f"{graph_path.name}: the embedding table {table.name!r} holds {length} bytes, "
                               f"expected {ref.nbytes}")
    return ref


def write_own_table(directory: Path, weight: torch.Tensor) -> TableRef:
    """Write a head's own embedding table [V, H] (at its dtype) as raw bytes; the TableRef that points at it."""
    w = weight.detach().contiguous()
    path = Path(directory) / OWN_TABLE_FILE
    with open(path, "wb") as f:
        f.write(memoryview(w.view(torch.uint8).numpy()))
    return TableRef(file=OWN_TABLE_FILE, offset=0, vocab_size=int(w.shape[0]), hidden_size=int(w.shape[1]),
                    dtype=dtype_name(w.dtype), shared=False)

"""Every element type the project names, in one table.

The contract, the manifest and the bound-memory views name a dtype by its numpy-style name ("float32",
"bfloat16", ...); this table gives, for each, the torch dtype, the numpy type (None for bfloat16, which numpy
lacks), the bytes per element, ONNX Runtime's type string (None where its CPU provider has no kernels) and the
TensorRT ``DataType`` member name. ``--dtype`` on the command line uses the short names of ``EXPORT_DTYPES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    name: str  # the contract's name
    torch: torch.dtype
    numpy: type | None  # None: numpy has no such type (bfloat16)
    itemsize: int
    ort: str | None  # ONNX Runtime's NodeArg.type
    trt: str  # TensorRT DataType member


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", torch.float32, np.float32, 4, "tensor(float)", "FLOAT"),
    DType("float16", torch.float16, np.float16, 2, "tensor(float16)", "HALF"),
    DType("bfloat16", torch.bfloat16, None, 2, "tensor(bfloat16)", "BF16"),
    DType("int64", torch.int64, np.int64, 8, "tensor(int64)", "INT64"),
    DType("int32", torch.int32, np.int32, 4, "tensor(int32)", "INT32"),
    DType("bool", torch.bool, np.bool_, 1, "tensor(bool)", "BOOL"),
    DType("int8", torch.int8, np.int8, 1, "tensor(int8)", "INT8"),
    DType("uint8", torch.uint8, np.uint8, 1, "tensor(uint8)", "UINT8"),
)}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in DTYPES.values()}
BY_TRT: dict[str, DType] = {d.trt: d for d in DTYPES.values()}
#: ``--dtype`` values -> the contract's name of the graphs' floating-point type.
EXPORT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: Graph dtypes ONNX Runtime's CPU provider runs (it has no bfloat16 MatMul kernels).
ORT_GRAPH_DTYPES = ("float32", "float16")


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name].torch


def dtype_name(dtype: torch.dtype) -> str:
    return BY_TORCH[dtype].name

"""eagle_export/dtypes.py is the one dtype table: its entries agree with torch and numpy, and the places that spell
dtypes (the CLI's --dtype, the exporter, the engine builder) follow it."""

from __future__ import annotations

import numpy as np
import torch

from eagle_export.cli import export_cmd
from eagle_export.dtypes import BY_TORCH, BY_TRT, DTYPES, EXPORT_DTYPES, dtype_name, torch_dtype
from eagle_export.engines.builder import dtype_name as trt_dtype_name


def test_entries_agree_with_torch_and_numpy():
    for name, d in DTYPES.items():
        assert torch.empty((), dtype=d.torch).element_size() == d.itemsize, name
        if d.numpy is not None:
            assert np.dtype(d.numpy).itemsize == d.itemsize and np.dtype(d.numpy).name == name
        assert torch_dtype(name) is d.torch and dtype_name(d.torch) == name
    assert DTYPES["bfloat16"].numpy is None and BY_TORCH[torch.bfloat16].name == "bfloat16"


def test_the_cli_and_the_builder_follow_the_table():
    choices = next(p for p in export_cmd.params if p.name == "dtype").type.choices
    assert list(choices) == list(EXPORT_DTYPES)
    for member, d in BY_TRT.items():
        assert trt_dtype_name(type("DataType", (), {"name": member})()) == d.name

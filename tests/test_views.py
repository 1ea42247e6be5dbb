"""BufferViews made by address arithmetic are exactly what binding the equivalent torch/numpy views would give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_export.dtypes import dtype_name
from eagle_export.runtime.kv_cache import KVCache
from eagle_export.runtime.ort_backend import OrtGraph
from eagle_export.runtime.views import BufferView, HostScratch, RowBuffers, view_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]  # every dtype the loop binds


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_views_equal_the_torch_views(dtype):
    rb = RowBuffers([torch.zeros(1, 12, 3, 5, dtype=dtype) for _ in range(4)])
    for start, count in ((0, 0), (0, 12), (3, 4), (12, 0), (7, 5)):
        views = rb.views(start, count)
        tensors = rb.tensors(start, count)
        assert len(views) == 4
        for v, t in zip(views, tensors, strict=True):
            assert v.shape == tuple(t.shape) == (1, count, 3, 5)
            if count:  # torch reports address 0 for an empty view; the arithmetic keeps the row's address
                assert v == view_of(t)
            assert v.address == rb.buffers[views.index(v)].data_ptr() + start * 15 * t.element_size()
    for start, count in ((-1, 2), (10, 3), (0, 13)):
        with pytest.raises(IndexError):
            rb.views(start, count)
        with pytest.raises(IndexError):
            rb.tensors(start, count)


def test_row_buffers_refuse_mixed_or_batched_buffers():
    with pytest.raises(ValueError, match="one shape"):
        RowBuffers([torch.zeros(1, 4, 2), torch.zeros(1, 5, 2)])
    with pytest.raises(ValueError, match="batch-1"):
        RowBuffers([torch.zeros(2, 4, 2)])
    with pytest.raises(ValueError, match="contiguous"):
        RowBuffers([torch.zeros(1, 4, 2).transpose(1, 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # the graphs' float dtypes
def test_kv_cache_views_and_rows_agree(dtype):
    cache = KVCache(num_layers=2, kv_heads=2, head_dim=4, capacity=10, dtype=dtype, new_rows=6)
    assert [view_of(t) for t in cache.rows(2, 3)] == cache.views(2, 3)
    assert [view_of(t) for t in cache.new_rows(4)] == cache.new_views(4)
    v = cache.views(2, 3)[1]
    assert v.dtype == dtype_name(dtype) and v.nbytes == 3 * 2 * 4 * cache.buffers[1].element_size()


@pytest.mark.parametrize("np_dtype", [np.int64, np.bool_])  # ids/positions, masks
def test_host_scratch_views_for_every_host_dtype(np_dtype):
    s = HostScratch(12, np_dtype)
    a = s.take((3, 4))
    assert a.dtype == np_dtype and s.view((3, 4)) == view_of(a) and s.view((3, 4)).dtype == np.dtype(np_dtype).name


def test_host_scratch_view_is_the_taken_array():
    s = HostScratch(24, np.int64)
    a = s.take((1, 2, 3))
    a[:] = np.arange(6).reshape(1, 2, 3)
    assert s.view((1, 2, 3)) == view_of(a)
    assert s.take((6,)).tolist() == list(range(6))  # the same memory, any shape
    with pytest.raises(IndexError):
        s.take((5, 5))
    with pytest.raises(IndexError):
        s.view((25,))


def test_view_of():
    v = BufferView(1234, "float32", (1, 2), "cpu", 0)
    assert view_of(v) is v
    t = torch.zeros(2, 3)
    assert view_of(t) == (t.data_ptr(), "float32", (2, 3), "cpu", 0)
    with pytest.raises(ValueError, match="contiguous"):
        view_of(t.t())
    with pytest.raises(ValueError, match="contiguous"):
        view_of(np.zeros((3, 3))[:, ::2])


def test_ort_graph_runs_on_buffer_views(tmp_path):
    """z = x + y bound through BufferViews of scratch memory: the graph reads and writes that memory."""
    import onnx
    from onnx import TensorProto, helper

    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "xyz")
    model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add", [x, y], [z]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(tmp_path / "add.onnx"))
    g = OrtGraph(tmp_path / "add.onnx", ["CPUExecutionProvider"], threads=1)
    xs, ys = HostScratch(8, np.float32), HostScratch(8, np.float32)
    out = RowBuffers([torch.zeros(1, 8)])
    xs.take((8,))[:] = np.arange(8)
    ys.take((8,))[:] = 10
    # z is [n]; a [1, count] row view holds the same bytes, so bind it with the graph's shape.
    zv = out.views(0, 1)[0]._replace(shape=(8,))
    g.run({"x": xs.view((8,)), "y": ys.view((8,))}, {"z": zv})
    assert out.buffers[0][0].tolist() == [10 + i for i in range(8)]
    xs.take((3,))[:] = -1
    g.run({"x": xs.view((3,)), "y": ys.view((3,))}, {"z": zv._replace(shape=(3,))})
    assert out.buffers[0][0].tolist() == [9, 9, 9, 13, 14, 15, 16, 17]


def test_row_runs_splits_rows_into_consecutive_runs():
    """The copies of accepted paths and gathered rows go run by run: (i, j, first) per run of consecutive rows
    (planted: a run ending one row late merges 5 and 9, one ending early splits a chain)."""
    from eagle_export.runtime.views import row_runs

    assert row_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 5, 9), (5, 6, 2)]
    assert row_runs([7]) == [(0, 1, 7)] and row_runs([]) == []

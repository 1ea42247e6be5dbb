"""The TensorRT backend's stream ordering, on the emulator's lazy streams (tools/testing/trt_emulator.py): work
queued on a stream other than the default runs only when something forces it, a wait edge orders work without
running it, and a read of bytes whose queued write has not run sees poison. Each test makes one call pattern that a
real GPU may run in the wrong order if the backend leaves out an edge, and checks the values against the same calls
made one at a time (so a missing edge fails here every time, not by chance):

- ``test_calls_follow_the_callers_stream_work``: the backend's stream waits for the caller's (``wait_stream``);
- ``test_back_to_back_calls_reuse_the_pinned_buffers_safely``: the pinned staging buffers are refilled only after
  the copies that read them ran (the staging event);
- ``test_a_backend_opened_on_another_stream_waits_for_its_buffers``: opening orders the backend's stream after the
  zeroing of its buffers on the opener's stream;
- ``test_an_unaligned_device_input_is_staged``: an integer input at an unaligned device address goes through its
  staging buffer (TensorRT refuses the address otherwise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_export import contract as C
from eagle_export.dtypes import torch_dtype
from eagle_export.errors import EngineError
from eagle_export.manifest import load_manifest
from eagle_export.runtime.views import view_of
from eagle_export.tools.commands.gpu_check import graph_inputs
from eagle_export.tools.testing.trt_emulator import TrtEmulator


@pytest.fixture(scope="module")
def art(engines):
    return engines("fp32")


def backend(art, opener=None):
    emu = TrtEmulator(art, load_manifest(art))
    if opener is None:
        return emu.backend()
    side = emu.mem.stream()
    with emu.mem.on(side):
        return emu.backend()


def call_io(be, seed: int, new: int = 5, past: int = 3):
    """A target prefill-profile call: host ids/positions/mask/rows, device past_* (filled on the default stream,
    which runs at once) and outputs."""
    m = load_manifest(be.emulator.directory)
    x = graph_inputs(m, C.TARGET_GRAPH, new, past, 1, np.random.default_rng(seed))
    dt = torch_dtype(m.dtype)
    inputs = {}
    for t in m.graphs[C.TARGET_GRAPH].spec.inputs:
        a = x[t.name]
        if t.dtype in ("int64", "bool"):
            inputs[t.name] = np.ascontiguousarray(a.astype(t.dtype))
        else:
            buf = be.zeros(a.shape, dt)
            buf.copy_(torch.from_numpy(a).to(dt))
            inputs[t.name] = buf
    axes = {C.BATCH: 1, C.NEW_TOKENS: new, C.LOGIT_ROWS: 1}
    outputs = {t.name: be.zeros(tuple(axes[d] if isinstance(d, str) else d for d in t.shape), torch_dtype(t.dtype))
               for t in be.graphs[C.TARGET_GRAPH].spec.outputs}  # the engine's: the graph's and the acceptance
    return inputs, outputs


def one_at_a_time(art, seeds) -> list[np.ndarray]:
    be = backend(art)
    out = []
    for seed in seeds:
        inputs, outputs = call_io(be, seed)
        be.run(C.TARGET_GRAPH, inputs, outputs)
        out.append(be.to_host(outputs[C.LOGITS]))
    return out


def test_back_to_back_calls_reuse_the_pinned_buffers_safely(art):
    """Two calls queued on a side stream with no host read between: the second refills the pinned buffers the
    first call's copies read when they run. Planted: the wait on the staging event dropped -> the first call
    computes with the second call's ids."""
    want = one_at_a_time(art, (1, 2))
    be = backend(art)
    ios = [call_io(be, seed) for seed in (1, 2)]
    side = be.mem.stream()
    with be.mem.on(side):
        for inputs, outputs in ios:
            be.run(C.TARGET_GRAPH, inputs, outputs)
        got = [be.to_host(outputs[C.LOGITS]) for _, outputs in ios]
    assert not be.mem.poisoned_reads
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_calls_follow_the_callers_stream_work(art):
    """The caller queues a copy of the cache rows on its own stream, then calls: the call must read those rows.
    Planted: ``self.stream.wait_stream(caller)`` dropped -> the call runs before the copy and reads poison."""
    (want,) = one_at_a_time(art, (3,))
    be = backend(art)
    inputs, outputs = call_io(be, 3)
    side = be.mem.stream()
    # The caller's own work on its stream: the past_key.0 rows arrive by a queued copy from host memory.
    past = inputs["past_key.0"]
    host = torch.from_numpy(be.to_host(past).reshape(-1).view(np.uint8).copy())
    with be.mem.on(side):
        be.mem.copy(be.mem.bytes_at(view_of(past)), host)
        be.run(C.TARGET_GRAPH, inputs, outputs)
        got = be.to_host(outputs[C.LOGITS])
    assert not be.mem.poisoned_reads, be.mem.poisoned_reads[:2]
    np.testing.assert_array_equal(got, want)


def test_a_backend_opened_on_another_stream_waits_for_its_buffers(art):
    """Opened while another stream is current, called from the default one: its staging, scratch and context
    memory were zeroed on the opener's stream, which nothing else waits for. Planted: the open's wait on the
    opener's stream dropped -> the call reads the staging buffers before their zeroing ran (poison)."""
    (want,) = one_at_a_time(art, (4,))
    be = backend(art, opener="side")
    inputs, outputs = call_io(be, 4)
    be.run(C.TARGET_GRAPH, inputs, outputs)
    got = be.to_host(outputs[C.LOGITS])
    assert not be.mem.poisoned_reads, be.mem.poisoned_reads[:2]
    np.testing.assert_array_equal(got, want)


def test_an_unaligned_device_input_is_staged(art):
    """position_ids as a device tensor 64 bytes into its buffer: staged (copied into an aligned staging buffer on
    the backend's stream), same logits as the host array. Planted: the planner binds it where it is -> TensorRT
    refuses the address and the backend says so."""
    (want,) = one_at_a_time(art, (5,))
    be = backend(art)
    inputs, outputs = call_io(be, 5)
    pos = inputs[C.POSITION_IDS]
    buf = be.zeros((pos.size + 8,), torch.int64)
    buf[8:] = torch.from_numpy(pos.reshape(-1))
    inputs[C.POSITION_IDS] = buf[8:].view(pos.shape)
    assert view_of(inputs[C.POSITION_IDS]).address % 256 == 64
    be.run(C.TARGET_GRAPH, inputs, outputs)
    np.testing.assert_array_equal(be.to_host(outputs[C.LOGITS]), want)


def test_a_refused_profile_is_an_engine_error(art):
    """TensorRT's Python API raises when it refuses set_optimization_profile_async (it never returns False): the
    backend turns that into one line naming the profile and the engine."""
    emu = TrtEmulator(art, load_manifest(art))
    emu.refuse_profile = lambda graph, index: graph == C.DRAFT_GRAPH and index == 1
    with pytest.raises(EngineError, match=r"could not set profile 1 of .*draft_step\.engine on its execution "
                                          r"context: draft_step: profile 1 refused on stream"):
        emu.backend()


def test_the_engines_dtypes_are_checked_at_open(art, monkeypatch):
    """The backend asks the engine (get_tensor_dtype) what it takes: an engine whose past_key.0 is float16 where the
    manifest says float32 (another build's file) is refused by name."""
    emu = TrtEmulator(art, load_manifest(art))
    real = emu.onnx_dtypes
    monkeypatch.setattr(emu, "onnx_dtypes", lambda g: {**real(g), "past_key.0": "float16"})
    with pytest.raises(EngineError, match=r"target_verify\.engine: past_key\.0 is float16 in the engine, the manifest "
                                          r"says float32: rebuild it"):
        emu.backend()


def test_copies_from_the_host_wait_before_their_pinned_buffer_is_refilled(art):
    """``copy_from_host`` (the draft's embedding rows) goes through one pinned buffer without blocking the host: two
    copies queued on a side stream with no read between must each deliver their own bytes. Planted: the event wait
    before the refill dropped -> the first copy runs after the second refill and delivers the second's bytes."""
    be = backend(art)
    first, second = (np.arange(64, dtype=np.float32) + k for k in (0.0, 1000.0))
    a, b = be.zeros((64,), torch.float32), be.zeros((64,), torch.float32)
    side = be.mem.stream()
    with be.mem.on(side):
        be.copy_from_host(a, first)
        be.copy_from_host(b, second)
        got = be.to_host(a), be.to_host(b)
    assert not be.mem.poisoned_reads
    np.testing.assert_array_equal(got[0], first)
    np.testing.assert_array_equal(got[1], second)

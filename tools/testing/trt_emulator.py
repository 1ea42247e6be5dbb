"""TensorRT's execution, emulated on the CPU, so that CI runs the TensorRT backend end to end.

The project's machines have no GPU, and the one GPU within reach has no TensorRT, so ``TrtBackend`` is run
here above a stand-in for what it calls. ``emulated_backend(directory)`` builds a real ``TrtBackend`` (same
planning, binding, staging, profile choice and contexts) with its two seams swapped:

- ``lib``: a stand-in for the ``tensorrt``/``tensorrt_rtx`` module. Its ``Runtime`` deserializes the engine
  files `eagle-export build` wrote (it recognises them by content) into ``EmulatedEngine``s, whose
  ``EmulatedContext`` plays ``IExecutionContext``: it enforces the rules TensorRT documents for a call (listed
  in ``RULES``) and then runs the engine's *source ONNX graph* with ONNX Runtime (CPU provider) over exactly
  the memory the backend bound. bf16 graphs are computed in fp32, converting at the bound memory.
- ``mem``: ``EmulatedMemory`` in place of ``CudaMemory``: "device memory" is 256-byte aligned host memory
  allocated through it (and only that counts as device memory). Work queued on a stream (a memset of a new
  buffer, a copy made through ``mem.copy``, an engine call, an event record, a wait edge) runs as late as CUDA
  allows: when a stream or event synchronize, a host read (``to_host``) or a wait edge onto the default stream
  forces it, other streams' awaited work first. Pinned host memory is read when its copy runs; a read of bytes
  whose queued write has not run sees poison (0xFF: NaN, -1). The default stream (the host-side caller's) runs
  its work at once: the caller touches emulated device memory in ways the emulator cannot see.

A broken rule raises ``RuleViolation`` (an ``AssertionError``: nothing in the product catches it) whose
message starts with ``TensorRT rule broken (<rule>)``. Where real TensorRT reports an error by return
value (a shape outside the profile: ``set_input_shape`` returns False and logs; a misaligned address:
``set_tensor_address`` returns False), the emulator does the same and logs the rule's message.

The operators ``build`` appends to the engines' sources (engines/round_ops.py) run here with the order of equal
values ONNX does not promise on TensorRT: TensorRT's ``ITopKLayer`` (which an ``ArgMax`` also becomes) documents no
order for them, so the emulator gives each appended ``TopK`` and ``ArgMax`` the higher index first
(``ties_the_other_way``), and code that rests on ONNX's lower-index-first order fails here. The row argmax over the
logits (``next_ids``, the greedy token) keeps ONNX's order, the host's: which of two exactly equal logits is "greedy"
is the model's numerics, as with fp16 rounding.

What the emulator cannot show: kernel numerics (it computes with ONNX Runtime's CPU kernels, bf16 in fp32),
timing, TensorRT-RTX's JIT compilation and runtime cache, true concurrency (it runs one adversarial order),
ordering bugs against the default stream (its work runs at once), torch ops of the caller on device memory (run
at host time), and what CUDA does on a fault (the emulator only raises at the next synchronisation).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import hashlib
import itertools
import math
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, numpy_helper

from eagle_export import contract as C
from eagle_export.contract import GraphSpec
from eagle_export.dtypes import DTYPES
from eagle_export.engines.builder import engine_source, engine_spec
from eagle_export.engines.libs import TrtLib
from eagle_export.engines.profiles import Profile
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.runtime.trt_backend import TRT_ADDRESS_ALIGNMENT, TrtBackend, profiles_of
from eagle_export.runtime.views import BufferView

RULES = {
    "shape-set": "every input shape is set (set_input_shape) before execute_async_v3",
    "profile": "input shapes lie inside the context's optimisation profile",
    "own-profile": "a context uses only its own optimisation profile, and no two contexts share one",
    "address-set": "every input and output has an address (set_tensor_address) before execute_async_v3",
    "alignment": f"tensor addresses are {TRT_ADDRESS_ALIGNMENT}-byte aligned",
    "empty": "empty tensors get non-null addresses distinct from every other tensor's",
    "device-memory": "every bound tensor lies inside device memory",
    "context-memory": "a context created with USER_MANAGED memory is given device memory large enough before it runs,"
                      " and it overlaps no bound tensor",
    "sync": "outputs are not read before the stream that computed them is synchronised",
    "dtype": "a tensor is bound to memory of the engine's dtype for it (get_tensor_dtype)",
    "runtime-config": "an IRuntimeConfig outlives the execution contexts created from it",
}


class RuleViolation(AssertionError):
    """A call broke one of TensorRT's documented rules (``RULES``)."""

    def __init__(self, rule: str, detail: str):
        self.rule = rule
        super().__init__(f"TensorRT rule broken ({rule}: {RULES[rule]}): {detail}")


# ---- device memory, streams, events ---------------------------------------------------------------------

POISON = 0xFF  # the byte a read sees where a write queued before it has not run: NaN, -1, True


class _Op:
    """Work queued on a stream: a copy, a memset, an engine call, or a marker (an event record, a wait edge). It runs
    when something forces it, after the work before it on its stream and the work it waits for (``deps``)."""

    def __init__(self, seq: int, stream: EmulatedStream, what: str, run=None, deps=(), writes=()):
        self.seq = seq  # host order: when it was queued
        self.stream = stream
        self.what = what  # for messages: "target_verify (profile 1)", "a copy"
        self.run = run
        self.deps = [d for d in deps if d is not None and not d.done]
        self.writes = list(writes)  # (start, end) byte ranges of device memory it writes
        self.done = False


class EmulatedMemory:
    """Stands in for ``CudaMemory``: 256-byte aligned host memory as device memory, and streams whose work runs as
    late as CUDA allows.

    Every queued op (copies, memsets of new buffers, engine calls, event records, wait edges) runs only when forced:
    a stream or event synchronize, a host read (``to_host``), or any work queued on the default stream (which runs
    at once, see ``enqueue``). Forcing an op first runs the work it waits for on other
    streams, then its own stream's earlier work: of the orders CUDA allows, the one that puts the forced stream's own
    pending work last, so a missing wait edge lets another stream run before the work it should have waited for.
    A read (an engine's input, a copy's source, a host read) of bytes that a write queued earlier has not yet written
    sees ``POISON`` bytes. Pinned host memory is read when its copy runs, not when the copy was queued.
    """

    device = "cpu"

    def __init__(self, compute_capability: tuple[int, int] = (8, 9)):
        self.compute_capability = tuple(compute_capability)
        self.gpu_name = f"emulated GPU, compute capability {compute_capability[0]}.{compute_capability[1]}"
        self._starts: list[int] = []
        self._blocks: list[tuple[int, int, torch.Tensor, torch.dtype]] = []  # (start, end, owner, dtype), by start
        self._handles = itertools.count(0x1000)
        self._seq = itertools.count()
        self.streams: dict[int, EmulatedStream] = {}
        self.default = self.stream()  # the caller's stream when no ``on`` is active
        self._on: EmulatedStream | None = None
        self.poisoned_reads: list[str] = []  # what read bytes of a write still queued (for messages and tests)
        self.host_reads = 0  # ``to_host`` calls: each waits for the device (tests count them per round)

    # allocation
    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """As ``torch.zeros`` on a device: the memory is poison until the memset queued on the current stream runs."""
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = torch.full((n + TRT_ADDRESS_ALIGNMENT,), POISON, dtype=torch.uint8)
        off = -raw.data_ptr() % TRT_ADDRESS_ALIGNMENT
        t = raw[off:off + n].view(dtype).view(shape)
        start = raw.data_ptr() + off
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._blocks.insert(i, (start, start + n, raw, dtype))
        if n:
            self.enqueue(self.current_stream(), "a memset of a new buffer", lambda op: ctypes.memset(start, 0, n),
                         writes=[(start, start + n)])
        return t

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def is_device(self, v: BufferView) -> bool:
        return self.block_of(v.address) is not None

    def block_of(self, address: int) -> tuple[int, int] | None:
        i = bisect.bisect(self._starts, address) - 1
        if i >= 0:
            start, end, _, _ = self._blocks[i]
            if start <= address <= end:  # the end too: an empty view may sit just past a buffer's last row
                return start, end
        return None

    def dtype_at(self, address: int) -> torch.dtype | None:
        """The dtype the buffer holding ``address`` was allocated with (uint8: untyped bytes)."""
        i = bisect.bisect(self._starts, address) - 1
        return self._blocks[i][3] if i >= 0 and self._blocks[i][0] <= address <= self._blocks[i][1] else None

    def check_inside(self, name: str, address: int, nbytes: int, what: str) -> None:
        block = self.block_of(address)
        if block is None or address + nbytes > block[1]:
            raise RuleViolation("device-memory", f"{what} {name} at {address:#x} ({nbytes} bytes) is not inside a "
                                                 "device allocation")

    def bytes_at(self, v: BufferView) -> torch.Tensor:
        return _bytes(v.address, v.nbytes)

    # streams, events and the queue
    def stream(self) -> EmulatedStream:
        s = EmulatedStream(self, next(self._handles))
        self.streams[s.cuda_stream] = s
        return s

    def current_stream(self) -> EmulatedStream:
        return self._on or self.default

    def on(self, stream: EmulatedStream):
        """``torch.cuda.stream(s)``: ``s`` is the current stream inside."""
        return _On(self, stream)

    def event(self) -> EmulatedEvent:
        return EmulatedEvent(self)

    def enqueue(self, stream: EmulatedStream, what: str, run=None, deps=(), writes=()) -> _Op:
        """Queue work on ``stream``. The default stream runs it at once: it stands for the host-side caller, whose
        reads and writes of emulated device memory (host memory, which the KV cache writes through numpy views) the
        emulator cannot see, so work the caller queues there, and the work it waits for, is done before the caller
        goes on. Every other stream is lazy."""
        op = _Op(next(self._seq), stream, what, run, deps, writes)
        stream.queue.append(op)
        if stream is self.default:
            self.force(op)
        return op

    def force(self, op: _Op) -> None:
        """Run ``op`` and everything it needs: the work it and its stream's earlier ops wait for on other streams
        first (latest first), then its stream's pending work in order."""
        if op.done:
            return
        queue = op.stream.queue
        span = queue[:queue.index(op) + 1]
        for o in reversed(span):
            for d in o.deps:
                self.force(d)
        for o in span:
            if not o.done:
                o.stream.fault = o.stream.fault or next((d.stream.fault for d in o.deps if d.stream.fault), None)
                if o.run is not None:
                    o.run(o)
                o.done = True
                queue.remove(o)

    def sync_current(self) -> None:
        s = self.current_stream()
        if s.queue:
            self.force(s.queue[-1])

    def pending_writes(self, start: int, end: int, before: int) -> list[tuple[int, int, str]]:
        """Byte ranges of [start, end) that ops queued before ``before`` (host order) write and have not run."""
        out = []
        for s in self.streams.values():
            for op in s.queue:
                if op.seq < before:
                    out += [(max(a, start), min(b, end), op.what) for a, b in op.writes if a < end and start < b]
        return out

    def read(self, address: int, nbytes: int, before: int, reader: str) -> np.ndarray:
        """The bytes a reader queued at ``before`` sees: poison where an earlier queued write has not run."""
        data = _bytes(address, nbytes).numpy().copy()
        for a, b, what in self.pending_writes(address, address + nbytes, before):
            data[a - address:b - address] = POISON
            self.poisoned_reads.append(f"{reader} read {b - a} bytes at {a:#x} before {what} wrote them")
        return data

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)``: queued on the current stream; the source (device or pinned host
        memory) is read when the copy runs."""
        if dst.nbytes != src.nbytes or not (dst.is_contiguous() and src.is_contiguous()):
            raise AssertionError("the emulator copies whole contiguous buffers of equal size")
        d, n, sp = dst.data_ptr(), dst.nbytes, src.data_ptr()

        def run(op: _Op) -> None:
            data = (self.read(sp, n, op.seq, "a copy") if self.block_of(sp) is not None
                    else _bytes(sp, n).numpy().copy())
            ctypes.memmove(d, data.ctypes.data, n)

        self.enqueue(self.current_stream(), "a copy", run, writes=[(d, d + n)] if n else [])

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        """``x.cpu()``: waits for the current stream (and what it waits for); bytes that a write queued before
        still has not written (on a stream the current one does not wait for) read as poison."""
        self.sync_current()
        self.host_reads += 1
        s = self.current_stream()
        if s.fault is not None:
            raise RuntimeError(s.fault)
        out = x.numpy().copy()
        start, nbytes = x.data_ptr(), x.numel() * x.element_size()
        contiguous = x.is_contiguous()
        hazards = self.pending_writes(start, start + nbytes, next(self._seq))
        if hazards:
            flat = out.reshape(-1).view(np.uint8)
            for a, b, what in hazards:
                if contiguous:
                    flat[a - start:b - start] = POISON
                else:
                    flat[:] = POISON
                self.poisoned_reads.append(f"a host read of {tuple(x.shape)} {x.dtype} memory read {b - a} bytes "
                                           f"before {what} wrote them")
        return out


class _On:
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside."""

    def __init__(self, mem: EmulatedMemory, stream: EmulatedStream):
        self.mem, self.stream = mem, stream

    def __enter__(self):
        self.before, self.mem._on = self.mem._on, self.stream
        return self

    def __exit__(self, *exc):
        self.mem._on = self.before
        return False


class EmulatedStream:
    """A CUDA stream as TensorRT and the backend see it: a handle, and a queue of work run when forced."""

    def __init__(self, mem: EmulatedMemory, handle: int):
        self.mem = mem
        self.cuda_stream = handle
        self.queue: list[_Op] = []
        self.fault: str | None = None  # a device fault: raised at the next synchronisation, as CUDA does

    @property
    def ops(self) -> list[_Op]:
        return self.queue

    def synchronize(self) -> None:
        if self.queue:
            self.mem.force(self.queue[-1])
        if self.fault is not None:
            raise RuntimeError(self.fault)

    def wait_stream(self, other: EmulatedStream) -> None:
        """Work queued on this stream from now on runs after the work queued on ``other`` until now. Nothing runs,
        except on the default stream (see ``_wait``)."""
        if other is not self and other.queue:
            self._wait(f"a wait for stream {other.cuda_stream:#x}", other.queue[-1])

    def wait_event(self, event: EmulatedEvent) -> None:
        if event.op is not None and not event.op.done:
            self._wait("a wait for an event", event.op)

    def _wait(self, what: str, dep: _Op) -> None:
        self.mem.enqueue(self, what, deps=[dep])  # on the default stream: forced at once (EmulatedMemory.enqueue)


class EmulatedEvent:
    """A CUDA event: ``record`` queues a marker on the stream; ``synchronize`` runs the stream's work up to it."""

    def __init__(self, mem: EmulatedMemory):
        self.mem = mem
        self.stream: EmulatedStream | None = None
        self.op: _Op | None = None

    def record(self, stream: EmulatedStream | None = None) -> None:
        self.stream = stream or self.mem.current_stream()
        self.op = self.mem.enqueue(self.stream, "an event record")

    def synchronize(self) -> None:
        if self.op is not None:
            self.mem.force(self.op)
            if self.stream.fault is not None:
                raise RuntimeError(self.stream.fault)


def _bytes(address: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


# ---- the TensorRT module stand-in --------------------------------------------------------------------------


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class ExecutionContextAllocationStrategy(enum.Enum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class DynamicShapesKernelSpecializationStrategy(enum.Enum):
    LAZY = 0
    EAGER = 1
    NONE = 2


class _RuntimeCache:
    """TensorRT-RTX's runtime cache: the emulator compiles nothing, so it holds a marker per engine."""

    MAGIC = b"EMULATED-TENSORRT-RTX-RUNTIME-CACHE:"

    def __init__(self, graph: str):
        self.graph = graph
        self.loaded = False

    def serialize(self) -> bytes:
        return self.MAGIC + self.graph.encode()

    def deserialize(self, blob: bytes) -> bool:
        self.loaded = bytes(blob) == self.serialize()
        return self.loaded


class _RuntimeConfig:
    """``IRuntimeConfig`` (TensorRT-RTX): allocation strategy, shape specialisation, runtime cache."""

    def __init__(self, engine: EmulatedEngine):
        self.engine = engine
        self.strategy = ExecutionContextAllocationStrategy.STATIC
        self.dynamic_shapes_kernel_specialization_strategy = DynamicShapesKernelSpecializationStrategy.LAZY
        self.runtime_cache: _RuntimeCache | None = None

    def set_execution_context_allocation_strategy(self, strategy) -> None:
        self.strategy = strategy

    def get_execution_context_allocation_strategy(self):
        return self.strategy

    def create_runtime_cache(self) -> _RuntimeCache:
        return _RuntimeCache(self.engine.graph)

    def set_runtime_cache(self, cache: _RuntimeCache) -> None:
        self.runtime_cache = cache

    def get_runtime_cache(self) -> _RuntimeCache | None:
        return self.runtime_cache


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = _Severity

    def __init__(self):
        pass


class _Module:
    """What ``TrtBackend`` reads from ``lib.module``."""

    def __init__(self, emulator: TrtEmulator):
        self._emulator = emulator
        self.TensorIOMode = TensorIOMode
        self.DataType = DataType
        self.ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
        self.DynamicShapesKernelSpecializationStrategy = DynamicShapesKernelSpecializationStrategy
        self.ILogger = ILogger

    def Runtime(self, logger) -> _Runtime:  # noqa: N802 - TensorRT's name
        return _Runtime(self._emulator, logger)


class _Runtime:
    def __init__(self, emulator: TrtEmulator, logger):
        self.emulator = emulator
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes) -> EmulatedEngine | None:
        graph = self.emulator.graph_of(data)
        if graph is None:
            self.logger.log(_Severity.ERROR, "emulator: these bytes are not one of the artifact's engines")
            return None
        return EmulatedEngine(self.emulator, graph, self.logger)


class EmulatedEngine:
    """An engine of the artifact: its I/O names, the manifest's profiles (from the real build), its ONNX."""

    DEVICE_MEMORY = 1 << 20  # bytes a context needs (a stand-in figure: the emulator computes elsewhere)

    def __init__(self, emulator: TrtEmulator, graph: str, logger):
        self.emulator = emulator
        self.graph = graph
        self.logger = logger
        self.spec: GraphSpec = engine_spec(emulator.manifest, graph, emulator.manifest.engines.graphs[graph].appended)
        self.profiles: list[Profile] = profiles_of(emulator.manifest, graph)
        self._names = [t.name for t in (*self.spec.inputs, *self.spec.outputs)]
        self._inputs = set(self.spec.input_names)
        self.owners: dict[int, EmulatedContext] = {}  # profile -> the context that set it
        self.session = emulator.session(graph)
        self.dtypes = emulator.onnx_dtypes(graph)  # the build's source graph says what the engine takes and gives
        self.device_memory_size_v2 = self.DEVICE_MEMORY

    @property
    def num_io_tensors(self) -> int:
        return len(self._names)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return self._names[i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name in self._inputs else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[DTYPES[self.dtypes[name]].trt]

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return self.DEVICE_MEMORY

    def create_runtime_config(self) -> _RuntimeConfig:
        return _RuntimeConfig(self)

    def create_execution_context(self, how=ExecutionContextAllocationStrategy.STATIC) -> EmulatedContext:
        """``how``: an allocation strategy, or (TensorRT-RTX) an ``IRuntimeConfig``."""
        if isinstance(how, _RuntimeConfig):
            ctx = EmulatedContext(self, how.strategy)
            ctx._runtime_config = weakref.ref(how)  # TensorRT does not keep the config alive: the caller must
            return ctx
        return EmulatedContext(self, how)


class EmulatedContext:
    """``IExecutionContext``: per-context shapes and addresses, checked against TensorRT's rules at each call."""

    def __init__(self, engine: EmulatedEngine, strategy):
        self.engine = engine
        self.strategy = strategy
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.device_memory: tuple[int, int] | None = None
        self._runtime_config = None  # a weak reference: the caller keeps the config alive (RULES["runtime-config"])
        self.calls = {"set_input_shape": 0, "set_tensor_address": 0, "get_tensor_shape": 0, "execute_async_v3": 0}

    @property
    def runtime_config(self) -> _RuntimeConfig | None:
        return self._runtime_config() if self._runtime_config is not None else None

    def _log(self, rule: str, detail: str) -> None:
        self.engine.logger.log(_Severity.ERROR, str(RuleViolation(rule, detail)))

    def set_optimization_profile_async(self, index: int, stream_handle: int) -> bool:
        """Returns True; a refusal raises RuntimeError, as TensorRT's Python API does (after logging why)."""
        refuse = self.engine.emulator.refuse_profile
        if not 0 <= index < len(self.engine.profiles) or stream_handle not in self.engine.emulator.mem.streams or (
                refuse is not None and refuse(self.engine.graph, index)):
            self.engine.logger.log(_Severity.ERROR, f"{self.engine.graph}: profile {index} refused on stream "
                                                    f"{stream_handle:#x}")
            raise RuntimeError("Error in set optimization profile.")
        owners = self.engine.owners
        if owners.get(index) not in (None, self):
            raise RuleViolation("own-profile", f"{self.engine.graph}: profile {index} already belongs to another "
                                               "execution context")
        if self.profile is not None and owners.get(self.profile) is self:
            del owners[self.profile]
        self.profile = index
        owners[index] = self
        self.shapes.clear()
        return True

    def set_device_memory(self, address: int, size: int) -> None:
        if address % TRT_ADDRESS_ALIGNMENT:
            raise RuleViolation("alignment", f"{self.engine.graph}: context memory at {address:#x}")
        self.device_memory = (address, size)

    def set_input_shape(self, name: str, shape) -> bool:
        self.calls["set_input_shape"] += 1
        shape = tuple(int(d) for d in shape)
        if name not in self.engine._inputs:
            self._log("shape-set", f"{self.engine.graph}: {name} is not an input")
            return False
        bad = self._outside_profile(name, shape)
        if bad:
            self._log("profile", bad)
            return False
        self.shapes[name] = shape
        return True

    def _outside_profile(self, name: str, shape: tuple[int, ...]) -> str | None:
        if self.profile is None:
            return f"{self.engine.graph}: no optimisation profile set on this context"
        want = next(t for t in self.engine.spec.inputs if t.name == name).shape
        p = self.engine.profiles[self.profile]
        if len(shape) != len(want):
            return f"{self.engine.graph}: {name} has rank {len(shape)}, the engine's is {len(want)}"
        for got, dim in zip(shape, want, strict=True):
            if isinstance(dim, int):
                if got != dim:
                    return f"{self.engine.graph}: {name} shape {list(shape)}: dimension {got} is fixed at {dim}"
                continue
            lo, _, hi = p.axes[dim]
            if not lo <= got <= hi:
                return (f"{self.engine.graph}: {name} shape {list(shape)} is outside profile {self.profile} "
                        f"({p.name}): {dim}={got} not in [{lo}, {hi}]")
        return None

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.calls["set_tensor_address"] += 1
        if name not in self.engine._names:
            self._log("address-set", f"{self.engine.graph}: {name} is not one of the engine's tensors")
            return False
        if address % TRT_ADDRESS_ALIGNMENT:  # refused by validation: the previous address stays bound
            self._log("alignment", f"{self.engine.graph}: {name} at {address:#x} "
                                   f"({address % TRT_ADDRESS_ALIGNMENT} bytes past a boundary)")
            return False
        self.addresses[name] = address
        return True

    def _axes(self) -> dict[str, int] | None:
        axes: dict[str, int] = {}
        for t in self.engine.spec.inputs:
            shape = self.shapes.get(t.name)
            if shape is None:
                return None
            for got, dim in zip(shape, t.shape, strict=True):
                if isinstance(dim, str):
                    if axes.setdefault(dim, got) != got:
                        return None
        return axes

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """An output's shape from the input shapes set (-1 where they do not determine it yet)."""
        self.calls["get_tensor_shape"] += 1
        t = next(t for t in (*self.engine.spec.inputs, *self.engine.spec.outputs) if t.name == name)
        if name in self.shapes:
            return self.shapes[name]
        axes = self._axes() or {}
        return tuple(d if isinstance(d, int) else axes.get(d, -1) for d in t.shape)

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.calls["execute_async_v3"] += 1
        eng, graph = self.engine, self.engine.graph
        emu = eng.emulator
        mem = emu.mem
        stream = mem.streams.get(stream_handle)
        if stream is None:
            raise RuleViolation("device-memory", f"{graph}: stream handle {stream_handle:#x} is not a stream")
        if self.profile is None or eng.owners.get(self.profile) is not self:
            raise RuleViolation("own-profile", f"{graph}: this context's profile {self.profile} is not its own")
        if self._runtime_config is not None and self._runtime_config() is None:
            raise RuleViolation("runtime-config", f"{graph}: the IRuntimeConfig this context was created from was "
                                                  "freed")
        missing = [t.name for t in eng.spec.inputs if t.name not in self.shapes]
        if missing:
            raise RuleViolation("shape-set", f"{graph}: no shape set for {missing} (profile {self.profile})")
        for name, shape in self.shapes.items():
            bad = self._outside_profile(name, shape)
            if bad:
                raise RuleViolation("profile", bad)
        axes = self._axes()
        if axes is None:
            raise RuleViolation("profile", f"{graph}: input shapes disagree on a shared axis: {self.shapes}")
        unset = [n for n in eng._names if n not in self.addresses]
        if unset:
            raise RuleViolation("address-set", f"{graph}: no address for {unset}")
        if self.strategy == ExecutionContextAllocationStrategy.USER_MANAGED:
            if self.device_memory is None or self.device_memory[1] < eng.get_device_memory_size_for_profile_v2(
                    self.profile):
                raise RuleViolation("context-memory", f"{graph}: context memory {self.device_memory} is missing or "
                                                      "too small")
            mem.check_inside("context memory", self.device_memory[0], self.device_memory[1], graph)
        spans = {}
        for t in (*eng.spec.inputs, *eng.spec.outputs):
            shape = tuple(d if isinstance(d, int) else axes[d] for d in t.shape)
            dtype = eng.dtypes[t.name]
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            address = self.addresses[t.name]
            spans[t.name] = (address, nbytes, shape, dtype)
        for name, (address, nbytes, _, dtype) in spans.items():
            if nbytes == 0:
                others = [n for n, s in spans.items() if n != name and s[0] == address]
                if address == 0 or others:
                    raise RuleViolation("empty", f"{graph}: empty {name} at {address:#x} (shared with {others})")
            else:
                mem.check_inside(name, address, nbytes, "tensor")
                if address % TRT_ADDRESS_ALIGNMENT:
                    raise RuleViolation("alignment", f"{graph}: {name} bound at {address:#x}")
                held = mem.dtype_at(address)
                if held not in (torch.uint8, DTYPES[dtype].torch):  # uint8: the backend's untyped byte buffers
                    raise RuleViolation("dtype", f"{graph}: {name} is {dtype} in the engine, bound to {held} memory")
            if self.device_memory is not None:
                lo, size = self.device_memory
                if address < lo + size and lo < address + max(nbytes, 1):
                    raise RuleViolation("context-memory", f"{graph}: {name} overlaps the context's memory")
        profile = self.profile
        what = f"{graph} (profile {profile})"

        def execute(op: _Op) -> None:
            seq = op.seq
            feeds = {t.name: _decode(mem.read(*spans[t.name][:2], seq, what), *spans[t.name][2:])
                     for t in eng.spec.inputs}
            results = eng.session.run([t.name for t in eng.spec.outputs], feeds)
            for t, value in zip(eng.spec.outputs, results, strict=True):
                address, nbytes, shape, dtype = spans[t.name]
                if tuple(value.shape) != shape:
                    raise RuleViolation("profile", f"{graph}: {t.name} computed as {list(value.shape)}, bound as "
                                                   f"{list(shape)}")
                data = _encode(value, dtype)
                ctypes.memmove(address, data, len(data))
            if emu.fault_on is not None and emu.fault_on(graph, profile, axes):
                stream.fault = "CUDA error: an illegal memory access was encountered"  # surfaces at the next sync

        writes = [(a, a + n) for a, n, _, _ in (spans[t.name] for t in eng.spec.outputs) if n]
        mem.enqueue(stream, what, execute, writes=writes)
        emu.executions.append((graph, profile, axes))
        return True


def _decode(raw: np.ndarray, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if raw.size == 0:
        return np.zeros(shape, dtype=np.float32 if dtype == "bfloat16" else DTYPES[dtype].numpy)
    if dtype == "bfloat16":
        return torch.from_numpy(raw).view(torch.bfloat16).float().numpy().reshape(shape)  # computed in fp32
    return raw.view(DTYPES[dtype].numpy).reshape(shape)


def _encode(value: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(torch.bfloat16).view(
            torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(value, dtype=DTYPES[dtype].numpy).tobytes()


# ---- the emulator ------------------------------------------------------------------------------------------


def _fp32_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every bfloat16 tensor, cast and value in float32 (ONNX Runtime's CPU provider has no
    bf16 kernels). Inputs and outputs become float32 too; the emulator converts at the bound memory."""
    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT

    def fix_tensor(t: onnx.TensorProto) -> None:
        if t.data_type == bf16:
            arr = numpy_helper.to_array(t).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(arr, t.name))

    def fix_graph(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            fix_tensor(t)
        for vi in (*g.input, *g.output, *g.value_info):
            if vi.type.tensor_type.elem_type == bf16:
                vi.type.tensor_type.elem_type = f32
        for node in g.node:
            for a in node.attribute:
                if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == bf16:
                    a.i = f32
                if a.type == onnx.AttributeProto.TENSOR:
                    fix_tensor(a.t)
                if a.type == onnx.AttributeProto.GRAPH:
                    fix_graph(a.g)
                for sub in a.graphs:
                    fix_graph(sub)

    fix_graph(model.graph)
    return model


class TrtEmulator:
    """One artifact's engines, emulated: the lib stand-in, the device memory, and what ran."""

    def __init__(self, directory: Path, manifest: Manifest, compute_capability: tuple[int, int] = (8, 9),
                 threads: int = 1):
        if manifest.engines is None:
            from eagle_export.errors import EngineError

            raise EngineError(f"{directory} has no TensorRT engines: run `eagle-export build {directory}` first")
        self.directory = Path(directory)
        self.manifest = manifest
        self.threads = threads
        self.mem = EmulatedMemory(compute_capability)
        info = manifest.engines
        self._by_digest = {}
        for name, entry in info.graphs.items():
            path = self.directory / entry.file
            if path.is_file():
                self._by_digest[hashlib.sha256(path.read_bytes()).hexdigest()] = name
        self.lib = TrtLib(info.lib, _Module(self), info.lib_version)
        self.executions: list[tuple[str, int, dict]] = []
        # Tests: a predicate (graph, profile, axes) -> bool on which a call faults on the "device", and one
        # (graph, profile index) -> bool on which set_optimization_profile_async refuses.
        self.fault_on = None
        self.refuse_profile = None
        self._sessions: dict[str, ort.InferenceSession] = {}

    def source(self, graph: str, load_external_data: bool = False) -> onnx.ModelProto:
        """The ONNX graph the engine of ``graph`` was built from, as `build` made it (``builder.engine_source``: a tree
        call's graph cut to its depth, the operators the build appended)."""
        return engine_source(self.directory, self.manifest, graph, self.manifest.engines.graphs[graph].appended,
                             load_external_data)

    def onnx_dtypes(self, graph: str) -> dict[str, str]:
        """The source graph's I/O dtypes (the contract's names), read from the ONNX file the engine was built from."""
        model = self.source(graph)
        by_onnx = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
                   TensorProto.INT64: "int64", TensorProto.INT32: "int32", TensorProto.BOOL: "bool",
                   TensorProto.INT8: "int8", TensorProto.UINT8: "uint8"}
        return {v.name: by_onnx[v.type.tensor_type.elem_type] for v in (*model.graph.input, *model.graph.output)}

    def graph_of(self, data: bytes) -> str | None:
        return self._by_digest.get(hashlib.sha256(data).hexdigest())

    def session(self, graph: str) -> ort.InferenceSession:
        s = self._sessions.get(graph)
        if s is None:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = self.threads
            opts.log_severity_level = 3
            if self.manifest.dtype == "bfloat16" or self.manifest.engines.graphs[graph].appended or \
                    C.parse_tree_call(graph) is not None:
                model = ties_the_other_way(self.source(graph, load_external_data=True))
                if self.manifest.dtype == "bfloat16":
                    model = _fp32_copy(model)
                s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            else:
                s = ort.InferenceSession(str(self.directory / self.manifest.graphs[graph].file), opts,
                                         providers=["CPUExecutionProvider"])
            self._sessions[graph] = s
        return s

    def backend(self, **options) -> TrtBackend:
        be = TrtBackend(self.directory, self.manifest, lib=self.lib, mem=self.mem, **options)
        be.emulator = self  # what ran, for tests
        return be


def ties_the_other_way(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every appended ``TopK`` and ``ArgMax`` (engines/round_ops.py, along axis 1) putting the higher
    index first among equal values, but the argmax over the logits (module docstring). A TopK's input is reversed
    along its axis and its indices mapped back; an ArgMax gets ``select_last_index``. In place; returns it."""
    from onnx import helper

    from eagle_export.engines.round_ops import PREFIX

    g = model.graph
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(g.node):
        if not node.name.startswith(PREFIX) or node.op_type not in ("TopK", "ArgMax") or C.LOGITS in node.input:
            nodes.append(node)
            continue
        if node.op_type == "ArgMax":
            node.attribute.append(helper.make_attribute("select_last_index", 1))
            nodes.append(node)
            continue
        p = f"/emulator/ties_{i}"
        big = np.iinfo(np.int64).max
        g.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), f"{p}/{n}")
                             for n, v in (("s", [-1]), ("e", [-big]), ("a", [1]), ("st", [-1]), ("one", [1])))
        x, idx = node.input[0], node.output[1]
        node.input[0], node.output[1] = f"{p}/x", f"{p}/idx"
        nodes += [helper.make_node("Slice", [x, f"{p}/s", f"{p}/e", f"{p}/a", f"{p}/st"], [f"{p}/x"], name=f"{p}/rev"),
                  helper.make_node("Shape", [x], [f"{p}/n"], name=f"{p}/shape", start=1, end=2),
                  helper.make_node("Sub", [f"{p}/n", f"{p}/one"], [f"{p}/last"], name=f"{p}/last"),
                  node,
                  helper.make_node("Sub", [f"{p}/last", f"{p}/idx"], [idx], name=f"{p}/back")]
    del g.node[:]
    g.node.extend(nodes)
    return model


def emulated_backend(directory: str | Path, compute_capability: tuple[int, int] = (8, 9), **options) -> TrtBackend:
    """A ``TrtBackend`` over the artifact's engines, executed by the emulator on the CPU."""
    directory = Path(directory)
    return TrtEmulator(directory, load_manifest(directory), compute_capability).backend(**options)


def emulated_runtime(directory: str | Path, prefill_chunk: int = 256, guard=True, **options):
    """An ``EagleRuntime`` whose backend is the emulated ``TrtBackend`` (as ``EagleRuntime.open(backend=
    "tensorrt")`` would build it on a GPU). guard: as ``EagleRuntime.open``'s."""
    from eagle_export.runtime.api import EagleRuntime, _load_tokenizer, guard_policy

    be = emulated_backend(directory, **options)
    directory = Path(directory)
    m = load_manifest(directory)
    tok = _load_tokenizer(directory) if m.has_tokenizer else None
    return EagleRuntime(directory, m, be, tok, min(prefill_chunk, be.max_prefill), guard=guard_policy(guard))

"""TensorRT backend: the engines of `eagle-export build`, run by the same EAGLE loop as ONNX Runtime.

Implements ``runtime.backend.Backend``, as ``OrtBackend`` does; the generator (``generator.py``) allocates every
buffer once through ``zeros`` and passes ``BufferView``s of them.

Per graph: one deserialized engine and one execution context per optimisation profile (bound to its
profile once, so picking a profile per call costs nothing). Per call:

1. ``GraphBindings.plan`` (pure, unit-tested on CPU with fake addresses) reads the axis values off the
   given shapes, checks them against the contract (dtypes, fixed dims, ``total_len = past_len +
   new_tokens``, output shapes), picks the profile (``profiles.choose_profile``) and lists the
   (tensor name, shape, address) bindings;
2. small host inputs (ids, positions, mask, logit rows: numpy arrays) are copied into pinned host
   buffers and then, asynchronously, into device staging buffers, all allocated once here;
3. ``set_input_shape`` / ``set_tensor_address`` on the profile's context, ``execute_async_v3`` on the
   backend's one stream, ordered after and before the caller's current torch stream with events (no
   host synchronisation: the only host round trips are the small arrays the generator reads back).

Addresses: TensorRT's API documentation asks for at least 256-byte aligned tensor addresses. The cache
prefix views bound as ``past_*`` start at their buffer's base (aligned), but a ``present_*`` output
bound to cache rows ``[past_len, past_len + T)`` is aligned only when ``past_len * row_bytes`` is a
multiple of 256. Outputs whose rows are not a multiple of 256 bytes get a scratch buffer (allocated once,
sized by the profiles); when the caller's address is unaligned, the engine writes there and the T new
rows are copied into place on the same stream (a device copy of the new rows only, never the cache).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.contract import GraphSpec
from eagle_export.dtypes import DTYPES
from eagle_export.engines.profiles import Profile, choose_profile
from eagle_export.errors import EngineError, GenerationError
from eagle_export.manifest import Manifest
from eagle_export.tree_params import TreeParams

from .views import BufferView, host_array, view_of

log = logging.getLogger(__name__)

TRT_ADDRESS_ALIGNMENT = 256
STAGED_DTYPES = ("int64", "int32", "bool")  # the small inputs the generator passes as host arrays


@dataclass(frozen=True)
class Binding:
    name: str
    shape: tuple[int, ...]
    address: int  # what TensorRT is given
    stage: str | None = None  # inputs: "h2d" host array -> staging buffer, "d2d" unaligned device tensor -> staging
    copy_back: bool = False  # outputs: the engine writes the scratch buffer; copied to the caller's tensor after


@dataclass(frozen=True)
class CallPlan:
    graph: str
    profile: int
    axes: dict[str, int]
    inputs: tuple[Binding, ...]
    outputs: tuple[Binding, ...]


@dataclass(frozen=True)
class Buffer:
    """A buffer allocated once by the backend: its device address and capacity in bytes."""

    address: int
    nbytes: int


def _shape_at(spec_shape: tuple, axes: dict[str, int]) -> tuple[int, ...]:
    return tuple(axes[d] if isinstance(d, str) else d for d in spec_shape)


Layout = dict[str, tuple[str, int]]  # tensor name -> (dtype, elements)


def buffer_layout(spec: GraphSpec, profiles: list[Profile],
                  alignment: int = TRT_ADDRESS_ALIGNMENT) -> tuple[Layout, Layout]:
    """Which buffers the backend allocates once for a graph: ({input: (dtype, numel)}, {output: (dtype, numel)}).

    Staging: every integer/bool input (the generator passes them as host arrays). Scratch: every output whose
    bytes per row (per index of its second axis) are not a multiple of ``alignment``, so a view starting at an
    arbitrary row can be unaligned. Sizes are the largest shape any profile admits.
    """
    maxima = [{a: v[2] for a, v in p.axes.items()} for p in profiles]
    staging = {}
    for t in spec.inputs:
        if t.dtype in STAGED_DTYPES:
            staging[t.name] = (t.dtype, max(math.prod(_shape_at(t.shape, m)) for m in maxima))
    scratch = {}
    for t in spec.outputs:
        row_bytes = math.prod(d for d in _shape_at(t.shape, maxima[0])[2:]) * DTYPES[t.dtype].itemsize
        if row_bytes % alignment:
            scratch[t.name] = (t.dtype, max(math.prod(_shape_at(t.shape, m)) for m in maxima))
    return staging, scratch


def on_cuda(v: BufferView) -> bool:
    """Whether a view is device memory TensorRT can read (a CUDA device's)."""
    return v.device == "cuda"


class GraphBindings:
    """Per-call planning for one graph: validate shapes, choose the profile, compute every binding. No TensorRT.

    ``is_device`` says whether a view is device memory (default: a CUDA view); host views of staged inputs are
    copied to their staging buffer, and any other host view is refused.
    """

    def __init__(self, graph: str, spec: GraphSpec, profiles: list[Profile], staging: dict[str, Buffer],
                 scratch: dict[str, Buffer], alignment: int = TRT_ADDRESS_ALIGNMENT,
                 is_device: Callable[[BufferView], bool] = on_cuda):
        self.graph = graph
        self.spec = spec
        self.profiles = profiles
        self.staging = staging
        self.scratch = scratch
        self.alignment = alignment
        self.is_device = is_device

    def _err(self, msg: str) -> EngineError:
        return EngineError(f"{self.graph}: {msg}")

    def _collect_axes(self, inputs: dict[str, BufferView]) -> dict[str, int]:
        axes: dict[str, int] = {}
        source: dict[str, str] = {}
        for t in self.spec.inputs:
            d = inputs[t.name]
            if d.dtype != t.dtype:
                raise self._err(f"input {t.name} is {d.dtype}, the engine takes {t.dtype}")
            if len(d.shape) != len(t.shape):
                raise self._err(f"input {t.name} has shape {list(d.shape)}, the contract says {list(t.shape)}")
            for got, want in zip(d.shape, t.shape, strict=True):
                if isinstance(want, int):
                    if got != want:
                        raise self._err(f"input {t.name} has shape {list(d.shape)}, the contract says {list(t.shape)}")
                elif want in axes and axes[want] != got:
                    raise self._err(f"input {t.name} gives {want}={got} but {source[want]} gives {axes[want]}")
                else:
                    axes[want] = got
                    source[want] = t.name
        if C.TOTAL_LEN in axes and axes[C.TOTAL_LEN] != axes.get(C.PAST_LEN, 0) + axes.get(C.NEW_TOKENS, 0):
            raise self._err(f"{C.ATTENTION_MASK} covers {axes[C.TOTAL_LEN]} keys, not past_len {axes.get(C.PAST_LEN)}"
                            f" + new_tokens {axes.get(C.NEW_TOKENS)}")
        return axes

    def plan(self, inputs: dict[str, BufferView], outputs: dict[str, BufferView]) -> CallPlan:
        for kind, given, names in (("inputs", inputs, self.spec.input_names),
                                   ("outputs", outputs, self.spec.output_names)):
            if set(given) != set(names):
                missing = sorted(set(names) - set(given))
                unknown = sorted(set(given) - set(names))
                raise self._err(f"{kind} do not match the engine's: missing {missing}, unknown {unknown}")
        axes = self._collect_axes(inputs)
        index = choose_profile(self.profiles, axes)
        if index is None:
            ranges = "; ".join(f"{p.name}: {p.range_text()}" for p in self.profiles)
            shown = ", ".join(f"{a}={v}" for a, v in axes.items())
            raise self._err(f"a call with {shown} fits no optimisation profile of the engine ({ranges}): rebuild with "
                            "larger --max-prefill / --max-tree-tokens, or use a smaller tree or prefill chunk")
        in_bindings = []
        for t in self.spec.inputs:
            d = inputs[t.name]
            in_bindings.append(self._bind_input(t.name, d))
        out_bindings = []
        for t in self.spec.outputs:
            d = outputs[t.name]
            want = _shape_at(t.shape, axes)
            if d.dtype != t.dtype or tuple(d.shape) != want:
                raise self._err(f"output {t.name} buffer is {d.dtype} {list(d.shape)}, the engine writes "
                                f"{t.dtype} {list(want)}")
            out_bindings.append(self._bind_output(t.name, d))
        return CallPlan(self.graph, index, axes, tuple(in_bindings), tuple(out_bindings))

    def _staged(self, name: str, d: BufferView, why: str) -> Buffer:
        buf = self.staging.get(name)
        if buf is None:
            raise self._err(f"input {name} is {why} and has no staging buffer")
        if d.nbytes > buf.nbytes:
            raise self._err(f"input {name} needs {d.nbytes} bytes, its staging buffer holds {buf.nbytes}")
        return buf

    def _bind_input(self, name: str, d: BufferView) -> Binding:
        if not self.is_device(d):
            return Binding(name, d.shape, self._staged(name, d, "a host array").address, stage="h2d")
        if d.address == 0:
            raise self._err(f"input {name} has a null address")
        if d.address % self.alignment:
            buf = self._staged(name, d, f"at an address not {self.alignment}-byte aligned")
            return Binding(name, d.shape, buf.address, stage="d2d")
        return Binding(name, d.shape, d.address)

    def _bind_output(self, name: str, d: BufferView) -> Binding:
        if not self.is_device(d):
            raise self._err(f"output {name} must be a device tensor, got a host array")
        if d.address == 0:
            raise self._err(f"output {name} has a null address")
        if d.address % self.alignment:
            buf = self.scratch.get(name)
            if buf is None:
                raise self._err(f"output {name} is at an address not {self.alignment}-byte aligned and has no scratch")
            if d.nbytes > buf.nbytes:
                raise self._err(f"output {name} needs {d.nbytes} bytes, its scratch holds {buf.nbytes}")
            return Binding(name, d.shape, buf.address, copy_back=True)
        return Binding(name, d.shape, d.address)


class CudaMemory:
    """Device allocation, streams and events on one CUDA device, through torch: the backend's one seam to the
    hardware (the CPU emulator of ``tools/trt_emulator.py`` swaps in host memory and recorded streams)."""

    def __init__(self, index: int):
        self.device = f"cuda:{index}"
        torch.cuda.set_device(index)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)  # the caching allocator aligns to 512 bytes

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_device(self, v: BufferView) -> bool:
        return v.device == "cuda"

    def bytes_at(self, v: BufferView) -> torch.Tensor:
        """The bytes of a device view as a uint8 tensor (no copy), for the rare copies of unaligned views."""
        return torch.as_tensor(_CudaBytes(v), device=self.device)

    def stream(self):
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        """Context in which torch queues its copies on ``stream``."""
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return x.cpu().numpy()  # ordered after the current stream, which waits for the backend's


class _CudaBytes:
    """``__cuda_array_interface__`` of a BufferView's bytes, so torch can wrap device memory it did not allocate."""

    def __init__(self, v: BufferView):
        self.__cuda_array_interface__ = {"shape": (v.nbytes,), "typestr": "|u1", "data": (v.address, False),
                                         "version": 2}


def profiles_of(manifest: Manifest, graph: str) -> list[Profile]:
    return [Profile.from_dict(p) for p in manifest.engines.graphs[graph].profiles]


def check_engines(directory: Path, manifest: Manifest) -> None:
    """What can be checked without CUDA: engines were built, their files are there."""
    if manifest.engines is None:
        raise EngineError(f"{directory} has no TensorRT engines: run `eagle-export build {directory}` first")
    for name in manifest.graphs:
        entry = manifest.engines.graphs.get(name)
        if entry is None:
            raise EngineError(f"{directory}: no engine for graph {name}: run `eagle-export build {directory}`")
        path = directory / entry.file
        if not path.is_file():
            raise EngineError(f"{directory}: engine file {entry.file} of graph {name} is missing: "
                              f"run `eagle-export build {directory}`")
        size = path.stat().st_size
        if size != entry.size_bytes:  # truncated or replaced: never hand TensorRT a damaged engine
            raise EngineError(f"{directory}: engine file {entry.file} of graph {name} is {size} bytes but was built "
                              f"as {entry.size_bytes} (truncated or corrupt?): run `eagle-export build {directory}`")


class _TrtGraph:
    """One engine, its contexts (one per profile) and the buffers allocated once for its calls."""

    def __init__(self, backend: TrtBackend, name: str, path: Path, spec: GraphSpec, profiles: list[Profile]):
        trt = backend.lib.module
        mem = backend.mem
        self.name = name
        data = path.read_bytes()
        backend.logger.reset()
        engine = backend.runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise EngineError(f"could not load engine {path} ({backend.lib.label}): "
                              + "; ".join(backend.logger.errors or ["(TensorRT gave no message)"])
                              + f": rebuild it with `eagle-export build {path.parent}` on this TensorRT")
        self.engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        ins = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        if ins != set(spec.input_names) or set(names) - ins != set(spec.output_names):
            raise EngineError(f"engine {path} does not have the inputs/outputs of graph {name}: rebuild it")
        if engine.num_optimization_profiles != len(profiles):
            raise EngineError(f"engine {path} has {engine.num_optimization_profiles} profiles, its manifest lists "
                              f"{len(profiles)}: rebuild it")
        stream = backend.stream.cuda_stream
        self.contexts = []
        for i in range(len(profiles)):
            ctx = engine.create_execution_context()
            if ctx is None or not ctx.set_optimization_profile_async(i, stream):
                raise EngineError(f"could not create an execution context for profile {i} of {path}: "
                                  + "; ".join(backend.logger.errors or ["(TensorRT gave no message)"]))
            self.contexts.append(ctx)
        staging_layout, scratch_layout = buffer_layout(spec, profiles)
        nbytes = lambda dt, k: k * DTYPES[dt].itemsize  # noqa: E731
        # Staging and scratch buffers hold bytes: copies into and out of them never need the element type.
        self.staging = {n: mem.zeros((nbytes(dt, k),), torch.uint8) for n, (dt, k) in staging_layout.items()}
        self.pinned = {n: mem.pinned(nbytes(dt, k), torch.uint8) for n, (dt, k) in staging_layout.items()}
        self.pinned_np = {n: t.numpy() for n, t in self.pinned.items()}
        self.scratch = {n: mem.zeros((nbytes(dt, k),), torch.uint8) for n, (dt, k) in scratch_layout.items()}
        self.h2d_done = mem.event()
        self.h2d_pending = False
        self.planner = GraphBindings(
            name, spec, profiles,
            staging={n: Buffer(t.data_ptr(), t.numel()) for n, t in self.staging.items()},
            scratch={n: Buffer(t.data_ptr(), t.numel()) for n, t in self.scratch.items()},
            is_device=mem.is_device,
        )


class TrtBackend:
    """Target and draft engines on one CUDA device. Implements ``runtime.backend.Backend``.

    ``lib`` and ``mem`` are the seams to TensorRT and to the device: by default the library the engines were
    built with and ``CudaMemory``; the CPU emulator (``tools/trt_emulator.py``) passes stand-ins for both.
    """

    name = "tensorrt"
    host_memory = False
    last_exec_s = None  # work is queued on a stream: time run + synchronize

    def __init__(self, directory: Path, manifest: Manifest, device: int | None = None, *, lib=None, mem=None):
        directory = Path(directory)
        check_engines(directory, manifest)
        info = manifest.engines
        if mem is None:
            if not torch.cuda.is_available():
                raise EngineError(
                    "the tensorrt backend runs engines on an NVIDIA GPU, but torch sees no CUDA device here "
                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): use --backend ort, or "
                    "run on a machine with a GPU, its driver and a CUDA build of torch"
                )
            mem = CudaMemory(torch.cuda.current_device() if device is None else device)
        if lib is None:
            from eagle_export.engines.libs import load_lib

            lib = load_lib(info.lib)
        from eagle_export.engines.libs import make_logger

        self.lib = lib
        if self.lib.version != info.lib_version:
            raise EngineError(f"the engines in {directory} were built with {info.lib} {info.lib_version}, but "
                              f"{self.lib.label} is installed: install that version or rebuild with "
                              f"`eagle-export build {directory}`")
        self.mem = mem
        self.device = mem.device
        self.max_prefill = int(info.options["max_prefill"])
        self.max_tree_tokens = int(info.options["max_tree_tokens"])
        self.stream = mem.stream()
        self.logger = make_logger(self.lib)
        self.runtime = self.lib.module.Runtime(self.logger)
        self.graphs = {
            name: _TrtGraph(self, name, directory / info.graphs[name].file, g.spec, profiles_of(manifest, name))
            for name, g in manifest.graphs.items()
        }
        self.stream.synchronize()

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.mem.zeros(shape, dtype)

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return self.mem.to_host(x)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def check_tree(self, tree: TreeParams) -> None:
        """The verify of a round must fit the engine's verify profile."""
        if tree.verify_tokens > self.max_tree_tokens:
            raise GenerationError(
                f"total_tokens={tree.total_tokens} needs a verify of {tree.verify_tokens} tokens, but the engines "
                f"were built for at most {self.max_tree_tokens} (rebuild with a larger --max-tree-tokens)"
            )

    def _stage(self, g: _TrtGraph, b: Binding, x: BufferView) -> None:
        n = x.nbytes
        if b.stage == "d2d":
            g.staging[b.name][:n].copy_(self.mem.bytes_at(x))
            return
        if g.h2d_pending:  # the pinned buffers may still feed the previous call's copies
            g.h2d_done.synchronize()
            g.h2d_pending = False
        np.copyto(g.pinned_np[b.name][:n], host_array(x._replace(dtype="uint8", shape=(n,))))
        g.staging[b.name][:n].copy_(g.pinned[b.name][:n], non_blocking=True)

    def run(self, graph: str, inputs: dict, outputs: dict) -> None:
        g = self.graphs[graph]
        inputs = {n: view_of(x) for n, x in inputs.items()}
        outputs = {n: view_of(x) for n, x in outputs.items()}
        plan = g.planner.plan(inputs, outputs)
        ctx = g.contexts[plan.profile]
        mem = self.mem
        caller = mem.current_stream()
        s = self.stream
        s.wait_stream(caller)
        with mem.on(s):
            staged = False
            try:
                for b in plan.inputs:
                    if b.stage is not None:
                        staged = staged or b.stage == "h2d"
                        self._stage(g, b, inputs[b.name])
                    if not ctx.set_input_shape(b.name, b.shape):
                        raise EngineError(f"{graph}: TensorRT refused shape {list(b.shape)} for {b.name} "
                                          f"(profile {plan.profile}): " + "; ".join(self.logger.errors))
                    ctx.set_tensor_address(b.name, b.address)
            finally:
                if staged:  # recorded even when a later input failed: the next call waits for these copies
                    g.h2d_done.record(s)
                    g.h2d_pending = True
            for b in plan.outputs:
                got = tuple(ctx.get_tensor_shape(b.name))
                if got != b.shape:
                    raise EngineError(f"{graph}: the engine computes {b.name} as {list(got)}, the caller's buffer is "
                                      f"{list(b.shape)}")
                ctx.set_tensor_address(b.name, b.address)
            self.logger.reset()
            if not ctx.execute_async_v3(s.cuda_stream):
                raise EngineError(f"{graph}: TensorRT execution failed (profile {plan.profile}): "
                                  + "; ".join(self.logger.errors or ["(TensorRT gave no message)"]))
            for b in plan.outputs:
                if b.copy_back:
                    v = outputs[b.name]
                    mem.bytes_at(v).copy_(g.scratch[b.name][:v.nbytes])
        caller.wait_stream(s)

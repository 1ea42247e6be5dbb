"""TensorRT backend: the engines of `eagle-export build`, run by the same EAGLE loop as ONNX Runtime.

Implements ``runtime.backend.Backend``, as ``OrtBackend`` does; the generator (``generator.py``) allocates every
buffer once through ``zeros`` and passes ``BufferView``s of them.

Per graph: one deserialized engine and one execution context per optimisation profile (bound to its
profile once, so picking a profile per call costs nothing); every context of both engines runs on one
shared block of context memory. Per call:

1. ``GraphBindings.plan`` (pure) reads the axis values off the given views, checks them against the
   contract (dtypes, fixed dims, ``total_len = past_len + new_tokens``, output shapes), picks the profile
   (``profiles.choose_profile``) and lists the (tensor name, shape, address) bindings; plans are cached per
   call shape;
2. small host inputs (ids, positions, mask, logit rows) are copied into pinned host buffers and then,
   asynchronously, into device staging buffers, all allocated once here;
3. the profile's context gets ``set_input_shape`` / ``set_tensor_address`` only for what changed since its
   last call, then ``execute_async_v3`` on the backend's one stream, ordered after and before the caller's
   current torch stream (no host synchronisation: the only host round trips are the small arrays the
   generator reads back through ``to_host``).

Addresses: TensorRT's API documentation asks for at least 256-byte aligned tensor addresses. The
generator's buffers are aligned (``zeros``) and it binds ``past_*`` at a buffer's row 0 and ``present_*``
at row 0 of the new-rows scratch. For any other caller, outputs whose rows are not a multiple of 256 bytes
have a scratch buffer (allocated once, sized by the profiles): an output at an unaligned address is written
there and copied into place on the same stream.

The hardware is behind one seam (``CudaMemory``: allocation, pinned memory, copies, streams, events, host
reads) and the library behind another (``lib``); ``tools/testing/trt_emulator.py`` swaps both to run this class on
a CPU.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
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
RTX_SHAPE_STRATEGIES = ("none", "lazy", "eager")
MAX_PLANS = 4096  # call plans kept per graph
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
    hardware (the CPU emulator of ``tools/testing/trt_emulator.py`` swaps in host memory and recorded streams)."""

    def __init__(self, index: int):
        self.device = f"cuda:{index}"
        torch.cuda.set_device(index)
        self.compute_capability = tuple(torch.cuda.get_device_capability(index))
        cc = ".".join(map(str, self.compute_capability))
        self.gpu_name = f"{torch.cuda.get_device_name(index)}, compute capability {cc}"

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)  # the caching allocator aligns to 512 bytes

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_device(self, v: BufferView) -> bool:
        return v.device == "cuda"

    def bytes_at(self, v: BufferView) -> torch.Tensor:
        """The bytes of a device view as a uint8 tensor (no copy), for the rare copies of unaligned views."""
        return torch.as_tensor(_CudaBytes(v), device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy queued on the current stream (inside ``on(stream)``: that stream)."""
        dst.copy_(src, non_blocking=True)

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


def _not_built_for(info, capability: tuple[int, int]) -> str | None:
    """TensorRT-RTX engines hold kernels for the compute capabilities the build named (recorded in the manifest;
    engines built before that was recorded have TensorRT-RTX's default set, which leaves out Turing, 7.5)."""
    if info.lib != "tensorrt_rtx":
        return None
    cc = "{}.{}".format(*capability)
    built = info.options.get("compute_capabilities")
    if built is None:
        return "engines built without a recorded compute capability list leave out 7.5" if cc == "7.5" else None
    if cc not in built:
        return f"they were built for compute capabilities {', '.join(built)}, not {cc}"
    return None


def profiles_of(manifest: Manifest, graph: str) -> list[Profile]:
    return [Profile.from_dict(p) for p in manifest.engines.graphs[graph].profiles]


def stale_tree_engines(manifest: Manifest, depths: dict[int, int], selects: dict[int, int]) -> str:
    """The default trees (``tree_defaults``, the per-batch table) that the built tree engines do not serve as `build`
    would now (``profiles.tree_engine_calls``: an engine of their top_k at their depth, selecting their verify tree),
    in words; empty when they all are served or the artifact has no tree graphs to build."""
    from eagle_export.engines.profiles import default_trees, tree_engine_calls

    trees = default_trees(manifest)
    wanted = dict(tree_engine_calls(manifest))
    missing = [t for t in trees if t.top_k in wanted and (depths.get(t.top_k) != wanted[t.top_k]
                                                          or selects.get(t.top_k, 0) < t.total_tokens)]
    return ", ".join(f"top_k {t.top_k}, depth {t.depth}, total_tokens {t.total_tokens}" for t in dict.fromkeys(missing))


def check_engines(directory: Path, manifest: Manifest) -> None:
    """What can be checked without CUDA: engines were built, their files are there."""
    if manifest.engines is None:
        raise EngineError(f"{directory} has no TensorRT engines: run `eagle-export build {directory}` first")
    for name in (*C.ENGINE_GRAPHS, *(n for n in manifest.engines.graphs if n not in C.ENGINE_GRAPHS)):
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
    """One engine, its contexts (one per profile, all on the backend's one block of context memory), the buffers
    allocated once for its calls, and what each context has been given (so a call sets only what changed)."""

    def __init__(self, backend: TrtBackend, name: str, path: Path, spec: GraphSpec, profiles: list[Profile]):
        trt = backend.lib.module
        mem = backend.mem
        self.name = name
        self.path = path
        self.spec = spec  # the engine's IO: the graph's, with what `build` appended (builder.engine_spec)
        self.profiles = profiles
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
        from eagle_export.engines.builder import dtype_name

        for t in (*spec.inputs, *spec.outputs):  # what the engine takes and gives, asked of the engine itself
            got = dtype_name(engine.get_tensor_dtype(t.name))
            if got != t.dtype:
                raise EngineError(f"engine {path}: {t.name} is {got} in the engine, the manifest says {t.dtype}: "
                                  f"rebuild it with `eagle-export build {path.parent}`")
        if engine.num_optimization_profiles != len(profiles):
            raise EngineError(f"engine {path} has {engine.num_optimization_profiles} profiles, its manifest lists "
                              f"{len(profiles)}: rebuild it")
        self.memory_needed = max(engine.get_device_memory_size_for_profile_v2(i) for i in range(len(profiles)))
        self.runtime_cache = None
        self.runtime_config = None  # TensorRT-RTX: must outlive the contexts made from it
        self.contexts: list = []
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
        self.plans: dict[tuple, CallPlan] = {}  # per call shape (see TrtBackend.run)
        self.shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in profiles]  # per context: what it was given
        self.addresses: list[dict[str, int]] = [{} for _ in profiles]
        self.checked: list[set[tuple]] = [set() for _ in profiles]  # plans whose output shapes it confirmed

    def create_contexts(self, backend: TrtBackend, memory: int, size: int) -> None:
        """One context per profile, each bound to its profile once, all on the same context memory (calls run one
        at a time on the backend's one stream, so they never use it together)."""
        trt = backend.lib.module
        user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        config = None
        if backend.lib.is_rtx:
            config = self.engine.create_runtime_config()
            config.set_execution_context_allocation_strategy(user_managed)
            config.dynamic_shapes_kernel_specialization_strategy = getattr(
                trt.DynamicShapesKernelSpecializationStrategy, backend.rtx_shape_strategy.upper())
            self.runtime_cache = config.create_runtime_cache()
            blob_path = backend.runtime_cache_path(self)
            if blob_path is not None and blob_path.is_file():
                if not self.runtime_cache.deserialize(blob_path.read_bytes()):
                    log.info("runtime cache %s does not match this GPU/driver/TensorRT-RTX: starting empty", blob_path)
            config.set_runtime_cache(self.runtime_cache)
            self.runtime_config = config
        stream = backend.stream.cuda_stream
        for i in range(len(self.profiles)):
            ctx = (self.engine.create_execution_context(config) if config is not None
                   else self.engine.create_execution_context(user_managed))
            if ctx is None:
                raise EngineError(f"could not create an execution context for profile {i} of {self.path}: "
                                  + "; ".join(backend.logger.errors or ["(TensorRT gave no message)"]))
            ctx.set_device_memory(memory, size)
            try:  # the Python API raises when TensorRT refuses the profile (it returns True otherwise)
                ctx.set_optimization_profile_async(i, stream)
            except Exception as e:
                raise EngineError(f"could not set profile {i} of {self.path} on its execution context: "
                                  + "; ".join(backend.logger.errors or [f"{type(e).__name__}: {e}"])) from None
            self.contexts.append(ctx)


class TrtBackend:
    """Target and draft engines on one CUDA device. Implements ``runtime.backend.Backend``.

    ``lib`` and ``mem`` are the seams to TensorRT and to the device: by default the library the engines were
    built with and ``CudaMemory``; the CPU emulator (``tools/testing/trt_emulator.py``) passes stand-ins for both.

    debug_sync: synchronise after every call, so that a device fault is reported as an EngineError naming the
    graph and profile (default: the ``EAGLE_EXPORT_TRT_DEBUG_SYNC`` environment variable; costs a host round
    trip per call). rtx_shape_strategy (TensorRT-RTX): how its JIT specialises kernels to shapes: "none" (the
    default: generic kernels, no compilation per shape; the loop's cache length changes every call), "lazy"
    (TensorRT-RTX's default: compiles each new shape in the background) or "eager" (compiles it before the
    call). runtime_cache_dir (TensorRT-RTX): where the JIT's runtime cache is kept between processes (default:
    next to the engines; ``save_runtime_cache`` writes it, and so does closing the process).
    """

    name = "tensorrt"
    target_graph = C.TARGET_GRAPH  # engines are built from the standard graphs
    tree_graph = None  # C.DRAFT_TREE_GRAPH where `build` made a tree graph engine (set in __init__)
    tree_depths: dict[int, int] = {}  # top_k -> the depth its tree engine grows (every call runs that depth)
    fixed_tree_depth = True  # an engine is one cut: a shallower tree of its top_k reads its first levels
    accepts_in_graph = False  # the verify engine returns the greedy acceptance (set in __init__)
    tree_selects: dict[int, int] = {}  # top_k -> how many candidates its tree engine selects as a verify tree
    host_memory = False
    last_exec_s = None  # work is queued on a stream: time run + synchronize
    open_s = 0.0  # every engine is opened up front

    def __init__(self, directory: Path, manifest: Manifest, device: int | None = None, *, lib=None, mem=None,
                 debug_sync: bool | None = None, rtx_shape_strategy: str = "none",
                 runtime_cache_dir: Path | None = None):
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
        from eagle_export.engines.libs import cannot_run, load_lib, make_logger

        why = cannot_run(info.lib, mem.compute_capability)
        other = "tensorrt" if info.lib == "tensorrt_rtx" else "tensorrt_rtx"
        if why is None:
            why, other = _not_built_for(info, mem.compute_capability), info.lib
        if why is not None:
            raise EngineError(f"the engines in {directory} were built with {info.lib} {info.lib_version}, which cannot "
                              f"run on this GPU ({mem.gpu_name}): {why}. Rebuild them here with "
                              f"`eagle-export build {directory} --engine-lib {other.replace('_', '-')}`")
        if lib is None:
            lib = load_lib(info.lib)
        self.lib = lib
        if self.lib.version != info.lib_version:
            raise EngineError(f"the engines in {directory} were built with {info.lib} {info.lib_version}, but "
                              f"{self.lib.label} is installed: install that version or rebuild with "
                              f"`eagle-export build {directory}`")
        if rtx_shape_strategy not in RTX_SHAPE_STRATEGIES:
            raise EngineError(f"rtx_shape_strategy {rtx_shape_strategy!r} is not one of {RTX_SHAPE_STRATEGIES}")
        if debug_sync is None:
            debug_sync = os.environ.get("EAGLE_EXPORT_TRT_DEBUG_SYNC", "") not in ("", "0")
        self.debug_sync = debug_sync
        self.rtx_shape_strategy = rtx_shape_strategy
        self.runtime_cache_dir = Path(runtime_cache_dir) if runtime_cache_dir is not None else directory
        self.mem = mem
        self.device = mem.device
        self._h2d = None  # copy_from_host's pinned buffer (allocated at its first use)
        self.max_prefill = int(info.options["max_prefill"])
        self.max_tree_tokens = int(info.options["max_tree_tokens"])
        opener = mem.current_stream()
        self.stream = mem.stream()
        self.logger = make_logger(self.lib)
        self.runtime = self.lib.module.Runtime(self.logger)
        from eagle_export.engines.builder import engine_spec

        self.graphs = {
            name: _TrtGraph(self, name, directory / info.graphs[name].file,
                            engine_spec(manifest, name, info.graphs[name].appended), profiles_of(manifest, name))
            for name in manifest.graphs if name in C.ENGINE_GRAPHS
        }
        self.accepts_in_graph = bool(info.graphs[C.TARGET_GRAPH].appended.get("accept"))
        # The draft tree graph engines (`build` makes one per top_k of the default trees): a round's draft in one call.
        self.tree_depths, self.tree_selects = {}, {}
        for name, e in info.graphs.items():
            call = C.parse_tree_call(name)
            if call is None or C.tree_graph(call[0]) not in manifest.graphs:
                continue
            self.graphs[name] = _TrtGraph(self, name, directory / e.file, engine_spec(manifest, name, e.appended),
                                          profiles_of(manifest, name))
            self.tree_depths[call[0]] = call[1]
            if "select" in e.appended:
                self.tree_selects[call[0]] = int(e.appended["select"])
        self.tree_graph = C.DRAFT_TREE_GRAPH if self.tree_depths else None
        stale = stale_tree_engines(manifest, self.tree_depths, self.tree_selects)
        if stale:
            log.warning("%s: the engines were built for other default trees than the manifest's, or by an older build "
                        "(%s): those trees draft level by level or select on the host; run `eagle-export build %s` "
                        "again (after `tune`, always)", directory, stale, directory)
        # One block of context (activation) memory for every context of both engines: they run one at a time.
        size = max(g.memory_needed for g in self.graphs.values())
        self.context_memory = mem.zeros((max(size, 1),), torch.uint8)
        # The buffers above were zeroed on the opener's stream; the contexts' profile switches and every call run on
        # the backend's: order them after the zeroing, whatever stream the calls come from.
        self.stream.wait_stream(opener)
        for g in self.graphs.values():
            g.create_contexts(self, self.context_memory.data_ptr(), size)
        self.stream.synchronize()
        if self.lib.is_rtx:
            weakref.finalize(self, _save_runtime_caches, [(g.runtime_cache, self.runtime_cache_path(g))
                                                          for g in self.graphs.values()])

    def runtime_cache_path(self, g: _TrtGraph) -> Path | None:
        return self.runtime_cache_dir / (g.path.name + ".runtime_cache")

    def save_runtime_cache(self) -> None:
        """Write TensorRT-RTX's runtime caches (the kernels its JIT compiled), so the next process reuses them."""
        _save_runtime_caches([(g.runtime_cache, self.runtime_cache_path(g)) for g in self.graphs.values()])

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed on the current stream; the backend's stream waits for it, so a call from any stream sees zeros."""
        t = self.mem.zeros(shape, dtype)
        self.stream.wait_stream(self.mem.current_stream())
        return t

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return self.mem.to_host(x)

    def copy_from_host(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """``dst`` (contiguous device memory) = ``src`` (host), queued on the caller's stream without blocking the host:
        through a pinned buffer (torch's copy from pageable memory synchronises the stream), refilled only once its
        previous copy has run (an event)."""
        n = src.nbytes
        if n != dst.nbytes:
            raise ValueError(f"copy_from_host: {n} bytes into a {dst.nbytes}-byte buffer")
        if self._h2d is None or self._h2d.numel() < n:
            self._h2d = self.mem.pinned(max(n, 1), torch.uint8)
            self._h2d_np = self._h2d.numpy()
            self._h2d_done, self._h2d_pending = self.mem.event(), False
        if self._h2d_pending:
            self._h2d_done.synchronize()
        np.copyto(self._h2d_np[:n], np.ascontiguousarray(src).reshape(-1).view(np.uint8))
        self.mem.copy(self.mem.bytes_at(view_of(dst)), self._h2d[:n])
        self._h2d_done.record(self.mem.current_stream())
        self._h2d_pending = True

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
            self.mem.copy(g.staging[b.name][:n], self.mem.bytes_at(x))
            return
        if g.h2d_pending:  # the pinned buffers may still feed the previous call's copies
            g.h2d_done.synchronize()
            g.h2d_pending = False
        np.copyto(g.pinned_np[b.name][:n], host_array(x._replace(dtype="uint8", shape=(n,))))
        self.mem.copy(g.staging[b.name][:n], g.pinned[b.name][:n])

    def _plan(self, g: _TrtGraph, inputs: dict, outputs: dict) -> tuple[CallPlan, tuple]:
        """The call's plan, made once per call shape: every view's dtype, shape, device and alignment (what the
        planner's decisions depend on). Direct bindings take the view's current address at each call."""
        key = (tuple((n, v[1], v[2], v[3], v[0] % TRT_ADDRESS_ALIGNMENT == 0) for n, v in inputs.items()),
               tuple((n, v[1], v[2], v[3], v[0] % TRT_ADDRESS_ALIGNMENT == 0) for n, v in outputs.items()))
        plan = g.plans.get(key)
        if plan is None:
            plan = g.planner.plan(inputs, outputs)
            if len(g.plans) >= MAX_PLANS:  # bounded: a long session meets one shape per cache length
                g.plans.clear()
            g.plans[key] = plan
        return plan, key

    def run(self, graph: str, inputs: dict, outputs: dict) -> None:
        """Plan (cached per call shape), stage host inputs, give the profile's context only the shapes and
        addresses that changed since its last call, and enqueue; the caller's stream waits for the work."""
        g = self.graphs[graph]
        inputs = {n: x if type(x) is BufferView else view_of(x) for n, x in inputs.items()}
        outputs = {n: x if type(x) is BufferView else view_of(x) for n, x in outputs.items()}
        plan, key = self._plan(g, inputs, outputs)
        caller = self.mem.current_stream()
        self.stream.wait_stream(caller)
        try:
            with self.mem.on(self.stream):
                self._enqueue(g, plan, key, inputs, outputs)
        finally:  # even after an error: work the caller queues next comes after this call's copies
            caller.wait_stream(self.stream)

    def _set_address(self, graph: str, p: int, ctx, addresses: dict, name: str, address: int) -> None:
        """``set_tensor_address``, whose False (a rejected address) would otherwise leave the previous one bound."""
        self.logger.reset()
        if not ctx.set_tensor_address(name, address):
            addresses.pop(name, None)
            raise EngineError(f"{graph}: TensorRT rejected address {address:#x} for {name} (profile {p}): "
                              + "; ".join(self.logger.errors or ["(TensorRT gave no message)"]))
        addresses[name] = address

    def _enqueue(self, g: _TrtGraph, plan: CallPlan, key: tuple, inputs: dict, outputs: dict) -> None:
        """Stage, give the profile's context what changed, execute on the backend's stream (and, with debug_sync,
        wait for it), queue the copies of outputs bound through scratch."""
        graph, p, s, mem = g.name, plan.profile, self.stream, self.mem
        ctx, shapes, addresses = g.contexts[p], g.shapes[p], g.addresses[p]
        staged = False
        try:
            for b in plan.inputs:
                name = b.name
                if b.stage is not None:
                    staged = staged or b.stage == "h2d"
                    self._stage(g, b, inputs[name])
                    address = b.address
                else:
                    address = inputs[name][0]
                if shapes.get(name) != b.shape:
                    if not ctx.set_input_shape(name, b.shape):
                        shapes.pop(name, None)
                        raise EngineError(f"{graph}: TensorRT refused shape {list(b.shape)} for {name} "
                                          f"(profile {p}): " + "; ".join(self.logger.errors))
                    shapes[name] = b.shape
                if addresses.get(name) != address:
                    self._set_address(graph, p, ctx, addresses, name, address)
        finally:
            if staged:  # recorded even when a later input failed: the next call waits for these copies
                g.h2d_done.record(s)
                g.h2d_pending = True
        if key not in g.checked[p]:
            for b in plan.outputs:
                got = tuple(ctx.get_tensor_shape(b.name))
                if got != b.shape:
                    raise EngineError(f"{graph}: the engine computes {b.name} as {list(got)}, the caller's buffer "
                                      f"is {list(b.shape)}")
            g.checked[p].add(key)
        for b in plan.outputs:
            address = b.address if b.copy_back else outputs[b.name][0]
            if addresses.get(b.name) != address:
                self._set_address(graph, p, ctx, addresses, b.name, address)
        self.logger.reset()
        if not ctx.execute_async_v3(s.cuda_stream):
            raise EngineError(f"{graph}: TensorRT execution failed (profile {p}): "
                              + "; ".join(self.logger.errors or ["(TensorRT gave no message)"]))
        if self.debug_sync:
            try:
                s.synchronize()
            except Exception as e:  # a CUDA fault: name the call it came from
                raise EngineError(f"{graph}: the call failed on the device (profile {p}, "
                                  f"{g.profiles[p].name}; axes {plan.axes}): {e}") from e
        for b in plan.outputs:
            if b.copy_back:
                v = outputs[b.name]
                mem.copy(mem.bytes_at(v), g.scratch[b.name][:v.nbytes])


def _save_runtime_caches(caches: list[tuple[object, Path | None]]) -> None:
    for cache, path in caches:
        if cache is None or path is None:
            continue
        try:
            path.write_bytes(bytes(cache.serialize()))
        except Exception as e:  # a read-only artifact, or TensorRT torn down at exit: the next process compiles again
            log.warning("could not write the TensorRT-RTX runtime cache %s: %s", path, e)

"""ONNX Runtime backend: one session per graph, every input and output bound in place with IO binding."""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnxruntime as ort
import torch

from eagle_export import contract as C
from eagle_export.dtypes import DTYPES, ORT_GRAPH_DTYPES
from eagle_export.errors import ManifestError
from eagle_export.manifest import Manifest
from eagle_export.tree_params import TreeParams

from .shared_weights import SHARED_CONFIG, SharedWeights
from .views import BufferView, SplitInputs, view_of

log = logging.getLogger(__name__)


# ONNX Runtime's intra-op thread spinning, per session (docs/runtime.md, "Threading"):
#   "off": never spin (threads sleep between the parallel parts of a call, and after it);
#   "run": spin while a call runs, stop as it returns (the loop's host work between calls keeps its core);
#   "on":  ONNX Runtime's default, spin on after a call too (for back-to-back calls with no host work between).
SPIN_POLICIES = ("off", "run", "on")
# Per phase by default: the target's calls spin while they run ("run": plain decoding 0.87x ORT GenAI fp32 instead of
# 0.77x), the draft's never (EAGLE 1.53x the peer either way, within noise; measured side by side, docs/runtime.md).
DEFAULT_PHASES = {"target": "run", "draft": "off"}
DEFAULT_SPIN = ",".join(f"{k}={v}" for k, v in DEFAULT_PHASES.items())
# Draft tree graph sessions (each a top_k's graph cut to a depth) kept open at once: each but a chain's holds its own
# copy of the draft head's weights (``shares_draft_weights``), and each costs its open time, so a runtime that meets
# many trees (tune, requests with trees of their own) reopens them.
TREE_SESSIONS = 2


def parse_spin(spin: str) -> dict[str, str]:
    """The spin policy of each phase's sessions: ``"run"`` (every session), or per phase ``"target=run,draft=off"``
    (the target graph's session, and the draft graphs' sessions: a round alternates between the two phases, and each
    session has a thread pool of its own). A phase left out gets the default."""
    if spin in SPIN_POLICIES:
        return {"target": spin, "draft": spin}
    got = dict(DEFAULT_PHASES)
    for part in str(spin).split(","):
        role, _, policy = part.strip().partition("=")
        if role not in got or policy not in SPIN_POLICIES:
            raise ValueError(f"spin must be one of {', '.join(SPIN_POLICIES)}, or per phase like "
                             f"'target=run,draft=off', got {spin!r}")
        got[role] = policy
    return got


def quantized_session_config(manifest: Manifest | None) -> dict[str, str]:
    """Session config entries a quantized artifact needs: the accuracy level ONNX Runtime gives the MatMulNBits it
    fuses from a ``DequantizeLinear -> MatMul`` graph (the qdq form), the one the export chose."""
    q = None if manifest is None else manifest.quantization
    return {} if q is None else {"session.qdq_matmulnbits_accuracy_level": str(q.accuracy_level)}


# MatMulNBits' float kernel (accuracy level 1: the weights dequantized, float products): what the runtime gives the
# standard target graph of an artifact whose level rounds the activations (2 and up; 4: int8).
FLOAT_ACCURACY_LEVEL = 1


def runtime_session_config(manifest: Manifest | None, graph: str) -> dict[str, str]:
    """The session config the runtime gives ``graph``: the export's accuracy level (``quantized_session_config``),
    except for the standard target graph of an artifact whose level rounds the activations, which runs float
    products: int4 at ``FLOAT_ACCURACY_LEVEL``, int8 with its ``DequantizeLinear -> MatMul`` left unfused (ONNX
    Runtime then folds the weights to float at load: MatMulNBits' 8-bit float kernel is 3-5x slower than level 4
    on the fixture, float weights 1.1-1.4x, held in float in memory).

    That graph's attention sums a row's past and new columns as separate products, split where the call starts,
    and softmaxes over the call's whole width, so a row verified in a tree and the same row decoded alone differ in
    their last bits; at level 4 those bits can flip an int8 rounding of the next MatMul's input and grow from layer
    to layer (tools/lab/results.md, "Why quantized EAGLE diverged"), while float products keep them at the float graph's
    size, where EAGLE equals plain decoding as it does on a float artifact. The fused graph (ONNX Runtime's fast
    path) is exact for chains at level 4 and keeps the export's level."""
    config = quantized_session_config(manifest)
    q = None if manifest is None else manifest.quantization
    if q is not None and graph == C.TARGET_GRAPH and q.rounds_activations:
        if q.bits == 8:  # MatMulNBits' 8-bit float kernel is 3-5x its level 4 here: float weights are 1.1-1.4x
            del config["session.qdq_matmulnbits_accuracy_level"]
            config["session.disable_quant_qdq"] = "1"
        else:
            config["session.qdq_matmulnbits_accuracy_level"] = str(FLOAT_ACCURACY_LEVEL)
    return config


def shares_draft_weights(manifest: Manifest, device: str) -> bool:
    """Whether the chain tree graphs' sessions compute from one shared copy of their weights, pre-packing off
    (``runtime/shared_weights.py``; ``shared_session``): a float32 artifact on the CPU provider whose draft graphs are
    not quantized. A quantized draft's weights become MatMulNBits, whose kernel needs its pre-packed form; float16
    weights are widened to float32 per session anyway; the CUDA provider copies weights to the device."""
    q = manifest.quantization
    return device == "cpu" and manifest.dtype == "float32" and (q is None or not q.draft)


def shared_session(name: str) -> bool:
    """Whether graph call ``name`` runs on the shared weights (where ``shares_draft_weights``): a chain's tree graph
    (top_k 1), whose levels are one row each, where MLAS reads a weight as stored no slower than pre-packed. The
    step graph and wider trees run 2 to 64 rows a call, 1.4-2.4x slower without pre-packing: they keep their own
    pre-packed copies (docs/runtime.md, "Draft weights in memory")."""
    call = C.parse_tree_call(name)
    return call is not None and call[0] == 1


def session_options(threads: int | None, spin: str = "off",
                    config: dict[str, str] | None = None) -> ort.SessionOptions:
    """The runtime's ONNX Runtime session options: full graph optimisation, ``threads`` intra-op threads, a spin
    policy of ``SPIN_POLICIES``, and ``config`` (session config entries)."""
    if spin not in SPIN_POLICIES:
        raise ValueError(f"spin must be one of {', '.join(SPIN_POLICIES)}, got {spin!r}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0" if spin == "off" else "1")
    if spin == "run":
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return opts


class OrtGraph:
    """One graph, one session, one IO binding reused for every call."""

    def __init__(self, path: Path, providers: list[str], threads: int | None = None, spin: str = "off",
                 config: dict[str, str] | None = None, model: bytes | None = None,
                 initializers: dict[str, ort.OrtValue] | None = None):
        """path: the graph file; model: the graph as bytes instead (a draft tree graph cut to fewer levels), its
        external data read from path's folder. initializers: values the session takes instead of the graph's own
        (shared with other sessions: the caller keeps them alive as long as this session)."""
        opts = session_options(threads, spin, config)
        for name, value in (initializers or {}).items():
            opts.add_initializer(name, value)
        if model is not None:
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        try:
            self.session = ort.InferenceSession(str(path) if model is None else model, sess_options=opts,
                                                providers=providers)
        except Exception as e:
            raise ManifestError(f"could not load graph {path} (corrupt or truncated? re-export): {e}") from e
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        self._rebind_host = self.device != "cpu"  # a CUDA session copies host inputs when they are bound
        self.binding = self.session.io_binding()
        # ONNX Runtime's public bind_input/bind_output build an OrtDevice on every call (~2/3 of a bind's cost, and a
        # target call binds 2 x layers cache views); the C binding takes one made once. Private API of the pinned
        # onnxruntime: without it the public calls are used.
        self._raw = getattr(self.binding, "_iobinding", None)
        # The same for the run: the public run_with_iobinding checks for WebGPU graph capture (never used here) on
        # every call before it calls the C binding.
        raw_session = getattr(self.session, "_sess", None)
        if self._raw is None or raw_session is None:
            self._run = partial(self.session.run_with_iobinding, self.binding)
        else:
            self._run = partial(raw_session.run_with_iobinding, self._raw, None)
        self._devices: dict[tuple[str, int], object] = {}
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_names = {o.name for o in self.session.get_outputs()}
        self._n_in = len(self.input_names)
        self._bound_in: dict[str, BufferView] = {}  # name -> what it is bound to now
        self._bound_out: dict[str, BufferView] = {}
        self._same_outputs = None  # the read-only outputs mapping of the last run, when it was one
        self._same_fixed = None  # the read-only fixed part of the last run's SplitInputs, when it was one
        self.last_exec_s = 0.0

    def run(self, inputs: dict, outputs: dict) -> None:
        """Bind every input and output by address (no copy) and run.

        Values are BufferViews (runtime/views.py), or contiguous tensors and arrays (viewed here).
        ``outputs`` may be a read-only ``types.MappingProxyType``: passed again as the same object, its
        bindings are taken as they are (the generator makes one per call shape; nothing can change it); so may
        the ``fixed`` part of ``SplitInputs``.

        The IO binding keeps its bindings between runs, so a name is rebound only when its address,
        type or shape changed: in a round most calls move only the cache views. Host inputs of a
        CUDA session are rebound on every call, because ONNX Runtime copies them to the device when
        they are bound (the same address may hold new values).
        """
        # Right after a graph run the host's caches are cold and every name touched costs ~1 us, so the checks stay
        # cheap: a count here, and a name this graph lacks is refused when it is bound (in _bind).
        if len(inputs) != self._n_in:
            self._refuse(f"got {sorted(inputs)} and {sorted(outputs)}")
        bound, rebind_host = self._bound_in, self._rebind_host
        split = type(inputs) is SplitInputs
        # the fixed part of split inputs, bound by the last run as it is (read-only): only the rest is looked at
        same = split and not rebind_host and inputs.fixed is self._same_fixed
        self._same_fixed = None  # until every input is bound (a bind that fails leaves the bindings unknown)
        for name, x in (inputs.changing if same else inputs).items():
            if type(x) is not BufferView:
                x = view_of(x)
            if bound.get(name) != x or (rebind_host and x[3] == "cpu"):
                self._bind(name, x, True)
        self._same_fixed = inputs.fixed if split and type(inputs.fixed) is MappingProxyType else None
        if outputs is not self._same_outputs:  # a read-only mapping seen last run: every output is bound already
            if outputs.keys() != self.output_names:
                self._refuse(f"got {sorted(inputs)} and {sorted(outputs)}")
            bound = self._bound_out
            for name, x in outputs.items():
                if type(x) is not BufferView:
                    x = view_of(x)
                if bound.get(name) != x:
                    self._bind(name, x, False)
            self._same_outputs = outputs if type(outputs) is MappingProxyType else None
        t0 = time.perf_counter()
        self._run()
        self.last_exec_s = time.perf_counter() - t0

    def _refuse(self, got: str):
        raise ValueError(f"run needs exactly the graph's inputs {sorted(self.input_names)} and outputs "
                         f"{sorted(self.output_names)}, {got}")

    def _bind(self, name: str, key: BufferView, is_input: bool) -> None:
        if name not in (self.input_names if is_input else self.output_names):
            self._refuse(f"{name!r} is not one of them")
        ptr, dtype, shape, dev, idx = key
        typ = DTYPES[dtype].numpy
        if self._raw is None:
            (self.binding.bind_input if is_input else self.binding.bind_output)(name, dev, idx, typ, shape, ptr)
            (self._bound_in if is_input else self._bound_out)[name] = key
            return
        device = self._devices.get((dev, idx))
        if device is None:  # what the public calls build each time
            from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

            device = self._devices[dev, idx] = OrtDevice.make(dev, idx)._get_c_device()
        if is_input:
            self._raw.bind_input(name, device, typ, list(shape), ptr)  # a list: pybind converts it faster than a tuple
            self._bound_in[name] = key
        else:
            self._raw.bind_output(name, device, typ, list(shape), ptr)
            self._bound_out[name] = key


class OrtBackend:
    """Target and draft graphs on ONNX Runtime: CPU, or the CUDA provider when it and a CUDA torch exist.

    Implements ``runtime.backend.Backend``. ``run`` is synchronous: outputs are written when it returns.
    """

    name = "ort"
    max_prefill = None  # any prefill chunk: the graphs' axes are dynamic

    def __init__(self, directory: Path, manifest: Manifest, providers: list[str] | None = None,
                 threads: int | None = None, fused: bool = True, spin: str = DEFAULT_SPIN, draft_tree: bool = True):
        """fused: run the fused target graph where the artifact has one (False: the standard graph, to compare).
        draft_tree: run the draft tree graph where the artifact has one (False: the step graph alone, to compare).
        spin: the intra-op threads' spin policy (``SPIN_POLICIES``), or one per phase (``parse_spin``)."""
        if manifest.dtype not in ORT_GRAPH_DTYPES:
            raise ManifestError(
                f"{directory} holds {manifest.dtype} graphs, which the ort backend cannot run (ONNX Runtime's CPU "
                "provider has no kernels for them): build engines (`eagle-export build`) and use --backend tensorrt, "
                "or export with --dtype fp16/fp32"
            )
        available = ort.get_available_providers()
        if providers is None:
            use_cuda = "CUDAExecutionProvider" in available and torch.cuda.is_available()
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]
        self.providers = providers
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        # A quantized artifact's MatMulNBits take float16 natively (tools/lab/results.md): only its float MatMuls widen.
        if self.device == "cpu" and manifest.dtype == "float16" and manifest.quantization is None:
            # Measured in tools/lab/results.md ("Opening an artifact on ONNX Runtime CPU"): 2.09x the weights at 1B.
            log.warning("%s holds float16 graphs: ONNX Runtime's CPU provider converts their MatMul weights to "
                        "float32 when it loads them (it has no float16 MatMul on most x86 CPUs), so they take about "
                        "twice the artifact's weights in memory and run no faster than fp32; export with --dtype fp32 "
                        "for the CPU, fp16 for GPUs", directory)
        self.host_memory = self.device == "cpu"
        self.last_exec_s: float | None = 0.0
        # Seconds spent opening sessions when first run (``graph``): inside a round, not the round's cost (the loop
        # leaves it out of the guard's round times and bench's split).
        self.open_s = 0.0
        # The graphs this backend runs (the fused target graph where the artifact has one), and only those.
        # The fused graph on the CPU provider only: it is what was checked (its CUDA kernels take other restrictions
        # and have not run here).
        fused = fused and self.device == "cpu"
        self.target_graph = C.graph_for(self.name, "target", manifest.graphs if fused else {})
        # The draft tree graphs (contract 6): top_k -> (graph, the most levels it grows). A round's tree runs as
        # ``C.tree_call(top_k, depth)``: the graph cut to its depth, opened when first run (``_open_tree``).
        self.tree_graphs = C.tree_graphs(manifest.graphs) if draft_tree else {}
        self.tree_graph = C.DRAFT_TREE_GRAPH if self.tree_graphs else None
        self.tree_depths = {k: most for k, (_, most) in self.tree_graphs.items()}
        self.fixed_tree_depth = False  # each depth's call is the graph cut to it (_open_tree)
        # The host selects and accepts: on the CPU provider some fifty small nodes cost more (docs/engines.md).
        self.accepts_in_graph, self.tree_selects = False, {}
        self.spin = spin
        self._directory, self._manifest, self._providers, self._threads = Path(directory), manifest, providers, threads
        self._policy = parse_spin(spin)
        # One copy of the draft weights for the sessions that share it (``shared_session``; None: none do).
        self.shared = None
        if self.tree_graphs.get(1) and shares_draft_weights(manifest, self.device):
            self.shared = SharedWeights(directory)
            # The step graph stores in the other layout the matrices a tree graph reads through a Transpose.
            self.shared.index(_load_structure(self._directory / manifest.graphs[C.DRAFT_GRAPH].file))
        self.graphs = {self.target_graph: self._open(self.target_graph)}
        self._tree_calls: list[str] = []  # the cut tree graphs open now, least recently opened first
        tree = manifest.tree_defaults.trimmed()  # the default tree's call opens now: its first round loads nothing
        if tree.top_k in self.tree_graphs and 1 <= tree.depth <= self.tree_graphs[tree.top_k][1]:
            self._open_tree(C.tree_call(tree.top_k, tree.depth))
            # The step graph opens when first run: where the default tree has a tree graph, a request that drafts
            # well never runs it (the tree graph makes the prompt's draft context too), and its session would hold
            # a pre-packed copy of the head (docs/runtime.md, "Draft weights in memory"). Its file is checked now.
            _check_graph_file(self._directory, manifest.graphs[C.DRAFT_GRAPH])
        else:
            self.graphs[C.DRAFT_GRAPH] = self._open(C.DRAFT_GRAPH)

    def _open(self, name: str, base: str | None = None, proto=None, changed: bool = False) -> OrtGraph:
        """A session for graph ``name`` (``base``'s file; ``proto``: the graph without its weights, when read, and
        loaded from it when ``changed``: a tree graph cut to fewer levels), checked against the manifest's spec of
        ``base``. A chain's tree graph takes the shared weights where the runtime shares them."""
        base = base or name
        g = self._manifest.graphs[base]
        role = "target" if name == self.target_graph else "draft"
        config, initializers = runtime_session_config(self._manifest, base), None
        if self.shared is not None and shared_session(name):
            initializers, rewritten = self.shared.prepare(proto)
            changed = changed or rewritten
            config.update(SHARED_CONFIG)
        model = proto.SerializeToString() if changed else None
        session = OrtGraph(self._directory / g.file, self._providers, self._threads, self._policy[role], config, model,
                           initializers)
        if set(g.spec.input_names) != session.input_names or set(g.spec.output_names) != session.output_names:
            raise ManifestError(
                f"graph {g.file} does not have the inputs/outputs its manifest lists (another export's file?): "
                "re-export"
            )
        _check_types_and_dims(g.file, g.spec, [(a.name, a.type, a.shape) for a in (*session.session.get_inputs(),
                                                                                   *session.session.get_outputs())])
        return session

    def _open_tree(self, call: str) -> OrtGraph:
        """The session of a tree call (``C.tree_call``): the top_k's graph cut to the call's depth. At most
        ``TREE_SESSIONS`` stay open; the oldest other goes."""
        parsed = C.parse_tree_call(call)
        if parsed is None or parsed[0] not in self.tree_graphs:
            raise KeyError(f"no draft tree graph for {call!r}")
        (k, depth), (base, most) = parsed, self.tree_graphs[parsed[0]]
        if not 1 <= depth <= most:
            raise KeyError(f"the draft tree graph for top_k {k} grows {most} levels, not {depth}")
        proto = None
        if depth < most or (self.shared is not None and shared_session(call)):
            from .tree_graph import cut

            proto = _load_structure(self._directory / self._manifest.graphs[base].file)
            cut(proto, k, depth, most)
        while len(self._tree_calls) >= TREE_SESSIONS:
            del self.graphs[self._tree_calls.pop(0)]
        session = self.graphs[call] = self._open(call, base, proto, depth < most)
        self._tree_calls.append(call)
        return session

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # torch's CPU allocator aligns to 64 bytes, its CUDA allocator to 512; ONNX Runtime needs no more.
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def check_tree(self, tree: TreeParams) -> None:
        """Any tree within the artifact's limits runs (the graphs' axes are dynamic)."""

    def graph(self, name: str) -> OrtGraph:
        """The session of graph call ``name``, opened now if it is not open: the step graph before its first call,
        or a draft tree graph cut to a depth not run yet."""
        g = self.graphs.get(name)
        if g is None:
            t0 = time.perf_counter()
            g = self.graphs[name] = self._open(name) if name == C.DRAFT_GRAPH else self._open_tree(name)
            self.open_s += time.perf_counter() - t0
        return g

    def run(self, graph: str, inputs: dict, outputs: dict) -> None:
        g = self.graph(graph)
        g.run(inputs, outputs)
        self.last_exec_s = g.last_exec_s  # graph execution alone, IO binding excluded (bench's split reads it)

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return x.numpy() if x.device.type == "cpu" else x.cpu().numpy()  # a CUDA session's run has synchronised

    def copy_from_host(self, dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)).reshape(dst.shape))

    def synchronize(self) -> None:
        """Nothing to wait for: ``run`` returns when the graph has run."""


def _load_structure(path: Path):
    """A graph file without its weights; a corrupt or truncated one is a ManifestError, as a session's load is."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise ManifestError(f"could not load graph {path} (corrupt or truncated? re-export): {e}") from e


def _check_graph_file(directory: Path, graph) -> None:
    """What opening ``graph`` (a manifest entry) would refuse, without a session: a corrupt or truncated graph file,
    a weights file missing or shorter than its tensors need, inputs and outputs other than the manifest's. For a
    graph the runtime opens when first run: a broken artifact is refused at open, not in the middle of a request."""
    import onnx

    path = directory / graph.file
    proto = _load_structure(path)
    sizes: dict[str, int] = {}
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if loc not in sizes:
            f = directory / loc
            sizes[loc] = f.stat().st_size if f.is_file() else -1
        need = int(info.get("offset", 0)) + int(info.get("length", 0))
        if sizes[loc] < need:
            what = "is missing" if sizes[loc] < 0 else f"holds {sizes[loc]} bytes, {t.name} needs {need}"
            raise ManifestError(f"could not load graph {path} (corrupt or truncated? re-export): its weights file "
                                f"{directory / loc} {what}")
    inits = {t.name for t in proto.graph.initializer}
    ins = {i.name for i in proto.graph.input} - inits
    outs = {o.name for o in proto.graph.output}
    if set(graph.spec.input_names) != ins or set(graph.spec.output_names) != outs:
        raise ManifestError(f"graph {graph.file} does not have the inputs/outputs its manifest lists (another "
                            "export's file?): re-export")
    args = []
    for arg in (*proto.graph.input, *proto.graph.output):
        if arg.name in inits:
            continue
        tt = arg.type.tensor_type
        typ = f"tensor({onnx.TensorProto.DataType.Name(tt.elem_type).lower()})"  # as ONNX Runtime names it
        args.append((arg.name, typ, [d.dim_value if d.HasField("dim_value") else "?" for d in tt.shape.dim]))
    _check_types_and_dims(graph.file, graph.spec, args)


def _check_types_and_dims(file: str, spec, args) -> None:
    """Each graph tensor's dtype and fixed dims must be the manifest's: else the manifest is another model's.
    args: (name, ONNX Runtime's type string, shape) of every input and output (a dim not an int is not checked)."""
    by_name = {t.name: t for t in (*spec.inputs, *spec.outputs)}
    for name, typ, shape in args:
        want = by_name[name]
        dims_ok = len(shape) == len(want.shape) and all(
            isinstance(w, str) or not isinstance(g, int) or g == w for g, w in zip(shape, want.shape, strict=True))
        known = DTYPES.get(want.dtype)
        if known is None or known.ort != typ or not dims_ok:
            raise ManifestError(
                f"graph {file}: {name} is {typ} {list(shape)} but the manifest says {want.dtype} "
                f"{list(want.shape)} (a manifest from another model or export?): re-export"
            )

"""`eagle-export build`: parse each ONNX graph of an artifact, build a TensorRT engine with the optimisation
profiles of ``profiles.py``, serialize it next to the graph, and record what was built in the manifest.

- Strongly typed networks: every layer keeps the dtype the ONNX graph gives it (fp32, fp16 or bf16 exports;
  logits and top-k log-probs stay float32), so no precision flag is set, and TF32 is switched off.
- Progress: a bar over the graphs whose postfix follows TensorRT's build phases (IProgressMonitor).
- Errors: a failed parse or build raises EngineError with the graph, the file, the library and version,
  the profiles (for a build) and TensorRT's own messages (parser errors with their node, logger errors).
- Atomic: engines are written to temporary files and renamed, then the manifest is rewritten atomically;
  a failed build leaves the artifact as it was.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from eagle_export import contract as C
from eagle_export.contract import GraphSpec
from eagle_export.dtypes import BY_TRT
from eagle_export.errors import EngineError
from eagle_export.manifest import EngineEntry, EnginesInfo, load_manifest
from eagle_export.progress import progress_bar

from .libs import RTX_BUILD_FOR, TrtLib, capability_text, load_lib, make_builder, make_logger
from .profiles import (
    Profile,
    ProfileOptions,
    graph_profiles,
    resolve_options,
    select_count,
    tree_engine_calls,
    tree_profiles,
)

log = logging.getLogger(__name__)

ENGINE_SUFFIX = ".engine"
SHOWN_PHASE_DEPTH = 3  # TensorRT build phases shown on the progress bar (deeper ones change too fast to read)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int | None) -> int | None:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes (binary units). None stays None."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise EngineError(f"--workspace {text!r} is not a size (examples: 512M, 2G, 1073741824)")
    scale = 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise EngineError(f"--workspace must be positive, got {text!r}")
    return value


@dataclass
class BuildOptions:
    engine_lib: str = "auto"
    max_batch: int | None = None  # None: the artifact's (export --max-batch)
    max_prefill: int | None = None
    max_tree_tokens: int | None = None
    workspace: int | None = None  # bytes for TensorRT's WORKSPACE pool; None: TensorRT's default
    timing_cache: Path | None = None  # read if present, written after the builds (tensorrt only)


@dataclass
class BuiltEngine:
    data: bytes
    build_s: float
    profiles: list[Profile]  # as TensorRT read them back from the optimisation profiles
    warnings: list[str] = field(default_factory=list)


def dtype_name(dt) -> str:
    """TensorRT DataType -> the contract's dtype name (eagle_export.dtypes); an unknown one by its own name."""
    member = getattr(dt, "name", str(dt).rsplit(".", 1)[-1])
    known = BY_TRT.get(member)
    return known.name if known is not None else str(dt)


def _make_monitor(lib: TrtLib, bar):
    """An IProgressMonitor that shows the current build phase on the bar (None if the module has none)."""
    trt = lib.module
    if bar is None or not hasattr(trt, "IProgressMonitor"):
        return None

    class _Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.phases: list[str] = []

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.phases.append(phase_name)
            if len(self.phases) <= SHOWN_PHASE_DEPTH:
                self._show()

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            depth = len(self.phases)
            if phase_name in self.phases:
                self.phases.remove(phase_name)
            if depth <= SHOWN_PHASE_DEPTH:
                self._show()

        def _show(self):
            try:
                bar.set_postfix_str(" > ".join(self.phases[1:SHOWN_PHASE_DEPTH]), refresh=True)
            except Exception:  # a display problem must never break a build
                pass

    return _Monitor()


def _parser_errors(parser) -> list[str]:
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        desc = e.desc() if hasattr(e, "desc") else str(e)
        where = []
        node = e.node() if hasattr(e, "node") else -1
        if node is not None and node >= 0:
            where.append(f"node {node}")
        for attr, label in (("node_name", ""), ("node_operator", "op ")):
            value = getattr(e, attr, None)
            value = value() if callable(value) else value
            if value:
                where.append(f"{label}{value}")
        out.append(f"{desc}" + (f" [{', '.join(where)}]" if where else ""))
    return out


def _check_network(net, spec: GraphSpec, profiles: list[Profile], where: str) -> None:
    """The parsed network's IO must be the contract's: names, dtypes, fixed dims; profiles must cover every input."""
    ins = {net.get_input(i).name: net.get_input(i) for i in range(net.num_inputs)}
    outs = {net.get_output(i).name: net.get_output(i) for i in range(net.num_outputs)}
    if set(ins) != set(spec.input_names) or set(outs) != set(spec.output_names):
        raise EngineError(
            f"{where}: the network's inputs {sorted(ins)} / outputs {sorted(outs)} are not the manifest's "
            f"{sorted(spec.input_names)} / {sorted(spec.output_names)} (another export's file?): re-export"
        )
    for t in (*spec.inputs, *spec.outputs):
        tensor = ins.get(t.name) or outs[t.name]
        got = dtype_name(tensor.dtype)
        if got != t.dtype:
            raise EngineError(f"{where}: {t.name} is {got} in the network, the manifest says {t.dtype}: re-export")
        shape = tuple(tensor.shape)
        fixed_ok = len(shape) == len(t.shape) and all(
            isinstance(w, str) or g in (w, -1) for g, w in zip(shape, t.shape, strict=True))
        if not fixed_ok:
            raise EngineError(f"{where}: {t.name} has shape {shape} in the network, the manifest says "
                              f"{list(t.shape)}: re-export")
    for p in profiles:
        missing = [n for n, s in ins.items() if -1 in tuple(s.shape) and n not in p.shapes]
        extra = [n for n in p.shapes if n not in ins]
        if missing or extra:
            raise EngineError(f"{where}: profile {p.name} lacks inputs {missing} / names unknown inputs {extra}")
        for n, mmo in p.shapes.items():
            net_shape = tuple(ins[n].shape)
            for s in mmo:
                if len(s) != len(net_shape) or any(d != -1 and d != v for d, v in zip(net_shape, s, strict=True)):
                    raise EngineError(f"{where}: profile {p.name} gives input {n} shape {list(s)}, which does not "
                                      f"fit the network's {list(net_shape)}")


def profile_deviations(spec: GraphSpec, profile: Profile) -> list[str]:
    """Inputs whose min/opt/max shape differs from what the profile's axes give (total_len = past_len + new_tokens)."""
    out = []
    for i, point in enumerate(("min", "opt", "max")):
        axes = {a: v[i] for a, v in profile.axes.items()}
        for t in spec.inputs:
            if t.name not in profile.shapes:
                continue
            want = tuple(axes.get(d, -1) if isinstance(d, str) else d for d in t.shape)
            got = tuple(profile.shapes[t.name][i])
            if got != want:
                out.append(f"profile {profile.name} {point} {t.name} {list(got)} (axes give {list(want)})")
    return out


def rtx_targets(lib: TrtLib, dtype: str) -> list[str]:
    """The ``ComputeCapability`` members of ``RTX_BUILD_FOR`` this TensorRT-RTX module names, less Turing (7.5) for
    float32 and bfloat16 graphs: TensorRT-RTX 1.7 refuses to compile FP32 GEMMs for SM75 ("FP32 GEMM is not
    supported"), and Turing has no bfloat16."""
    return [m for m in RTX_BUILD_FOR if hasattr(lib.module.ComputeCapability, m)
            and (m != "SM75" or dtype == "float16")]


def set_compute_capabilities(lib: TrtLib, config, dtype: str, where: str) -> None:
    """TensorRT-RTX compiles for the compute capabilities its builder config names; its default set leaves out
    Turing (7.5), so every one of ``rtx_targets`` is named (the manifest records them)."""
    cc = lib.module.ComputeCapability
    targets = rtx_targets(lib, dtype)
    config.num_compute_capabilities = len(targets)
    for i, member in enumerate(targets):
        if not config.set_compute_capability(getattr(cc, member), i):
            raise EngineError(f"{where}: TensorRT-RTX refused compute capability {capability_text(member)}")


def _graph_dtype(spec: GraphSpec) -> str:
    """The graph's floating-point dtype (the manifest's ``dtype``): its first floating-point input's."""
    return next((t.dtype for t in spec.inputs if t.dtype.startswith(("float", "bfloat"))), "float32")


def _lib_label(lib: TrtLib) -> str:
    return f"{lib.name} {lib.version}"


def build_graph(lib: TrtLib, onnx_path: Path, graph: str, spec: GraphSpec, profiles: list[Profile], *,
                workspace: int | None = None, timing_cache=None, bar=None) -> BuiltEngine:
    """Parse ``onnx_path`` into a strongly typed network, add ``profiles`` and build a serialized engine.

    timing_cache: an ITimingCache made by the caller's config (tensorrt only), shared across graphs.

    Python's garbage collector is paused while TensorRT runs: TensorRT calls our logger (Python) while
    it holds its own lock, and a collection there that frees an earlier builder (e.g. one kept alive by
    an old traceback) takes that lock again and deadlocks (seen with TensorRT-RTX 1.7). Leftovers are
    collected before, outside any TensorRT call.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_graph(lib, onnx_path, graph, spec, profiles, workspace=workspace, timing_cache=timing_cache,
                            bar=bar)
    finally:
        if was_enabled:
            gc.enable()


def _build_graph(lib: TrtLib, onnx_path: Path, graph: str, spec: GraphSpec, profiles: list[Profile], *,
                 workspace: int | None, timing_cache, bar) -> BuiltEngine:
    trt = lib.module
    logger = make_logger(lib)
    where = f"graph {graph} ({onnx_path.name}, {_lib_label(lib)})"
    builder = make_builder(lib, logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    net = builder.create_network(flags)
    parser = trt.OnnxParser(net, logger)
    if not parser.parse_from_file(str(onnx_path)):
        msgs = _parser_errors(parser) or logger.errors or ["(TensorRT gave no message)"]
        raise EngineError(f"TensorRT could not parse {where}:\n  " + "\n  ".join(msgs))
    _check_network(net, spec, profiles, where)

    config = builder.create_builder_config()
    # Strongly typed: layer precisions follow the ONNX graph. TF32 (on by default for fp32 matmuls on Ampere
    # and later) would quietly compute fp32 layers with 10-bit mantissas, so it is switched off.
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if timing_cache is not None:
        config.set_timing_cache(timing_cache, False)
    if lib.is_rtx:
        set_compute_capabilities(lib, config, _graph_dtype(spec), where)
    monitor = _make_monitor(lib, bar)
    if monitor is not None:
        config.progress_monitor = monitor
    readback: list[Profile] = []
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            prof.set_shape(name, lo, opt, hi)
        if config.add_optimization_profile(prof) < 0:
            raise EngineError(f"TensorRT rejected optimisation profile {p.name} of {where} ({p.range_text()}):\n  "
                              + "\n  ".join(logger.errors or ["(TensorRT gave no message)"]))
        shapes = {n: tuple(tuple(int(d) for d in s) for s in prof.get_shape(n)) for n in p.shapes}
        readback.append(Profile(p.name, dict(p.axes), shapes))

    t0 = time.perf_counter()
    try:
        data = builder.build_serialized_network(net, config)
    except Exception as e:  # some bindings raise instead of returning None
        logger.errors.append(f"{type(e).__name__}: {e}")
        data = None
    build_s = time.perf_counter() - t0
    if data is None:
        profile_text = "; ".join(f"{i} {p.name}: {p.range_text()}" for i, p in enumerate(profiles))
        odd = [d for p in profiles for d in profile_deviations(spec, p)]
        raise EngineError(f"TensorRT could not build {where} with profiles [{profile_text}]:\n  "
                          + "\n  ".join(logger.errors or ["(TensorRT gave no message)"])
                          + ("\n  inputs whose profile shapes do not follow the profile's axes: " + "; ".join(odd)
                             if odd else ""))
    return BuiltEngine(bytes(memoryview(data)), build_s, readback, list(logger.warnings))


def _standard_ops(path: Path) -> bool:
    """Whether a graph has standard ONNX operators only. A quantized draft's tree graphs hold ONNX Runtime's
    ``MatMulNBits`` (the step graph keeps standard dequantizing operators for TensorRT): those are not built, and such
    an artifact drafts level by level on TensorRT."""
    model = onnx.load(str(path), load_external_data=False)
    return all(node.domain in ("", "ai.onnx") for node in model.graph.node)


def engine_spec(manifest, name: str, appended: dict) -> GraphSpec:
    """The IO of the engine ``name`` (a graph of ``C.ENGINE_GRAPHS`` or a ``C.tree_call``) with the operators
    ``appended`` to its source: what `build` checks the network against and the backend binds."""
    call = C.parse_tree_call(name)
    if call is None:
        spec = manifest.graphs[name].spec
        return C.with_acceptance(spec) if appended.get("accept") else spec
    spec = C.tree_call_spec(manifest.graphs[C.tree_graph(call[0])].spec, *call)
    return C.with_selection(spec, appended["select"]) if "select" in appended else spec


def engine_source(directory: Path, manifest, name: str, appended: dict, load_external_data: bool = False):
    """The ONNX graph the engine ``name`` is built from: the artifact's graph of that name, or for a ``C.tree_call``
    its top_k's tree graph cut to the call's depth (``runtime/tree_graph.py``), with the operators ``appended``
    (engines/round_ops.py). Its weights stay in the artifact's data files (external data by relative location: save
    it in ``directory``)."""
    from .round_ops import append_acceptance, append_selection

    call = C.parse_tree_call(name)
    entry = manifest.graphs[name if call is None else C.tree_graph(call[0])]
    path = Path(directory) / entry.file
    try:
        model = onnx.load(str(path), load_external_data=load_external_data)
    except (OSError, ValueError) as e:
        raise EngineError(f"could not load graph {path}: {e}") from e
    if call is not None:
        from eagle_export.runtime.tree_graph import CutError, cut

        try:
            cut(model, *call, entry.axes[C.TREE_DEPTH][1])
        except CutError as e:
            raise EngineError(f"could not cut the draft tree graph {path.name} to {call[1]} levels: {e}") from e
        if "select" in appended:
            append_selection(model, *call, appended["select"])
    elif appended.get("accept"):
        append_acceptance(model)
    return model


def check_quantization(manifest) -> None:
    """A quantized artifact builds only when TensorRT can take its weights: symmetric (INT4/INT8 codes, no zero
    point; TensorRT-RTX refuses UINT4/UINT8 weights with a zero point). docs/engines.md."""
    q = manifest.quantization
    if q is not None and not q.symmetric and any(g in q.graphs for g in C.ENGINE_GRAPHS):
        raise EngineError(f"the artifact's weights are {q.method} asymmetric (zero points), which TensorRT does not "
                          "build: re-export with --quantize-symmetric (the default) to build engines")


def build_engines(directory: str | Path, options: BuildOptions | None = None, progress: bool = True):
    """Build engines for every graph of an artifact directory and record them in its manifest.

    Returns the updated Manifest. Raises EngineError / ManifestError with a clear message.
    """
    directory = Path(directory)
    options = options or BuildOptions()
    manifest = load_manifest(directory)
    check_quantization(manifest)
    popts = resolve_options(manifest, ProfileOptions(options.max_batch, options.max_prefill,
                                                     options.max_tree_tokens))
    workspace = parse_size(options.workspace)
    lib = load_lib(options.engine_lib)

    timing_cache = None
    cache_path = Path(options.timing_cache) if options.timing_cache else None
    cache_owner = None  # the builder and config that own the shared timing cache
    if cache_path is not None:
        if lib.is_rtx:
            log.warning("--timing-cache %s is ignored: TensorRT-RTX has no timing cache (its timing cache calls are "
                        "no-ops)", cache_path)
            cache_path = None
        else:
            blob = cache_path.read_bytes() if cache_path.is_file() else b""
            cache_builder = make_builder(lib, make_logger(lib))
            cache_owner = (cache_builder, cache_builder.create_builder_config())
            timing_cache = cache_owner[1].create_timing_cache(blob)

    names = [n for n in C.ENGINE_GRAPHS if n in manifest.graphs]  # not the fused graph: ONNX Runtime's ops
    # The draft tree graph cut to the default trees' depth (one draft call a round): its source is written beside the
    # graphs for the parse (its weights stay in their data files) and removed after.
    calls = {C.tree_call(k, d): (k, d) for k, d in tree_engine_calls(manifest)
             if _standard_ops(directory / manifest.graphs[C.tree_graph(k)].file)}
    bar = progress_bar(len(names) + len(calls), "build", "engine", progress)
    built: dict[str, tuple[EngineEntry, Path]] = {}
    tmp_files: list[Path] = []
    try:
        for name in [*names, *calls]:
            bar.set_description(f"build {name}")
            if name in calls:
                appended = {"select": select_count(manifest, *calls[name])}
                profiles = tree_profiles(manifest, *calls[name], popts)
            else:
                appended = {"accept": True} if name == C.TARGET_GRAPH else {}
                profiles = graph_profiles(manifest, name, popts)
            spec = engine_spec(manifest, name, appended)
            source = directory / manifest.graphs[name].file if not appended else directory / f".{name}.onnx.partial"
            if appended:
                tmp_files.append(source)
                onnx.save(engine_source(directory, manifest, name, appended), str(source))
            result = build_graph(lib, source, name, spec, profiles, workspace=workspace,
                                 timing_cache=timing_cache, bar=bar if progress else None)
            file = name + ENGINE_SUFFIX
            tmp = directory / f".{file}.partial"
            tmp_files.append(tmp)
            tmp.write_bytes(result.data)
            built[name] = (EngineEntry(file=file, size_bytes=len(result.data), build_s=round(result.build_s, 3),
                                       precision=manifest.dtype, strongly_typed=True,
                                       profiles=[p.to_dict() for p in result.profiles], appended=appended), tmp)
            bar.update()
        for entry, tmp in built.values():
            os.replace(tmp, directory / entry.file)
        if cache_path is not None and timing_cache is not None:
            cache_path.write_bytes(bytes(memoryview(timing_cache.serialize())))
        manifest.engines = EnginesInfo(
            lib=lib.name, lib_version=lib.version, built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            options={**popts.to_dict(), "workspace": workspace,
                     "timing_cache": str(cache_path) if cache_path is not None else None,
                     **({"compute_capabilities": [capability_text(m) for m in rtx_targets(lib, manifest.dtype)]}
                        if lib.is_rtx else {})},
            graphs={name: e for name, (e, _) in built.items()},
        )
        manifest.write(directory)
    finally:
        bar.close()
        for tmp in tmp_files:
            tmp.unlink(missing_ok=True)
        del cache_owner
    return manifest

"""validate's first check: every graph output against the PyTorch module it was traced from (Polygraphy's
``Comparator`` with an ONNX Runtime runner and a PyTorch runner), and, when out of tolerance, the first decoder layer
that diverges (probes on each layer's residual stream). Also the fused graph run as the standard one, and the draft's
embedding table row by row."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.errors import EagleExportError
from eagle_export.manifest import Manifest
from eagle_export.runtime.ort_backend import quantized_session_config

from .cases import tolerances
from .report import EmbeddingReport, GraphReport, OutputReport

ORT_RUNNER, TORCH_RUNNER = "onnxrt", "pytorch"  # the Comparator's runner names


@dataclass
class Probe:
    """An intermediate tensor compared in both runners: the ONNX tensor and how to capture it in PyTorch."""

    label: str  # e.g. "layers.1.mlp": layer 1's residual stream after its MLP
    onnx_name: str
    capture: tuple  # ("output", module) | ("input", module) | ("sum", mid_module, mlp_module)


def make_runner_class():
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class TorchRunner(BaseRunner):
        """Runs a traced module (TargetVerify / DraftStep) eagerly in float32 on the contract's inputs.

        Outputs are cast to the artifact's dtypes, named as in the graph spec. With ``probes``, the
        captured intermediate tensors are returned too, under their ONNX tensor names.
        """

        def __init__(self, module, spec: C.GraphSpec, probes: list[Probe] = (), full_logprobs=None, name=None):
            super().__init__(name=name or TORCH_RUNNER, prefix="pytorch-runner")
            self.module, self.spec, self.probes = module, spec, list(probes)
            self.full_logprobs = full_logprobs  # callable(hidden) -> full log-probs, recorded per call (draft)
            self.recorded: list[np.ndarray] = []

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for t in self.spec.inputs:
                meta.add(t.name, dtype=np.dtype(t.dtype), shape=[d if isinstance(d, int) else None for d in t.shape])
            return meta

        def infer_impl(self, feed_dict):
            args = []
            for t in self.spec.inputs:
                x = torch.from_numpy(np.ascontiguousarray(feed_dict[t.name]))
                args.append(x.float() if x.is_floating_point() else x)
            captured: dict[str, torch.Tensor] = {}
            handles = []
            for p in self.probes:
                kind, *mods = p.capture
                if kind == "output":
                    handles.append(mods[0].register_forward_hook(
                        lambda _m, _i, out, key=p.onnx_name: captured.__setitem__(key, out)))
                elif kind == "input":
                    handles.append(mods[0].register_forward_pre_hook(
                        lambda _m, inp, key=p.onnx_name: captured.__setitem__(key, inp[0])))
                else:  # residual after the MLP: the post-attention residual plus the MLP's output
                    mid_key, out_key = p.onnx_name + "#mid", p.onnx_name + "#mlp"
                    handles.append(mods[0].register_forward_pre_hook(
                        lambda _m, inp, key=mid_key: captured.__setitem__(key, inp[0])))
                    handles.append(mods[1].register_forward_hook(
                        lambda _m, _i, out, key=out_key: captured.__setitem__(key, out)))
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    outs = self.module(*args)
            finally:
                for h in handles:
                    h.remove()
            self.inference_time = time.perf_counter() - start
            result = OrderedDict()
            for t, o in zip(self.spec.outputs, outs, strict=True):
                result[t.name] = o.detach().numpy().astype(t.dtype)
            float_dtype = next(t.dtype for t in self.spec.outputs if t.name not in (C.LOGITS, C.TOPK_LOGPROBS,
                                                                                     C.TOPK_IDS))
            for p in self.probes:
                if p.capture[0] == "sum":
                    val = captured[p.onnx_name + "#mid"] + captured[p.onnx_name + "#mlp"]
                else:
                    val = captured[p.onnx_name]
                result[p.onnx_name] = val.detach().numpy().astype(float_dtype)
            if self.full_logprobs is not None:
                with torch.no_grad():
                    self.recorded.append(self.full_logprobs(outs[2]).numpy())
            return result

    return TorchRunner


def _layer_matmuls(model, proj: str) -> dict[int, object]:
    """Layer index -> the MatMul node of ``proj`` (o_proj / down_proj) in that layer.

    The legacy exporter names a module's nodes by its call site. Modules called through their
    layer's forward are scoped ``/layers.3/self_attn/o_proj/MatMul``; ours are called directly from
    the traced forward, so the scope is the short name numbered by call order: ``/o_proj/MatMul``
    for the first layer, ``/o_proj_1/MatMul`` for the second, ... (``/mlp/down_proj_1/MatMul``).
    """
    scoped = re.compile(rf"/layers\.(\d+)/(?:[^/]+/)*{proj}/MatMul$")
    flat = re.compile(rf"^/(?:[^/]+/)*{proj}(?:_(\d+))?/MatMul$")
    found: dict[int, object] = {}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        hit = scoped.search(node.name)
        idx = int(hit.group(1)) if hit else None
        if idx is None and (hit := flat.match(node.name)):
            idx = int(hit.group(1) or 0)
        if idx is not None:
            if idx in found:
                raise ValueError(f"two {proj} MatMuls for layer {idx}")
            found[idx] = node
    return found


def _residual_after(model, tensor: str) -> str:
    """The residual Add fed by ``tensor``, past any bias Add: its output is the residual stream."""
    inits = {i.name for i in model.graph.initializer}
    consts = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    while True:
        users = [n for n in model.graph.node if tensor in n.input]
        if len(users) != 1 or users[0].op_type != "Add":
            raise ValueError(f"{tensor} does not feed exactly one Add")
        other = [x for x in users[0].input if x != tensor]
        tensor = users[0].output[0]
        if not other or other[0] not in inits | consts:
            return tensor  # the residual add (its other input is computed, not a weight)


def _scope_output(model, scope: str) -> str | None:
    """The one tensor that leaves the nodes scoped ``/<scope>/`` (e.g. an RMSNorm's output), or None."""
    inside = [n for n in model.graph.node if n.name.startswith(f"/{scope}/")]
    names = {n.name for n in inside}
    made = {o for n in inside for o in n.output}
    # RMSNorm casts its input to float32 first; in a float32 graph that Cast's output stands in for the
    # input itself (the residual, or a graph output) outside the scope: it is not what the norm computes.
    passthrough = {n.output[0] for n in inside if n.op_type == "Cast" and n.input[0] not in made}
    graph_outputs = {o.name for o in model.graph.output}
    leaving = {o for n in inside for o in n.output if o not in passthrough and (
        o in graph_outputs or any(o in u.input for u in model.graph.node if u.name not in names))}
    return leaving.pop() if len(leaving) == 1 else None


def find_probes(model, layers, embed=None, fc=None, head3=None) -> list[Probe]:
    """Probes in execution order: embedding (and fc), then per layer the residual after attention and after the MLP.

    model: the ONNX ModelProto (structure only); layers: the PyTorch decoder layers in order.
    head3: an EAGLE-3 head (``layers`` is then ignored): embedding, fc(features), the midlayer's
    input_layernorm(embedding) and hidden_norm(h), its residual stream after attention and after
    the MLP (``midlayer.self_attn`` / ``midlayer.mlp``), then the final norm before the draft lm_head.
    Raises ValueError when the graph's layers cannot be mapped one-to-one.
    """
    prefix = "layers"
    if head3 is not None:
        layers, prefix = [head3.midlayer], "midlayer"
    probes = []
    if embed is not None:
        gathers = [n for n in model.graph.node if n.op_type == "Gather" and C.INPUT_IDS in n.input]
        if len(gathers) == 1:
            probes.append(Probe("embed_tokens", gathers[0].output[0], ("output", embed)))
    if fc is not None:
        fcs = _layer_matmuls(model, "fc")
        if len(fcs) == 1:
            node = fcs[0]
            out = node.output[0]
            users = [n for n in model.graph.node if out in n.input]
            inits = {i.name for i in model.graph.initializer}
            if len(users) == 1 and users[0].op_type == "Add" and any(x in inits for x in users[0].input):
                out = users[0].output[0]  # fc bias
            probes.append(Probe("fc", out, ("output", fc)))
    if head3 is not None:
        for part in ("input_layernorm", "hidden_norm"):
            if (out := _scope_output(model, part)) is not None:
                probes.append(Probe(f"midlayer.{part}", out, ("output", getattr(head3.midlayer, part))))
    attn, mlp = _layer_matmuls(model, "o_proj"), _layer_matmuls(model, "down_proj")
    n = len(layers)
    if sorted(attn) != list(range(n)) or sorted(mlp) != list(range(n)):
        raise ValueError(f"found o_proj for layers {sorted(attn)} and down_proj for layers {sorted(mlp)}, "
                         f"expected 0..{n - 1}")
    for i, layer in enumerate(layers):
        name = f"layers.{i}" if head3 is None else prefix
        probes.append(Probe(f"{name}.self_attn", _residual_after(model, attn[i].output[0]),
                            ("input", layer.post_attention_layernorm)))
        probes.append(Probe(f"{name}.mlp", _residual_after(model, mlp[i].output[0]),
                            ("sum", layer.post_attention_layernorm, layer.mlp)))
    if head3 is not None and (out := _scope_output(model, "norm")) is not None:
        probes.append(Probe("norm", out, ("output", head3.norm)))
    return probes


def check_embedding(table, reference: torch.Tensor, chunk: int = 8192) -> EmbeddingReport:
    """Every row of the artifact's table (a ``TokenEmbedding``) against the reference's [V, H] weight, cast to the
    table's dtype: they must be equal (the export cast the same checkpoint values). Compared in chunks of rows."""
    ref = table.ref
    where = f"{ref.file} at byte {ref.offset}, " + ("the target's embedding" if ref.shared else "the head's own")
    if tuple(reference.shape) != (ref.vocab_size, ref.hidden_size):
        return EmbeddingReport(where + f"; the reference is {list(reference.shape)}", 0, 0, float("inf"))
    bad, worst = 0, 0.0
    ids = np.arange(ref.vocab_size)
    for i in range(0, ref.vocab_size, chunk):
        got = table.rows(ids[i:i + chunk]).float()
        want = reference[i:i + chunk].detach().to(table.dtype).float()
        diff = (got - want).abs()
        bad += int((diff.amax(dim=1) > 0).sum())
        worst = max(worst, float(diff.max()))
    return EmbeddingReport(where, ref.vocab_size, bad, worst)


def _quiet():
    from polygraphy.logger import G_LOGGER

    return G_LOGGER.verbosity(G_LOGGER.CRITICAL + 1)


def _compare(runners, feeds, dtype: str):
    """Comparator.run + compare_accuracy: (run results, tolerances, per-iteration {output: OutputCompareResult})."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.exception import PolygraphyException

    try:
        with _quiet(), np.errstate(divide="ignore", invalid="ignore"):
            results = Comparator.run(runners, data_loader=feeds)
            tols = tolerances(results[TORCH_RUNNER], dtype)
            func = CompareFunc.simple(atol={k: v.atol for k, v in tols.items()},
                                      rtol={k: v.rtol for k, v in tols.items()}, check_error_stat="elemwise")
            acc = Comparator.compare_accuracy(results, compare_func=func)
    except PolygraphyException as e:
        raise EagleExportError(f"validate: Polygraphy could not run the comparison: {e}") from None
    return results, tols, acc[0][(runners[0].name, runners[1].name)]


def _ids_tied(got: np.ndarray, want: np.ndarray, full_logprobs: np.ndarray, atol: float) -> bool:
    """Top-k ids may differ only where the two tokens' log-probs (PyTorch's) are within atol: a tie, not a bug."""
    for b, t, j in np.argwhere(got != want):
        row = full_logprobs[b, t]
        if abs(float(row[got[b, t, j]]) - float(row[want[b, t, j]])) > max(atol, 1e-6):
            return False
    return True


def _ort_runner(path: Path, outputs: list[str] | None = None, tmp: Path | None = None,
               config: dict[str, str] | None = None):
    """config: session config entries (a quantized artifact's accuracy level); None: Polygraphy's session."""
    from polygraphy.backend.onnx import ModifyOutputs, OnnxFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    def session(p: Path | bytes):
        if not config:
            return SessionFromOnnx(str(p), providers=["cpu"])
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in config.items():
            opts.add_session_config_entry(key, value)
        source = p if isinstance(p, bytes) else str(p)
        return lambda: ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])

    if outputs is None:
        return OnnxrtRunner(session(path), name=ORT_RUNNER)
    # Same graph with intermediate tensors marked as outputs. Only the structure is rewritten: the
    # weights stay in the artifact's external data file, hard-linked next to the rewritten graph
    # (ONNX Runtime refuses external data that resolves outside the model's directory, so not a
    # symlink), or copied where a hard link is impossible (another file system).
    import shutil

    import onnx

    with _quiet():
        model = ModifyOutputs(OnnxFromPath(str(path), ignore_external_data=True), outputs=outputs)()
    marked = tmp / path.name
    onnx.save_model(model, str(marked))
    data = path.with_name(path.name + ".data")
    if data.exists():
        try:
            os.link(data, marked.with_name(data.name))
        except OSError:
            shutil.copy2(data, marked.with_name(data.name))
    return OnnxrtRunner(session(marked), name=ORT_RUNNER)


def check_graph(directory: Path, m: Manifest, name: str, module, cases, probe_layers, runner_cls,
                embed=None, fc=None, full_logprobs=None, head3=None, model: bytes | None = None) -> GraphReport:
    """Compare one graph's every output on every case; on failure, locate the first divergent layer. model: the
    graph as ONNX Runtime runs it, when not its file as it is (a draft tree graph cut to a depth), its weights in
    ``directory``."""
    import onnx

    entry = m.graphs[name]
    spec, path = entry.spec, directory / entry.file
    torch_runner = runner_cls(module, spec, full_logprobs=full_logprobs)
    config = quantized_session_config(m)
    if model is not None:
        config = {**config, "session.model_external_initializers_file_folder_path": str(directory)}
    results, tols, per_iter = _compare([_ort_runner(path if model is None else model, config=config), torch_runner],
                                       [f for _, f in cases], m.dtype)
    report = GraphReport(name, [c for c, _ in cases], {o: OutputReport(o, tols[o]) for o in spec.output_names})
    ort_res, torch_res = results[ORT_RUNNER], results[TORCH_RUNNER]
    for it, ((case, _), outs) in enumerate(zip(cases, per_iter, strict=True)):
        case_failed = False
        for oname, res in outs.items():
            o = report.outputs[oname]
            passed = bool(res)
            if not passed and oname == C.TOPK_IDS and _ids_tied(
                    ort_res[it][oname], torch_res[it][oname], torch_runner.recorded[it], tols[C.TOPK_LOGPROBS].atol):
                passed, o.note = True, "ids differ only at tied log-probs"
            if res.max_absdiff > o.max_abs or not o.worst_case:
                o.max_abs, o.max_rel, o.worst_case = res.max_absdiff, res.max_reldiff, case
            o.passed &= passed
            case_failed |= not passed
        if case_failed:
            report.failed_cases.append(case)
    # A graph without layers to probe (a draft tree graph) reports its failing cases as they are.
    if report.failed_cases and model is None and (probe_layers is not None or head3 is not None):
        structure = onnx.load(str(path), load_external_data=False)
        report.divergence = _locate(structure, path, spec, module, cases, report, probe_layers, runner_cls,
                                    embed, fc, m.dtype, head3, config)
    return report


def _locate(structure, path, spec, module, cases, report: GraphReport, layers, runner_cls, embed, fc, dtype,
            head3=None, config=None):
    """Re-run the first failing input with every layer's residual stream marked; name the first out of tolerance."""
    case = report.failed_cases[0]
    feed = next(f for c, f in cases if c == case)
    try:
        probes = find_probes(structure, layers, embed=embed, fc=fc, head3=head3)
    except ValueError as e:
        return {"case": case, "layer": None, "summary": f"could not map the graph's layers ({e})", "probes": []}
    with tempfile.TemporaryDirectory(prefix="eagle-validate-") as tmp:
        ort = _ort_runner(path, spec.output_names + [p.onnx_name for p in probes], Path(tmp), config)
        _, tols, per_iter = _compare([ort, runner_cls(module, spec, probes=probes)], [feed], dtype)
    res = per_iter[0]
    rows = [{"layer": p.label, "tensor": p.onnx_name, "max_abs": res[p.onnx_name].max_absdiff,
             "max_rel": res[p.onnx_name].max_reldiff, "atol": tols[p.onnx_name].atol,
             "rtol": tols[p.onnx_name].rtol, "passed": bool(res[p.onnx_name])} for p in probes]
    first = next((r for r in rows if not r["passed"]), None)
    if first is None:
        tail = "lm_head" if head3 is not None else "final norm, lm_head"
        where = "none: every layer's residual stream is within tolerance, so the divergence is after the last " \
                f"decoder layer ({tail}" + (", log-softmax / top-k)" if fc is not None else ")")
        return {"case": case, "layer": None, "summary": f"{where} [input: {case}]", "probes": rows}
    before = rows[rows.index(first) - 1]["layer"] if rows.index(first) else None
    part = first["layer"].rsplit(".", 1)[-1]
    what = {"self_attn": "residual stream after attention", "mlp": "residual stream after the MLP",
            "embed_tokens": "token embedding",
            "fc": "fc(features)" if head3 is not None else "fc(concat[embed, features])",
            "input_layernorm": "input_layernorm(embedding)", "hidden_norm": "hidden_norm(h)",
            "norm": "final norm before the draft lm_head"}.get(part, part)
    layer = (first["layer"].rsplit(".", 1)[0] if first["layer"].startswith(("layers.", "midlayer."))
             else first["layer"])
    summary = (f"{layer} ({first['layer']}: {what}, max abs error {first['max_abs']:.3g} > atol {first['atol']:g}"
               + (f"; {before} and everything before it within tolerance" if before else "")
               + f") [input: {case}]")
    return {"case": case, "layer": layer, "probe": first["layer"], "summary": summary, "probes": rows}


UNTOUCHED = 7.0  # fills the fused graph's cache rows a call must not write: any change there is a failure


class FusedAsStandard:
    """Runs the fused target graph (contract 4) on the standard graph's feeds, as the runtime does: each layer's
    cache is one whole buffer bound as both past and present (IO binding), holding the feed's past rows and
    ``UNTOUCHED`` after them. Returns the standard graph's outputs: logits, features, and as ``present_*`` the new
    rows read back from the buffers; ``touched`` lists the buffers whose other rows changed (a bug: the call may
    write only its own rows)."""

    def __init__(self, path: Path, m: Manifest, threads: int | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        self.m = m
        self.rows = m.graphs[C.TARGET_FUSED_GRAPH].axes[C.CAPACITY][1]

    def __call__(self, feed: dict) -> tuple[OrderedDict, list[str]]:
        m, t = self.m, self.m.target
        b = self.session.io_binding()
        keep = []
        for name in (C.INPUT_IDS, C.POSITION_IDS, C.ATTENTION_MASK, C.LOGIT_INDICES):
            arr = np.ascontiguousarray(feed[name])
            keep.append(arr)
            b.bind_cpu_input(name, arr)
        n = feed[C.INPUT_IDS].shape[1]
        logits = np.zeros((1, feed[C.LOGIT_INDICES].shape[1], t.vocab_size), np.float32)
        feats = np.zeros((1, n, t.feature_dim), m.dtype)
        for name, arr in ((C.LOGITS, logits), (C.FEATURES, feats)):
            b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        bufs = []
        for past_name, present_name in zip(C.past_names(t.num_layers), C.present_names(t.num_layers), strict=True):
            past = feed[past_name]  # [1, past, kv_heads, head_dim]
            p = past.shape[1]
            buf = np.full((1, t.kv_heads, self.rows, t.head_dim), UNTOUCHED, dtype=m.dtype)
            buf[0, :, :p] = past[0].transpose(1, 0, 2)
            bufs.append((present_name, buf, p))
            b.bind_cpu_input(past_name, buf)
            b.bind_output(present_name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        self.session.run_with_iobinding(b)
        out = OrderedDict([(C.LOGITS, logits), (C.FEATURES, feats)])
        touched = []
        # A quantized export's one-row call also writes one scratch row after its own (export/graphs/fused.py
        # pad_one_row_attention); any other row it writes is a bug.
        q = m.quantization
        scratch = 1 if n == 1 and q is not None and q.one_row_scratch else 0
        for (name, buf, p), past_name in zip(bufs, C.past_names(t.num_layers), strict=True):
            out[name] = np.ascontiguousarray(buf[0, :, p:p + n].transpose(1, 0, 2)[None])
            if (not np.array_equal(buf[0, :, :p], feed[past_name][0].transpose(1, 0, 2))
                    or not (buf[0, :, p + n + scratch:] == UNTOUCHED).all()):
                touched.append(name)
        return out, touched


def check_fused_graph(directory: Path, m: Manifest, module, cases, threads: int | None = None) -> GraphReport:
    """The fused target graph against the standard graph's PyTorch module on the standard cases: every output
    within the same tolerances as the standard graph, and no cache row written but the call's own."""
    run = FusedAsStandard(directory / m.graphs[C.TARGET_FUSED_GRAPH].file, m, threads)
    spec = m.graphs[C.TARGET_GRAPH].spec
    want = []
    for _, feed in cases:
        args = [torch.from_numpy(np.ascontiguousarray(feed[i.name])) for i in spec.inputs]
        with torch.no_grad():
            outs = module(*[a.float() if a.is_floating_point() else a for a in args])
        want.append(OrderedDict((o.name, x.numpy().astype(o.dtype)) for o, x in zip(spec.outputs, outs, strict=True)))
    tols = tolerances(want, m.dtype)
    report = GraphReport(C.TARGET_FUSED_GRAPH, [c for c, _ in cases],
                         {o: OutputReport(o, tols[o]) for o in spec.output_names})
    for (case, feed), ref in zip(cases, want, strict=True):
        got, touched = run(feed)
        failed = False
        for name, w in ref.items():
            o, tol = report.outputs[name], tols[name]
            g, w = got[name].astype(np.float64), w.astype(np.float64)
            diff = np.abs(g - w)
            bad = (diff > tol.atol) & (diff > tol.rtol * np.abs(w))
            max_abs = float(diff.max(initial=0.0))
            if max_abs > o.max_abs or not o.worst_case:
                o.max_abs, o.worst_case = max_abs, case
                o.max_rel = float((diff / np.maximum(np.abs(w), 1e-12)).max(initial=0.0))
            ok = not bad.any() and name not in touched
            if name in touched:
                o.note = "the call wrote cache rows outside its own"
            o.passed &= ok
            failed |= not ok
        if failed:
            report.failed_cases.append(case)
    return report

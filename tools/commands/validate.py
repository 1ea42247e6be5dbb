"""`eagle-export validate`: prove an artifact behaves like the PyTorch model, or find where it does not.

Three checks, each against the original checkpoints named in the manifest (``target.source``,
``draft.source``), loaded in float32:

1. **Graphs.** Every output of both graphs, on inputs that cover prefill (cache 0 and a later
   chunk), tree verification with random trees (cache 0, mid, and near capacity), plain decode,
   and draft context passes and tree levels (cache 0 and near capacity), run by Polygraphy's
   ``Comparator`` with an ``OnnxrtRunner`` over the artifact's graphs and a PyTorch runner over
   the traced modules (``TargetVerify``, ``DraftStep``), compared with ``CompareFunc.simple`` at
   a tolerance per dtype and per output. When a graph is out of tolerance, both runners run
   again on the failing input with the residual stream of every decoder layer marked as an
   output (after attention and after the MLP), and the first layer out of tolerance is named.
2. **Greedy tokens** of the runtime (EAGLE and ``--no-draft``) versus transformers' greedy
   ``generate`` on random prompts.
3. **EAGLE rounds** versus the PyTorch oracle (``runtime/oracle.py``): same tree, same accepted
   lengths, same tokens, round by round.

EAGLE-1/2 and EAGLE-3 artifacts alike: for EAGLE-3 the target's features are the inputs of the
manifest's ``target.feature_layers``, the draft's probes are the head's own parts (fc, norms,
``midlayer`` attention and MLP), and the oracle runs the EAGLE-3 head.

See docs/validate.md for tolerances and how layers are located.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.errors import EagleExportError, ManifestError
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.runtime.ort_backend import quantized_session_config

from .validate_quant import QuantReport

BACKENDS = ("ort", "tensorrt")
ORT_RUNNER, TORCH_RUNNER = "onnxrt", "pytorch"


# ---- tolerances ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """Elementwise: an element fails when |got - want| > atol and |got - want| > rtol * |want| (want = PyTorch)."""

    atol: float
    rtol: float

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol}


# fp32: the graphs compute what the modules compute, in the same precision: 1e-4 absolute.
# fp16: the graphs run in half precision against the float32 modules. Each fp16 op keeps about three
# significant digits and the error grows with depth and context (measured on the tiny models: 0.5% of
# an output's scale at cache 11, 2.5% at cache 254), so: 5e-2 relative, or 5e-2 of the output's scale
# (max(1, largest |PyTorch value| of that output over all inputs)) absolute, which judges the small
# elements of a large tensor by its scale. Real bugs (a wrong mask, position or weight) are O(100%).
FP32_ATOL = 1e-4
FP16_REL = 5e-2
EXACT = Tolerance(0.0, 0.0)
# Greedy/oracle comparisons: a first difference where the reference's deciding gap (target top-2 logits,
# draft log-probs or path scores) is below the tie gap is a tie. Tie gap = max(floor, 4 x the worst error
# measured on logits and topk_logprobs): in a generation, errors also travel from the target's features
# into the draft, so the graph-level error alone is not enough.
TIE_FLOOR = {"float32": 1e-4, "float16": 1e-2}
TIE_FACTOR = 4.0


def tolerances(torch_iterations: list, dtype: str) -> dict[str, Tolerance]:
    """Per output, from the PyTorch runner's outputs: ints exact (top-k ids: up to ties), floats per dtype."""
    tols = {}
    for name, first in torch_iterations[0].items():
        if np.issubdtype(first.dtype, np.integer):
            tols[name] = EXACT
        elif dtype == "float32":
            tols[name] = Tolerance(FP32_ATOL, 0.0)
        else:
            scale = max([1.0] + [float(np.abs(it[name].astype(np.float32)).max(initial=0.0))
                                 for it in torch_iterations])
            tols[name] = Tolerance(float(f"{FP16_REL * scale:.2g}"), FP16_REL)
    return tols


# ---- inputs ----------------------------------------------------------------------------------


def random_tree(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random tree of n nodes in tree order (parents precede children): (depths, ancestor-or-self mask)."""
    from eagle_export.runtime.tree import VerifyTree

    parents = np.full(n, -1)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
    tree = VerifyTree.from_parents(np.zeros(n, dtype=np.int64), parents)
    return tree.depths, tree.mask


def _past(rng, rows: int, layers: int, heads: int, dim: int, dtype: str) -> list[np.ndarray]:
    return [rng.standard_normal((1, rows, heads, dim)).astype(dtype) for _ in range(2 * layers)]


def _causal(new: int, past: int) -> np.ndarray:
    return np.concatenate([np.ones((new, past), dtype=bool), np.tri(new, dtype=bool)], axis=1)[None]


def target_cases(m: Manifest, rng: np.random.Generator) -> list[tuple[str, OrderedDict]]:
    """Target verify inputs: prefill, tree verify (random trees), decode; cache 0, mid and near capacity."""
    t, S = m.target, m.max_seq_len
    tree_n = m.tree_defaults.total_tokens + 1
    max_n = m.tree_limits.max_verify_tokens
    mid = min(S - 2, 11)
    cases = []

    names = m.graphs[C.TARGET_GRAPH].spec.input_names

    def add(name, ids, pos, mask, rows, past):
        feed = OrderedDict(zip(names, [ids, pos, mask, rows,
                                       *_past(rng, past, t.num_layers, t.kv_heads, t.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    def ids(n):
        return rng.integers(0, t.vocab_size, (1, n)).astype(np.int64)

    n = min(S, 7)
    add(f"prefill, cache 0 ({n} tokens)", ids(n), np.arange(n)[None], _causal(n, 0), np.array([[n - 1]]), 0)
    n = min(5, S - mid)
    add(f"prefill chunk, cache {mid} ({n} tokens)", ids(n), np.arange(mid, mid + n)[None], _causal(n, mid),
        np.array([[n - 1]]), mid)
    for past, n, what in ((0, tree_n, "cache 0"), (mid, tree_n, f"cache {mid}"),
                          (S - 2, max_n, f"cache {S - 2}, near capacity")):
        depths, tmask = random_tree(rng, n)
        mask = np.concatenate([np.ones((n, past), dtype=bool), tmask], axis=1)[None]
        add(f"tree verify, random {n}-node tree, {what}", ids(n), (past + depths)[None], mask, np.arange(n)[None],
            past)
    add(f"decode step, cache {S - 1}", ids(1), np.array([[S - 1]]), np.ones((1, 1, S), dtype=bool),
        np.array([[0]]), S - 1)
    for _, feed in cases:
        for k in (C.POSITION_IDS, C.LOGIT_INDICES):
            feed[k] = np.ascontiguousarray(feed[k], dtype=np.int64)
    return cases


def draft_cases(m: Manifest, rng: np.random.Generator, table) -> list[tuple[str, OrderedDict]]:
    """Draft step inputs: context passes and tree levels (random ancestors), cache 0 and near capacity.

    The tokens' input_embeds are rows of ``table`` (the runtime's ``TokenEmbedding``) for random ids, fed to both
    runners alike; ``check_embedding`` checks the table itself."""
    d, t, S = m.draft, m.target, m.max_seq_len
    lim = m.tree_limits
    names = m.graphs[C.DRAFT_GRAPH].spec.input_names
    cases = []

    def add(name, n, pos, mask, past, tree_level=False):
        """Context passes feed target features; tree levels feed the draft's own hidden (contract v2)."""
        hidden_rows = n if tree_level else 0
        feed = OrderedDict(zip(names, [
            table.rows(rng.integers(0, t.vocab_size, (1, n))).float().numpy().astype(m.dtype),
            rng.standard_normal((1, n - hidden_rows, d.feature_dim)).astype(m.dtype),
            rng.standard_normal((1, hidden_rows, d.hidden_size)).astype(m.dtype),
            np.ascontiguousarray(pos, dtype=np.int64), mask,
            *_past(rng, past, d.num_layers, d.kv_heads, d.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    def level_mask(k: int, L: int, level: int) -> np.ndarray:
        """Tree level ``level``: context visible, one ancestor row per earlier level, identity block."""
        fed = (level - 1) * k
        mask = np.zeros((k, L + fed + k), dtype=bool)
        mask[:, :L] = True
        for lv in range(level - 1):
            mask[np.arange(k), L + lv * k + rng.integers(0, k, k)] = True
        mask[:, L + fed:] = np.eye(k, dtype=bool)
        return mask[None]

    n = min(S, 7)
    add(f"context pass, cache 0 ({n} tokens)", n, np.arange(n)[None], _causal(n, 0), 0)
    L = min(S - 2, 11)
    n = min(lim.max_depth + 1, 4)
    add(f"context pass after a round, cache {L} ({n} tokens)", n, np.arange(L, L + n)[None], _causal(n, L), L)
    k, level = m.tree_defaults.top_k, min(2, max(1, m.tree_defaults.depth))
    add(f"tree level {level}, top_k {k}, cache {L + (level - 1) * k}", k, np.full((1, k), L + level - 1),
        level_mask(k, L, level), L + (level - 1) * k, tree_level=True)
    k, level, L = lim.max_top_k, max(1, lim.max_depth), S - 2
    add(f"tree level {level}, top_k {k}, cache {L + (level - 1) * k}, near capacity", k,
        np.full((1, k), L + level - 1), level_mask(k, L, level), L + (level - 1) * k, tree_level=True)
    return cases


def tree_cases(m: Manifest, rng: np.random.Generator, table) -> list[tuple[str, OrderedDict]]:
    """Draft tree graph inputs: a prompt's context pass over an empty cache, and a round's context pass near capacity
    whose tree grows past it (rows are random; the last context row is each case's root)."""
    d, t, S = m.draft, m.target, m.max_seq_len
    names = m.graphs[C.DRAFT_TREE_GRAPH].spec.input_names
    cases = []

    def add(name, n, past):
        feed = OrderedDict(zip(names, [
            table.rows(rng.integers(0, t.vocab_size, (1, n))).float().numpy().astype(m.dtype),
            rng.standard_normal((1, n, d.feature_dim)).astype(m.dtype),
            np.arange(past, past + n, dtype=np.int64)[None], _causal(n, past), np.array([n - 1], dtype=np.int64),
            *_past(rng, past, d.num_layers, d.kv_heads, d.head_dim, m.dtype)], strict=True))
        cases.append((name, feed))

    n = min(S, 7)
    add(f"prompt context and tree, cache 0 ({n} tokens)", n, 0)
    add("one-token prompt and tree, cache 0", 1, 0)
    n = min(m.tree_limits.max_depth + 1, 4)
    L = min(S - n, 11)
    add(f"round context and tree, cache {L} ({n} tokens)", n, L)
    add(f"round context and tree, cache {S - n} ({n} tokens), near capacity", n, S - n)
    return cases


# ---- the PyTorch runner ----------------------------------------------------------------------


@dataclass
class Probe:
    """An intermediate tensor compared in both runners: the ONNX tensor and how to capture it in PyTorch."""

    label: str  # e.g. "layers.1.mlp": layer 1's residual stream after its MLP
    onnx_name: str
    capture: tuple  # ("output", module) | ("input", module) | ("sum", mid_module, mlp_module)


def _make_runner_class():
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


# ---- finding layers in the ONNX graph --------------------------------------------------------


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


# ---- reports ---------------------------------------------------------------------------------


@dataclass
class OutputReport:
    name: str
    tol: Tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_case: str = ""
    passed: bool = True
    note: str = ""

    def to_dict(self) -> dict:
        return {"tolerance": self.tol.to_dict(), "max_abs": self.max_abs, "max_rel": self.max_rel,
                "worst_case": self.worst_case, "passed": self.passed, "note": self.note}


@dataclass
class GraphReport:
    name: str
    cases: list[str]
    outputs: dict[str, OutputReport]
    failed_cases: list[str] = field(default_factory=list)
    divergence: dict | None = None  # first divergent layer, when a case failed

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs.values())

    def to_dict(self) -> dict:
        return {"passed": self.passed, "cases": self.cases, "failed_cases": self.failed_cases,
                "outputs": {k: v.to_dict() for k, v in self.outputs.items()}, "first_divergence": self.divergence}


@dataclass
class TokenReport:
    """Greedy vs transformers, or EAGLE rounds vs the oracle, over the random prompts."""

    what: str
    prompts: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    ties: int = 0
    failures: list[str] = field(default_factory=list)
    skipped: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        d = {"passed": self.passed, "skipped": self.skipped, "prompts": self.prompts, "tokens": self.tokens,
             "ties": self.ties, "failures": self.failures}
        if self.what == "eagle":
            d.update(rounds=self.rounds, accepted=self.accepted)
        return d


@dataclass
class EmbeddingReport:
    """The table the runtime gathers the draft's input_embeds from, against the reference head's embed_tokens."""

    where: str  # e.g. "target_verify.onnx.data at byte 1048576, the target's embedding"
    rows: int
    mismatched_rows: int
    max_abs: float

    @property
    def passed(self) -> bool:
        return self.rows > 0 and self.mismatched_rows == 0

    def to_dict(self) -> dict:
        return {"passed": self.passed, "where": self.where, "rows": self.rows,
                "mismatched_rows": self.mismatched_rows, "max_abs": self.max_abs}


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


@dataclass
class ValidationReport:
    artifact: str
    backend: str
    dtype: str
    target_source: str
    draft_source: str
    tree: dict
    graphs: dict[str, GraphReport]
    greedy: TokenReport
    eagle: TokenReport
    tie_gap: float  # logit / log-prob gap below which a first difference is a tie
    embedding: EmbeddingReport | None = None
    seconds: float = 0.0
    library: object | None = None  # against_library.LibraryCheck, with --against-library
    quantization: QuantReport | None = None  # a quantized artifact's lossless check and drift (validate_quant.py)

    @property
    def passed(self) -> bool:
        return (all(g.passed for g in self.graphs.values()) and self.greedy.passed and self.eagle.passed
                and (self.embedding is None or self.embedding.passed)
                and (self.library is None or self.library.passed)
                and (self.quantization is None or self.quantization.passed))

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "artifact": self.artifact, "backend": self.backend, "dtype": self.dtype,
            "reference": {"target": self.target_source, "draft": self.draft_source, "dtype": "float32",
                          "modules": {C.TARGET_GRAPH: "TargetVerify", C.TARGET_FUSED_GRAPH: "TargetVerify",
                                      C.DRAFT_GRAPH: "DraftStep", C.DRAFT_TREE_GRAPH: "DraftTree"}},
            "graphs": {k: v.to_dict() for k, v in self.graphs.items()},
            "draft_embedding": None if self.embedding is None else self.embedding.to_dict(),
            "greedy_vs_transformers": self.greedy.to_dict(),
            "eagle_vs_oracle": {**self.eagle.to_dict(), "tree": self.tree},
            "tie_gap": self.tie_gap, "seconds": round(self.seconds, 2),
            "against_library": None if self.library is None else self.library.to_dict(),
            **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
        }

    def format(self) -> str:
        ok = {True: "PASS", False: "FAIL"}
        lines = [f"eagle-export validate {self.artifact}",
                 f"  backend {self.backend}, artifact dtype {self.dtype}; reference: PyTorch float32 modules from",
                 f"  target {self.target_source}",
                 f"  draft  {self.draft_source}", ""]
        for g in self.graphs.values():
            lines.append(f"graph {g.name}: {ok[g.passed]} ({len(g.cases)} inputs: {'; '.join(g.cases)})")
            lines.append(f"  {'output':<16} {'atol':>8} {'rtol':>8} {'worst abs':>10} {'worst rel':>10}  "
                         f"{'':4}  worst input")
            for o in g.outputs.values():
                if o.tol == EXACT:
                    tol, worst = f"{'exact':>17}", f"{int(o.max_abs):>10d} {'-':>10}"
                else:
                    tol, worst = f"{o.tol.atol:>8.0e} {o.tol.rtol:>8.0e}", f"{o.max_abs:>10.2e} {o.max_rel:>10.2e}"
                lines.append(f"  {o.name:<16} {tol} {worst}  {ok[o.passed]:4}  {o.worst_case}"
                             + (f" ({o.note})" if o.note else ""))
            if g.divergence:
                lines.append(f"  first divergent layer: {g.divergence['summary']}")
            lines.append("")
        if self.embedding is not None:
            e = self.embedding
            lines.append(f"draft embedding table ({e.where}): {ok[e.passed]} ({e.rows} rows compared with the "
                         f"reference's embed_tokens at {self.dtype}, exact: {e.mismatched_rows} differ, worst abs "
                         f"{e.max_abs:.2e})")
            lines.append("")
        if self.library is not None:
            lines += [self.library.format(), ""]
        for r, title in ((self.greedy, "greedy tokens vs transformers generate"),
                         (self.eagle, f"EAGLE rounds vs PyTorch oracle (tree {self.tree})")):
            if r.skipped:
                lines.append(f"{title}: skipped (--prompts 0)")
                continue
            extra = f", {r.rounds} rounds, {r.accepted} draft tokens accepted" if r.what == "eagle" else ""
            lines.append(f"{title}: {ok[r.passed]} ({r.prompts} prompts, {r.tokens} tokens{extra}, "
                         f"{r.ties} ties below gap {self.tie_gap:.2g})")
            lines += [f"  {f}" for f in r.failures[:5]]
        if self.quantization is not None:
            lines.append("")
            lines += self.quantization.format()
        lines.append("")
        lines.append(f"RESULT: {ok[self.passed]} ({self.seconds:.1f} s)")
        return "\n".join(lines)


# ---- graph comparison ------------------------------------------------------------------------


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

    def session(p: Path):
        if not config:
            return SessionFromOnnx(str(p), providers=["cpu"])
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in config.items():
            opts.add_session_config_entry(key, value)
        return lambda: ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])

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
                embed=None, fc=None, full_logprobs=None, head3=None) -> GraphReport:
    """Compare one graph's every output on every case; on failure, locate the first divergent layer."""
    import onnx

    entry = m.graphs[name]
    spec, path = entry.spec, directory / entry.file
    torch_runner = runner_cls(module, spec, full_logprobs=full_logprobs)
    config = quantized_session_config(m)
    results, tols, per_iter = _compare([_ort_runner(path, config=config), torch_runner], [f for _, f in cases],
                                       m.dtype)
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
    if report.failed_cases:
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


# ---- the fused target graph ---------------------------------------------------------------------

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
        # A quantized export's one-row call also writes one scratch row after its own (export/fused.py
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


# ---- end to end ------------------------------------------------------------------------------


def _hf_greedy(lm, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n)
    saved = lm.generation_config.eos_token_id
    lm.generation_config.eos_token_id = None  # else generate merges the model's own EOS back in and stops early
    try:
        with torch.no_grad():
            out = lm.generate(torch.tensor([prompt]), generation_config=cfg,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        lm.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def _top2_gap(lm, prefix: list[int]) -> float:
    with torch.no_grad():
        row = lm(torch.tensor([prefix])).logits[0, -1]
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def end_to_end(rt, oracle, lm, m: Manifest, prompts: list[list[int]], max_new: int, tie_gap: float, log=None):
    """log: called once per prompt, as it starts (the three generations of a prompt take a while on a big model)."""
    from eagle_export.runtime.oracle import EagleRound, compare_with_oracle

    greedy, eagle = TokenReport("greedy"), TokenReport("eagle")
    tree = m.tree_defaults
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        if log is not None:
            log(f"prompt {i + 1}/{len(prompts)} ({len(p)} tokens; {time.perf_counter() - t0:.0f} s so far)")
        room = m.max_seq_len - len(p)
        want = _hf_greedy(lm, p, min(max_new, room))
        rounds: list[EagleRound] = []
        res = rt.generate(prompt_ids=p, max_new_tokens=max_new, tree=tree, stop_on_eos=False,
                          on_round=lambda vt, acc, rounds=rounds: rounds.append(EagleRound.from_runtime(vt, acc)))
        plain = rt.generate(prompt_ids=p, max_new_tokens=max_new, use_draft=False, stop_on_eos=False)
        greedy.prompts += 1
        for label, got in (("eagle", res.tokens), ("no-draft", plain.tokens)):
            diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            greedy.tokens += len(got) if diff is None else diff  # tokens after a divergence are not compared
            if diff is None and len(got) != len(want):
                greedy.failures.append(f"{label}, prompt {p}: {len(got)} tokens, transformers {len(want)}")
            elif diff is not None:
                gap = _top2_gap(lm, p + want[:diff])
                if gap < tie_gap:
                    greedy.ties += 1
                else:
                    greedy.failures.append(f"{label}, prompt {p}: token {diff} is {got[diff]}, transformers "
                                           f"{want[diff]} (top-2 gap {gap:.3g})")
        orc = oracle.generate(p, max_new, tree, capacity=m.max_seq_len)
        cmp = compare_with_oracle(res.tokens, rounds, orc, tie_gap)
        eagle.prompts += 1
        eagle.tokens += len(res.tokens)
        eagle.rounds += cmp.rounds_compared
        eagle.accepted += sum(r.accepted for r in rounds[: cmp.rounds_compared])
        if cmp.status == "tie":
            eagle.ties += 1
        elif cmp.status == "mismatch":
            eagle.failures.append(f"prompt {p}: {cmp.detail}")
    return greedy, eagle


# ---- the command -----------------------------------------------------------------------------


def _check_sources(m: Manifest, target, draft) -> None:
    """The checkpoints must be the ones the artifact was exported from (same dimensions, same kind of head)."""
    if draft.variant != m.variant:
        raise ManifestError(f"the checkpoints are not the ones this artifact was exported from: the artifact has an "
                            f"{m.variant} head but the draft checkpoint is an {draft.variant} head")
    head, cfg = draft.head, draft.config
    c = target.config
    heads = c.num_attention_heads
    got = {"target.num_layers": c.num_hidden_layers, "target.hidden_size": c.hidden_size,
           "target.num_heads": heads, "target.kv_heads": c.num_key_value_heads or heads,
           "target.head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
           "target.vocab_size": c.vocab_size,
           "draft.hidden_size": cfg.hidden_size, "draft.kv_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
           "draft.head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
           "draft.fc_bias": head.fc.bias is not None,
           "draft.feature_dim": draft.feature_dim, "draft.vocab_size": draft.vocab_size}
    bad = []
    for key, value in got.items():
        part, attr = key.split(".")
        want = getattr(getattr(m, part), attr)
        if want != value:
            bad.append(f"{key} is {want} in the manifest but {value} in the checkpoint")
    if bad:
        raise ManifestError("the checkpoints are not the ones this artifact was exported from: " + "; ".join(bad))


def validate(artifact: str | Path, backend: str = "ort", prompts: int = 8, max_new_tokens: int = 32,
             target: str | Path | None = None, draft: str | Path | None = None, seed: int = 0,
             threads: int | None = None, log=None, prompt_specs=None, against_library: bool = False
             ) -> ValidationReport:
    """Run every check; user errors raise EagleExportError, a failed check is ``report.passed == False``.

    prompt_specs: the end-to-end checks' prompts (``eagle_export.prompts.PromptSpec``s, e.g. from a prompts
    file; text and messages through the artifact's tokenizer) instead of ``prompts`` random ones.

    threads: intra-op threads for PyTorch and the runtime's ONNX Runtime sessions (None: their
    defaults). Tiny models run fastest with 1: their forwards are too small to split.

    against_library: also compare the draft graph with the forward of the library that wrote the head
    (``against_library.py``; skipped with the reason when it is not installed).
    """
    if threads is not None and threads < 1:
        raise EagleExportError(f"--threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="eagle-validate-parity-") as scratch:
            return _validate(artifact, backend, prompts, max_new_tokens, target, draft, seed, threads, log,
                             prompt_specs, Path(scratch), against_library)
    finally:
        torch.set_num_threads(before)


def _validate(artifact, backend, prompts, max_new_tokens, target, draft, seed, threads, log,
              prompt_specs=None, scratch: Path | None = None, against_library: bool = False) -> ValidationReport:
    from eagle_export.errors import CheckpointError
    from eagle_export.export.draft_tree import DraftTree
    from eagle_export.export.loaders import detect_variant, load_draft_head, load_target, read_draft_checkpoint
    from eagle_export.export.modules import DraftStep, TargetVerify
    from eagle_export.prompts import PromptFileError, prompt_ids
    from eagle_export.runtime import EagleRuntime
    from eagle_export.runtime.oracle import EagleOracle

    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    directory = Path(artifact)
    if backend not in BACKENDS:
        raise EagleExportError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if prompts < 0 or max_new_tokens < 1:
        raise EagleExportError(f"--prompts must be >= 0 and --max-new-tokens >= 1, got {prompts}, {max_new_tokens}")
    m = load_manifest(directory)
    if backend == "tensorrt":
        raise EagleExportError(
            f"{directory}: validate --backend tensorrt is not implemented yet (engines from `eagle-export build` "
            "need a CUDA GPU to run): validate the ONNX graphs with --backend ort")
    # Opening the runtime checks every graph file loads, before any long work.
    rt = EagleRuntime.open(directory, backend="ort", threads=threads)
    given = None if prompt_specs is None else [prompt_ids(rt, s) for s in prompt_specs]  # bad lines fail here
    for spec, ids in zip(prompt_specs or (), given or (), strict=True):
        if len(ids) >= m.max_seq_len:  # the end-to-end checks compare generated tokens: at least one must fit
            raise PromptFileError(f"{spec.source}: the prompt has {len(ids)} tokens, and validate needs room to "
                                  f"generate: at most {m.max_seq_len - 1} (the artifact's capacity, --max-seq-len, is "
                                  f"{m.max_seq_len})")
    sources = {}
    for part, override in (("target", target), ("draft", draft)):
        src = Path(override) if override is not None else Path(getattr(m, part).source)
        if not src.is_dir():
            how = f"--{part} {src}" if override is not None else f"the manifest's {part}.source ({src})"
            raise ManifestError(f"{how} is not a directory: validate needs the original {part} checkpoint "
                                f"(pass --{part} PATH if it moved)")
        sources[part] = src
    log("loading the PyTorch reference")
    tgt = load_target(sources["target"], dtype=torch.float32, progress=False)
    eagle3 = m.variant == "eagle3"
    try:
        d = load_draft_head(sources["draft"], tgt, m.target.feature_layers if eagle3 else None, m.draft.reading)
    except CheckpointError:
        # An EAGLE-1/2 checkpoint given for an EAGLE-3 artifact fails on feature_layers: say what is wrong.
        if eagle3 and detect_variant(read_draft_checkpoint(sources["draft"])) != "eagle3":
            raise ManifestError(f"the checkpoints are not the ones this artifact was exported from: the artifact has "
                                f"an eagle3 head but {sources['draft']} is an EAGLE-1/2 head") from None
        raise
    _check_sources(m, tgt, d)
    head = d.head
    quant = own_rt = float_lm = None
    if m.quantization is not None:
        # Parity against the dequantized weights, on a copy of the artifact at float-compute accuracy
        # (tools/commands/validate_quant.py); the artifact as it is runs the lossless check and the drift report.
        import copy

        from .validate_quant import dequantize_reference, parity_copy

        log(f"quantized artifact ({m.quantization.method}): comparing with the dequantized weights")
        quant = QuantReport(m.quantization.to_dict())
        float_lm = copy.deepcopy(tgt.model)
        dequantize_reference(tgt.model, head, m.quantization, m.dtype)
        own_rt, own_dir = rt, directory
        directory = parity_copy(directory, scratch / "parity")
        m = load_manifest(directory)
        rt = EagleRuntime.open(directory, backend="ort", threads=threads)
    runner_cls = _make_runner_class()
    rng = np.random.default_rng(seed)
    graphs = {}
    log("comparing target_verify")
    tv = TargetVerify(tgt.model, d.feature_layers).eval()
    log("comparing the draft's embedding table")
    embedding = check_embedding(rt.generator.embedding, head.embed_tokens.weight)
    graphs[C.TARGET_GRAPH] = check_graph(directory, m, C.TARGET_GRAPH, tv, target_cases(m, rng), tv.layers,
                                         runner_cls, embed=tv.embed_tokens)
    if C.TARGET_FUSED_GRAPH in m.graphs:
        log("comparing target_verify_fused")
        # A call over an empty cache is a prefill for this graph (contract 4: GroupQueryAttention takes it as a first
        # prompt, causal, positions from 0), as it always is in the runtime: the other cache-0 cases do not apply.
        cases = [(c, f) for c, f in target_cases(m, rng) if f[C.past_key(0)].shape[1] or c.startswith("prefill")]
        graphs[C.TARGET_FUSED_GRAPH] = check_fused_graph(directory, m, tv, cases, threads)
    log("comparing draft_step")
    ds = DraftStep(head, m.tree_limits.max_top_k).eval()
    graphs[C.DRAFT_GRAPH] = check_graph(
        directory, m, C.DRAFT_GRAPH, ds, draft_cases(m, rng, rt.generator.embedding),
        None if eagle3 else head.layers, runner_cls, fc=head.fc,
        full_logprobs=lambda hidden: _target_logprobs(head, hidden, m), head3=head if eagle3 else None)
    if C.DRAFT_TREE_GRAPH in m.graphs:
        log("comparing draft_tree")
        axes = m.graphs[C.DRAFT_TREE_GRAPH].axes
        dt = DraftTree(head, m.tree_limits.max_top_k, axes[C.TREE_TOP_K][0], axes[C.TREE_DEPTH][0]).eval()
        graphs[C.DRAFT_TREE_GRAPH] = check_graph(directory, m, C.DRAFT_TREE_GRAPH, dt,
                                                 # its own random source: the prompts below stay the seed's
                                                 tree_cases(m, np.random.default_rng(seed + 1), rt.generator.embedding),
                                                 None, runner_cls)
    library = None
    if against_library:
        from .against_library import check_against_library

        log("comparing draft_step with the forward of the library that wrote the head")
        dtt = getattr(head, "draft_to_target", None)
        library = check_against_library(directory, m, sources["draft"], rt.generator.embedding,
                                        None if dtt is None else dtt.numpy(), seed, target_dir=sources["target"])
    # Capped at the tolerance: a broken graph's large errors must not turn every difference into a tie.
    deciding = (graphs[C.TARGET_GRAPH].outputs[C.LOGITS], graphs[C.DRAFT_GRAPH].outputs[C.TOPK_LOGPROBS],
                *([graphs[C.TARGET_FUSED_GRAPH].outputs[C.LOGITS]] if C.TARGET_FUSED_GRAPH in graphs else []))
    tie_gap = max([TIE_FLOOR[m.dtype]] + [TIE_FACTOR * min(o.max_abs, o.tol.atol) for o in deciding])
    if prompts or given:
        vocab = m.target.vocab_size
        plist = given if given is not None else [
            rng.integers(0, vocab, int(rng.integers(1, max(2, min(24, m.max_seq_len - 1) + 1)))).tolist()
            for _ in range(prompts)]
        log(f"generating {len(plist)} prompts x {max_new_tokens} tokens (runtime, transformers, oracle)")
        oracle = EagleOracle(tgt.model, head, d.feature_layers, d.ckpt.weights.get("d2t"))
        greedy, eagle = end_to_end(rt, oracle, tgt.model, m, plist, max_new_tokens, tie_gap, log)
        if quant is not None:
            from .validate_quant import check_lossless, check_one_row, measure_drift

            log("quantized artifact: EAGLE vs --no-draft at its own settings, drift vs the unquantized model")
            check_one_row(own_dir, load_manifest(own_dir), threads, quant)
            conts = check_lossless(own_rt, plist, max_new_tokens, quant)
            measure_drift(own_dir, load_manifest(own_dir), float_lm, [p + c for p, c in zip(plist, conts,
                                                                                           strict=True)],
                          threads, quant)
    else:
        greedy, eagle = TokenReport("greedy", skipped=True), TokenReport("eagle", skipped=True)
    return ValidationReport(str(Path(artifact)), backend, m.dtype, str(sources["target"]), str(sources["draft"]),
                            m.tree_defaults.to_dict(), graphs, greedy, eagle, tie_gap, embedding,
                            seconds=time.perf_counter() - t0, library=library, quantization=quant)


def _target_logprobs(head, hidden: torch.Tensor, m: Manifest) -> torch.Tensor:
    """The draft's full log-probs indexed by target id (as ``topk_ids`` are): -inf outside the draft vocabulary."""
    logp = torch.log_softmax(head.logits(hidden.float()), dim=-1)
    to_target = getattr(head, "draft_to_target", None)
    if to_target is None:
        return logp
    out = torch.full((*logp.shape[:-1], m.target.vocab_size), -math.inf)
    out[..., to_target] = logp
    return out


def worst_errors(report: ValidationReport) -> dict[str, float]:
    """{graph.output: worst absolute error}: a compact summary for logs and tests."""
    return {f"{g}.{o}": r.max_abs for g, gr in report.graphs.items() for o, r in gr.outputs.items()
            if not math.isnan(r.max_abs)}

"""The artifact manifest: what an exported directory holds, written once by the exporter, checked by the runtime."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import contract as C
from .contract import CONTRACT_VERSION, GraphSpec, spec_from_dict
from .errors import EagleExportError, GenerationError, ManifestError
from .tree_params import BatchTrees, TreeLimits, TreeParams

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 2
# EAGLE-1 and EAGLE-2 heads share one layout ("eagle1"; EAGLE-2 is the dynamic tree policy); "eagle3" is the
# multi-layer-feature head with its own draft vocabulary.
VARIANTS = ("eagle1", "eagle3")


@dataclass
class TargetInfo:
    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    feature_dim: int
    # EAGLE-3: decoder layers whose inputs make `features` (HF hidden_states[i]; repeats legal); None: final norm
    feature_layers: list[int] | None
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    source: str


@dataclass
class DraftInfo:
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    feature_dim: int
    vocab_size: int  # draft vocabulary Vd (top-k is taken over it); the target's for EAGLE-1/2
    d2t_identity: bool  # draft id == target id (no d2t, or Vd == V with zero offsets)
    max_position_embeddings: int
    fc_bias: bool
    own_embedding: bool
    source: str
    # Added in schema 2 without a bump (older manifests load with these defaults):
    format: str = "unknown"  # the detected checkpoint format (export/checkpoint/formats.py), e.g. "speculators-eagle3"
    num_layers: int = 1  # decoder layers in the head: one past/present K/V pair each in the draft graph
    options: dict = field(default_factory=dict)  # the head's math options (HeadOptions), as exported
    feature_layers_source: str | None = None  # where target.feature_layers came from (checkpoint, default, flag)
    reading: str = "config"  # --head-reading applied (export/checkpoint/readings.py): config, or a writer's reading


@dataclass(frozen=True)
class TableRef:
    """Where the draft's token-embedding table lies in the artifact: raw, C-ordered bytes in one of its files.

    Written by the exporter, read by ``runtime/embedding.py``, which gathers the draft's ``input_embeds`` from it
    (contract version 3): ``vocab_size`` rows of ``hidden_size`` elements. ``shared``: the table is the target's
    embedding in the target graph's data file (the artifact stores it once); otherwise the head brought its own,
    different one, in a file of its own."""

    file: str
    offset: int
    vocab_size: int
    hidden_size: int
    dtype: str
    shared: bool

    @property
    def shape(self) -> tuple[int, int]:
        return (self.vocab_size, self.hidden_size)

    @property
    def nbytes(self) -> int:
        from .dtypes import DTYPES

        return self.vocab_size * self.hidden_size * DTYPES[self.dtype].itemsize


@dataclass
class GraphEntry:
    file: str
    spec: GraphSpec
    axes: dict[str, list[int]]  # axis name -> [min, max] the runtime may use

    def to_dict(self) -> dict:
        return {"file": self.file, "spec": self.spec.to_dict(), "axes": self.axes}


@dataclass
class EngineEntry:
    """One serialized TensorRT engine, written by `eagle-export build` next to its ONNX graph."""

    file: str
    size_bytes: int
    build_s: float
    precision: str  # the artifact dtype: a strongly typed network keeps the ONNX graph's dtypes
    strongly_typed: bool
    # Optimisation profiles in index order: {name, axes: {axis: [min, opt, max]},
    # shapes: {input: {min, opt, max}}} as TensorRT read them back (engines/profiles.py computes them).
    profiles: list[dict]
    # Operators `build` appended to the engine's source (engines/round_ops.py): {"accept": true} for the verify
    # engine (its greedy acceptance), {"select": N} for a tree engine (its N best candidates as a verify tree);
    # empty for engines built before (the runtime then selects and accepts on the host).
    appended: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineEntry:
        return cls(file=d["file"], size_bytes=int(d["size_bytes"]), build_s=float(d["build_s"]),
                   precision=d["precision"], strongly_typed=bool(d["strongly_typed"]), profiles=list(d["profiles"]),
                   appended=dict(d.get("appended", {})))


@dataclass
class EnginesInfo:
    """What `eagle-export build` made: the library that built (and must run) the engines, options, engines."""

    lib: str  # Python module: "tensorrt" or "tensorrt_rtx"
    lib_version: str
    built_at: str
    options: dict  # max_batch, max_prefill, max_tree_tokens, workspace, timing_cache
    graphs: dict[str, EngineEntry]

    def to_dict(self) -> dict:
        return {"lib": self.lib, "lib_version": self.lib_version, "built_at": self.built_at,
                "options": dict(self.options), "graphs": {k: v.to_dict() for k, v in self.graphs.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> EnginesInfo:
        return cls(lib=d["lib"], lib_version=d["lib_version"], built_at=d["built_at"], options=dict(d["options"]),
                   graphs={k: EngineEntry.from_dict(v) for k, v in d["graphs"].items()})


@dataclass
class TunedInfo:
    """How `eagle-export tune` chose ``tree_defaults``: where it measured, what the winner gave, over how much."""

    backend: str
    threads: int | None
    device: str
    tree: dict  # {top_k, depth, total_tokens}: the winner, equal to tree_defaults when written
    ranked_by: str  # "speedup": median per-prompt EAGLE / no-draft ratio, measured side by side
    tau: float
    eagle_tok_s: float
    no_draft_tok_s: float
    speedup: float
    settings: int  # tree settings measured (both stages)
    prompts: int
    max_new_tokens: int
    repeats: int
    tuned_at: str  # UTC, ISO 8601
    eagle_export: str  # version that tuned
    # ONNX Runtime's thread spin policy tune measured fastest on that machine (``runtime.ort_backend.parse_spin``'s
    # form), the runtime's default there; None: the runtime's built-in default (older records, TensorRT).
    spin: str | None = None
    # The winner measured again as the runtime runs it, the speculation guard on (runtime/guard.py): the speedup a
    # later `bench` of the default should see. None: not measured (older records, a no-draft default).
    speedup_as_run: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("spin", "speedup_as_run"):  # older records have none: they round-trip unchanged
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TunedInfo:
        return cls(**d)


#: How ``export --draft-vocab`` ranked the tokens it kept: by their count in a text corpus, or by a proxy from the
#: tokenizer (the BPE merge that makes or first uses a token; else the token id: export/checkpoint/draft_vocab.py).
DRAFT_VOCAB_RANKINGS = ("corpus", "merge-rank", "token-id")
#: The artifact file listing the kept target ids (``DraftVocabInfo.file``).
DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclass
class DraftVocabInfo:
    """``export --draft-vocab N``: the draft's top-k runs over N target tokens instead of the head's whole vocabulary
    (the target's for EAGLE-1/2, the head's ``draft_vocab_size`` for EAGLE-3), so one draft level computes N lm_head
    rows, not all of them. The graphs map draft id i to target id ``ids[i]`` (EAGLE-3's d2t, applied inside the draft
    graphs), so the runtime only ever sees target ids; the target still verifies every token, so output is unchanged
    and only acceptance can drop.

    ``file`` (in the artifact) holds ``{"target_ids": [...]}``: the kept ids, ascending (draft id order), EOS ids
    always among them when the head has them. ``pruned_from``: the head's vocabulary before. ``ranking``: one of
    ``DRAFT_VOCAB_RANKINGS``; for "corpus" the corpus file's path, SHA-256 and token count say what was counted."""

    size: int
    pruned_from: int
    ranking: str
    file: str = DRAFT_VOCAB_FILE
    corpus: str | None = None
    corpus_sha256: str | None = None
    corpus_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftVocabInfo:
        tokens = d.get("corpus_tokens")
        return cls(size=int(d["size"]), pruned_from=int(d["pruned_from"]), ranking=str(d["ranking"]),
                   file=str(d.get("file", DRAFT_VOCAB_FILE)), corpus=d.get("corpus"),
                   corpus_sha256=d.get("corpus_sha256"), corpus_tokens=None if tokens is None else int(tokens))


#: The manifest key of DraftVocabInfo (absent: the head's whole vocabulary; older manifests have none).
DRAFT_VOCAB_KEY = "draft_vocab"


QUANT_BITS = (4, 8)  # weight-only block quantization (export --quantize int4|int8; export/quantization/matmuls.py)
QUANT_FORMS = ("nbits", "qdq")


@dataclass
class QuantizationInfo:
    """How `export --quantize` stored the graphs' MatMul weights: block-wise along K, ``W' = (q - zp) * scale``.

    ``method`` is "int4" or "int8" (the peer bench builds its int4 model for an "int4" artifact); ``graphs`` says
    which form each quantized graph holds: "nbits" (ONNX Runtime's MatMulNBits, at ``accuracy_level``) or "qdq"
    (DequantizeLinear -> MatMul, which TensorRT builds when symmetric and ONNX Runtime fuses into MatMulNBits at the
    session's ``session.qdq_matmulnbits_accuracy_level``, set to ``accuracy_level`` by the runtime). ``lm_head``:
    the target's output projection is quantized too (a tied embedding keeps its float copy); ``draft``: the draft
    graphs are, the lm_head they read included; ``target``: the target graphs are (False: `export
    --quantize-draft-only`, a float target whose draft alone is quantized). ``one_row_scratch``: the fused
    target graph runs a call of one row of one sequence as two rows (export/graphs/fused.py ``pad_one_row_attention``),
    the second a scratch row written to the cache row after the call's, so that a plain decoding step computes its row
    exactly as a verify computes it."""

    method: str
    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int
    draft: bool
    lm_head: bool
    graphs: dict[str, str]  # graph name -> form
    matmuls: dict[str, int] = field(default_factory=dict)  # graph name -> MatMuls quantized
    one_row_scratch: bool = False
    target: bool = True

    @property
    def rounds_activations(self) -> bool:
        """The target's MatMulNBits round each input row at this accuracy level (4: to int8 per block; 2 and 3: to a
        16-bit float where the CPU has such a kernel), which turns a verify row's last-bit differences from the same
        row decoded alone into visible ones: EAGLE is exact on chain trees only (tools/lab/results.md). False where
        only the draft is quantized: the draft's rounding changes what it proposes, never what the target keeps."""
        return self.target and self.accuracy_level > 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantizationInfo:
        return cls(method=str(d["method"]), bits=int(d["bits"]), block_size=int(d["block_size"]),
                   symmetric=bool(d["symmetric"]), accuracy_level=int(d["accuracy_level"]), draft=bool(d["draft"]),
                   lm_head=bool(d["lm_head"]), graphs={str(k): str(v) for k, v in d["graphs"].items()},
                   matmuls={str(k): int(v) for k, v in (d.get("matmuls") or {}).items()},
                   one_row_scratch=bool(d.get("one_row_scratch", False)), target=bool(d.get("target", True)))


#: The manifest key of QuantizationInfo (absent: float weights).
QUANTIZATION_KEY = "quantization"


@dataclass
class Manifest:
    variant: str
    dtype: str
    max_seq_len: int
    tree_limits: TreeLimits
    tree_defaults: TreeParams
    target: TargetInfo
    draft: DraftInfo
    graphs: dict[str, GraphEntry]
    has_tokenizer: bool
    draft_embedding: TableRef  # where the runtime reads the draft's input_embeds rows from (contract 3)
    versions: dict[str, str] = field(default_factory=dict)
    engines: EnginesInfo | None = None  # set by `eagle-export build`; older manifests have none
    tuned: TunedInfo | None = None  # set by `eagle-export tune`; older manifests have none
    # The tree per number of active sequences (`eagle-export tune --batch-sizes`; None: tree_defaults at any count).
    # Added in schema 2 without a bump: an older runtime ignores it.
    batch_trees: BatchTrees | None = None
    # Every file the export wrote beside manifest.json, name -> bytes (graphs, their data files, tokenizer files);
    # older manifests have none.
    files: dict[str, int] = field(default_factory=dict)
    quantization: QuantizationInfo | None = None  # set by `export --quantize`; None: float weights
    # Set by `export --draft-vocab`; None: the draft ranks the head's whole vocabulary (older manifests have none).
    draft_vocab: DraftVocabInfo | None = None
    schema_version: int = SCHEMA_VERSION
    contract_version: int = CONTRACT_VERSION

    @property
    def max_batch(self) -> int:
        """Most sequences per graph call: the top of the graphs' batch range (`export --max-batch`)."""
        return min(g.axes[C.BATCH][1] for g in self.graphs.values())

    def weights_label(self) -> str:
        """What the graphs' weights are, in a few words for reports: "float32", "int4 target and draft", "int4
        target, float32 draft", "float32 target, int8 draft" (`--quantize-draft-only`)."""
        q = self.quantization
        if q is None:
            return self.dtype
        if not q.target:
            return f"{self.dtype} target, {q.method} draft"
        return f"{q.method} target and draft" if q.draft else f"{q.method} target, {self.dtype} draft"

    def default_tree(self, max_batch: int = 1) -> TreeParams | None:
        """The tree a request given none decodes one sequence with: the per-batch table's row for 1 where there is one
        (None: no draft, which `eagle-export tune` writes where no tree paid; also when no row a runtime of
        ``max_batch`` sequences reaches drafts: such requests then never draft), else ``tree_defaults``."""
        table = self.batch_trees
        if table is None:
            return self.tree_defaults
        if not any(r.tree is not None for r in table.rows if r.active <= max_batch):
            return None
        return table.pick(1)

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "contract_version": self.contract_version,
            "variant": self.variant,
            "dtype": self.dtype,
            "max_seq_len": self.max_seq_len,
            "tree_limits": self.tree_limits.to_dict(),
            "tree_defaults": self.tree_defaults.to_dict(),
            "target": asdict(self.target),
            "draft": asdict(self.draft),
            "graphs": {k: v.to_dict() for k, v in self.graphs.items()},
            "has_tokenizer": self.has_tokenizer,
            "draft_embedding": asdict(self.draft_embedding),
            "versions": self.versions,
            **({"engines": self.engines.to_dict()} if self.engines is not None else {}),
            **({"tuned": self.tuned.to_dict()} if self.tuned is not None else {}),
            **({"batch_trees": self.batch_trees.to_list()} if self.batch_trees is not None else {}),
            **({"files": dict(self.files)} if self.files else {}),
            **({QUANTIZATION_KEY: self.quantization.to_dict()} if self.quantization is not None else {}),
            **({DRAFT_VOCAB_KEY: self.draft_vocab.to_dict()} if self.draft_vocab is not None else {}),
        }

    def write(self, directory: Path) -> Path:
        """Write manifest.json atomically (temporary file, then rename): readers never see half a manifest."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.partial")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        graphs = {
            k: GraphEntry(v["file"], spec_from_dict(v["spec"]), {a: list(r) for a, r in v["axes"].items()})
            for k, v in d["graphs"].items()
        }
        limits = TreeLimits(**d["tree_limits"])
        return cls(
            variant=d["variant"], dtype=d["dtype"], max_seq_len=int(d["max_seq_len"]),
            tree_limits=limits, tree_defaults=TreeParams(**d["tree_defaults"]),
            target=TargetInfo(**d["target"]), draft=DraftInfo(**d["draft"]), graphs=graphs,
            has_tokenizer=bool(d["has_tokenizer"]), draft_embedding=TableRef(**d["draft_embedding"]),
            versions=dict(d.get("versions", {})),
            engines=EnginesInfo.from_dict(d["engines"]) if d.get("engines") is not None else None,
            tuned=TunedInfo.from_dict(d["tuned"]) if d.get("tuned") is not None else None,
            batch_trees=BatchTrees.from_list(d["batch_trees"], limits) if d.get("batch_trees") is not None else None,
            files={str(k): int(v) for k, v in (d.get("files") or {}).items()},
            quantization=(QuantizationInfo.from_dict(d[QUANTIZATION_KEY]) if d.get(QUANTIZATION_KEY) is not None
                          else None),
            draft_vocab=(DraftVocabInfo.from_dict(d[DRAFT_VOCAB_KEY]) if d.get(DRAFT_VOCAB_KEY) is not None
                         else None),
            schema_version=int(d["schema_version"]), contract_version=int(d["contract_version"]),
        )


def load_manifest(directory: str | Path) -> Manifest:
    """Read and check an artifact directory's manifest; every problem is a ManifestError naming the fix."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory (expected an artifact made by `eagle-export export`)")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{directory} has no {MANIFEST_NAME}: not an eagle-export artifact, or an export that did not finish"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e})") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise ManifestError(
            f"{path} has schema_version {version!r}; this eagle-export reads version {SCHEMA_VERSION}: re-export"
        )
    if raw.get("contract_version") != CONTRACT_VERSION:
        raise ManifestError(
            f"{path} uses graph contract version {raw.get('contract_version')!r}; this runtime speaks "
            f"{CONTRACT_VERSION}: re-export"
        )
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path} is malformed ({type(e).__name__}: {e}): re-export") from None
    except GenerationError as e:  # a bad batch_trees table (BatchTrees.from_list)
        raise ManifestError(f"{path}: {e}: rerun `eagle-export tune --batch-sizes`, or delete the key") from None
    check_manifest(manifest, path)
    for name, entry in manifest.graphs.items():
        if not (directory / entry.file).is_file():
            raise ManifestError(f"{directory}: graph {name} file {entry.file} is missing")
    return manifest


def set_tree_defaults(directory: str | Path, tree: TreeParams | None, tuned: TunedInfo | None = None,
                      batch_trees: BatchTrees | None = None, clear_batch_trees: bool = False) -> Manifest:
    """Replace the artifact's ``tree_defaults`` (unless None; and its ``tuned`` record, and its ``batch_trees`` table
    when given; ``clear_batch_trees`` removes the table) in manifest.json, atomically.

    The file is edited as JSON, not re-serialised from a Manifest, so every other key keeps its value and order
    (keys this version does not know included). The result is checked like any manifest before the rename."""
    directory = Path(directory)
    load_manifest(directory)  # the artifact must be sound before we touch it
    path = directory / MANIFEST_NAME
    raw = json.loads(path.read_text())
    try:
        if tree is not None:
            tree.validate(TreeLimits(**raw["tree_limits"]))
        if batch_trees is not None:
            BatchTrees.from_list(batch_trees.to_list(), TreeLimits(**raw["tree_limits"]))
    except EagleExportError as e:
        raise ManifestError(f"{path}: cannot set tree_defaults / batch_trees: {e}") from None
    if tree is not None:
        raw["tree_defaults"] = tree.to_dict()
    if tuned is not None:
        raw["tuned"] = tuned.to_dict()
    if batch_trees is not None:
        raw["batch_trees"] = batch_trees.to_list()
    elif clear_batch_trees:
        raw.pop("batch_trees", None)
    manifest = Manifest.from_dict(raw)
    check_manifest(manifest, path)
    tmp = path.with_name(f".{MANIFEST_NAME}.partial")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, path)
    return manifest


def _tensor(spec: GraphSpec, name: str):
    for t in (*spec.inputs, *spec.outputs):
        if t.name == name:
            return t
    return None


def check_manifest(m: Manifest, path: Path | str = MANIFEST_NAME) -> None:
    """The runtime's expectations of a manifest: a known variant whose fields agree with each other and with
    the graph specs. Any disagreement is a ManifestError naming both values."""

    def fail(msg: str) -> None:
        raise ManifestError(f"{path}: {msg}: re-export")

    if m.variant not in VARIANTS:
        raise ManifestError(
            f"{path}: variant {m.variant!r} is not one of {', '.join(VARIANTS)} (an artifact from a newer "
            "eagle-export, or an edited manifest)"
        )
    t, d = m.target, m.draft
    if m.variant == "eagle1":
        if t.feature_layers is not None:
            fail(f"variant 'eagle1' reads the final hidden state but target.feature_layers is {t.feature_layers}")
        if t.feature_dim != t.hidden_size:
            fail(f"variant 'eagle1' needs target.feature_dim == target.hidden_size ({t.hidden_size}), got "
                 f"{t.feature_dim}")
        pruned = m.draft_vocab is not None
        if (d.vocab_size != t.vocab_size or not d.d2t_identity) and not pruned:
            fail(f"variant 'eagle1' drafts over the target vocabulary ({t.vocab_size}), but draft.vocab_size is "
                 f"{d.vocab_size} (d2t_identity {d.d2t_identity}) and there is no {DRAFT_VOCAB_KEY} entry")
        if pruned and m.draft_vocab.pruned_from != t.vocab_size:
            fail(f"variant 'eagle1' prunes the target vocabulary ({t.vocab_size}), but {DRAFT_VOCAB_KEY}.pruned_from "
                 f"is {m.draft_vocab.pruned_from}")
    else:
        layers = t.feature_layers
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and 0 <= i < t.num_layers for i in layers)):
            fail(f"variant 'eagle3' needs target.feature_layers as layer indices in [0, {t.num_layers}) (repeats "
                 f"allowed), got {layers!r}")
        if t.feature_dim != len(layers) * t.hidden_size:
            fail(f"target.feature_dim {t.feature_dim} is not len(feature_layers {layers}) x hidden_size "
                 f"{t.hidden_size} = {len(layers) * t.hidden_size}")
        if not 1 <= d.vocab_size <= t.vocab_size:
            fail(f"draft.vocab_size {d.vocab_size} must be between 1 and target.vocab_size {t.vocab_size}")
        if d.d2t_identity and d.vocab_size != t.vocab_size:
            fail(f"draft.d2t_identity is true but draft.vocab_size {d.vocab_size} != target.vocab_size "
                 f"{t.vocab_size}")
    if m.draft_vocab is not None:
        _check_draft_vocab(m, fail)
    if not isinstance(d.num_layers, int) or d.num_layers < 1:
        fail(f"draft.num_layers must be a positive integer, got {d.num_layers!r}")
    if d.feature_dim != t.feature_dim:
        fail(f"draft.feature_dim {d.feature_dim} != target.feature_dim {t.feature_dim}")
    if m.batch_trees is not None and m.batch_trees.rows[-1].active > m.max_batch:
        raise ManifestError(f"{path}: batch_trees has a row for {m.batch_trees.rows[-1].active} active sequences, more "
                            f"than the artifact's --max-batch {m.max_batch}: rerun `eagle-export tune --batch-sizes`")
    if m.tree_limits.max_top_k > d.vocab_size:
        fail(f"tree_limits.max_top_k {m.tree_limits.max_top_k} exceeds draft.vocab_size {d.vocab_size}")
    # The graph specs must say the same widths as the fields the runtime sizes its buffers from.
    want = {
        (C.TARGET_GRAPH, C.FEATURES): t.feature_dim,
        (C.TARGET_GRAPH, C.LOGITS): t.vocab_size,
        (C.DRAFT_GRAPH, C.INPUT_EMBEDS): d.hidden_size,
        (C.DRAFT_GRAPH, C.DRAFT_FEATURES): d.feature_dim,
        (C.DRAFT_GRAPH, C.HIDDEN_IN): d.hidden_size,
        (C.DRAFT_GRAPH, C.HIDDEN): d.hidden_size,
        (C.DRAFT_GRAPH, C.TOPK_IDS): m.tree_limits.max_top_k,
    }
    for (graph, name), width in want.items():
        entry = m.graphs.get(graph)
        if entry is None:
            fail(f"graph {graph} is not listed")
        spec = _tensor(entry.spec, name)
        if spec is None:
            fail(f"graph {graph} has no {name!r} in its spec (contract version {m.contract_version})")
        if spec.shape[-1] != width:
            fail(f"graph {graph} {name!r} is {spec.shape[-1]} wide but the manifest fields say {width}")
    q = m.quantization
    if q is not None:
        if q.bits not in QUANT_BITS or q.method != f"int{q.bits}":
            fail(f"quantization.method {q.method!r} / bits {q.bits} is not one of int4, int8")
        for name, form in q.graphs.items():
            if name not in m.graphs or form not in QUANT_FORMS:
                fail(f"quantization.graphs names {name!r} in form {form!r}: not a graph of the artifact in one of "
                     f"{', '.join(QUANT_FORMS)}")
        if not q.target and (not q.draft or C.TARGET_GRAPH in q.graphs or C.TARGET_FUSED_GRAPH in q.graphs):
            fail("quantization.target is false (a float target) but the record quantizes "
                 + ("no draft graph" if not q.draft else "a target graph"))
    e = m.draft_embedding
    if e.hidden_size != d.hidden_size or e.vocab_size != t.vocab_size or e.dtype != m.dtype:
        fail(f"draft_embedding is a {e.vocab_size} x {e.hidden_size} {e.dtype} table, but the draft embeds "
             f"{t.vocab_size} target ids into {d.hidden_size} {m.dtype} rows")
    if e.offset < 0 or (m.files and e.file not in m.files):
        fail(f"draft_embedding names file {e.file!r} at offset {e.offset}, which the artifact does not list")
    if m.files and e.offset + e.nbytes > m.files[e.file]:
        fail(f"draft_embedding ({e.nbytes} bytes at offset {e.offset}) runs past the end of {e.file} "
             f"({m.files[e.file]} bytes)")


def _check_draft_vocab(m: Manifest, fail) -> None:
    """The ``draft_vocab`` entry against the draft fields it sets: a pruned draft ranks ``size`` tokens through an
    id map, fewer than it was pruned from, and says how it ranked them."""
    v, d = m.draft_vocab, m.draft
    if v.ranking not in DRAFT_VOCAB_RANKINGS:
        fail(f"{DRAFT_VOCAB_KEY}.ranking {v.ranking!r} is not one of {', '.join(DRAFT_VOCAB_RANKINGS)}")
    if v.size != d.vocab_size or d.d2t_identity:
        fail(f"{DRAFT_VOCAB_KEY}.size {v.size} must equal draft.vocab_size {d.vocab_size}, with d2t_identity false "
             f"(it is {d.d2t_identity})")
    if not 1 <= v.size < v.pruned_from <= m.target.vocab_size:
        fail(f"{DRAFT_VOCAB_KEY} keeps {v.size} of {v.pruned_from} tokens: needs 1 <= size < pruned_from <= "
             f"target.vocab_size {m.target.vocab_size}")
    if (v.ranking == "corpus") != (v.corpus is not None):
        fail(f"{DRAFT_VOCAB_KEY}.corpus is {v.corpus!r} but the ranking is {v.ranking!r}")
    if m.files and v.file not in m.files:
        fail(f"{DRAFT_VOCAB_KEY}.file {v.file!r} is not one of the artifact's files")


def read_draft_vocab(directory: str | Path, m: Manifest) -> list[int]:
    """The target ids an ``export --draft-vocab`` artifact's draft ranks (draft id i is target id ``ids[i]``), read from
    its ``draft_vocab`` file and checked: ``size`` distinct ascending ids inside the target vocabulary."""
    v = m.draft_vocab
    if v is None:
        raise ManifestError(f"{directory}: the artifact was not exported with --draft-vocab")
    path = Path(directory) / v.file
    try:
        ids = json.loads(path.read_text())["target_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{path}: cannot read the kept draft vocabulary ({type(e).__name__}: {e}): re-export"
                            ) from None
    ok = (isinstance(ids, list) and len(ids) == v.size and all(isinstance(i, int) for i in ids)
          and all(0 <= i < m.target.vocab_size for i in ids)
          and all(a < b for a, b in zip(ids, ids[1:], strict=False)))
    if not ok:
        raise ManifestError(f"{path}: expected {v.size} distinct ascending target ids below {m.target.vocab_size}: "
                            "re-export")
    return ids

"""The artifact manifest: what an exported directory holds, written once by the exporter, checked by the runtime."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .contract import CONTRACT_VERSION, GraphSpec, spec_from_dict
from .errors import ManifestError
from .tree_params import TreeLimits, TreeParams

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
VARIANTS = ("eagle1",)  # EAGLE-1 and EAGLE-2 heads share one layout; EAGLE-2 is the dynamic tree policy.


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
    max_position_embeddings: int
    fc_bias: bool
    own_embedding: bool
    source: str


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineEntry:
        return cls(file=d["file"], size_bytes=int(d["size_bytes"]), build_s=float(d["build_s"]),
                   precision=d["precision"], strongly_typed=bool(d["strongly_typed"]), profiles=list(d["profiles"]))


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
    versions: dict[str, str] = field(default_factory=dict)
    engines: EnginesInfo | None = None  # set by `eagle-export build`; older manifests have none
    schema_version: int = SCHEMA_VERSION
    contract_version: int = CONTRACT_VERSION

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
            "versions": self.versions,
            **({"engines": self.engines.to_dict()} if self.engines is not None else {}),
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
        return cls(
            variant=d["variant"], dtype=d["dtype"], max_seq_len=int(d["max_seq_len"]),
            tree_limits=TreeLimits(**d["tree_limits"]), tree_defaults=TreeParams(**d["tree_defaults"]),
            target=TargetInfo(**d["target"]), draft=DraftInfo(**d["draft"]), graphs=graphs,
            has_tokenizer=bool(d["has_tokenizer"]), versions=dict(d.get("versions", {})),
            engines=EnginesInfo.from_dict(d["engines"]) if d.get("engines") is not None else None,
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
    if manifest.variant not in VARIANTS:
        raise ManifestError(f"{path}: variant {manifest.variant!r} is not one of {', '.join(VARIANTS)}")
    for name, entry in manifest.graphs.items():
        if not (directory / entry.file).is_file():
            raise ManifestError(f"{directory}: graph {name} file {entry.file} is missing")
    return manifest

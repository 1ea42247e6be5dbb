"""The runtime's checks of an artifact directory: every broken or foreign artifact is a ManifestError
with a clear message, a good manifest round-trips, and an opened runtime allocates its buffers once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_table import EAGLE3_MODELS

from eagle_export import contract as C
from eagle_export.contract import CONTRACT_VERSION
from eagle_export.errors import ManifestError
from eagle_export.manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest, load_manifest
from eagle_export.runtime import EagleRuntime


@pytest.fixture(scope="module")
def artifact(models) -> Path:
    return models("mha")[2]


@pytest.fixture
def copy(artifact, tmp_path) -> Path:
    return shutil.copytree(artifact, tmp_path / "art")


def edit_manifest(d: Path, fn) -> None:
    path = d / MANIFEST_NAME
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def broken(d: Path, *fragments: str, runtime_only: bool = False) -> str:
    """Both load_manifest (unless the problem is in a graph file) and EagleRuntime.open must refuse d."""
    calls = [EagleRuntime.open] if runtime_only else [load_manifest, EagleRuntime.open]
    msgs = []
    for call in calls:
        with pytest.raises(ManifestError) as info:
            call(d)
        msg = str(info.value)
        for f in fragments:
            assert f in msg, f"{call.__qualname__}: {f!r} not in {msg!r}"
        msgs.append(msg)
    return msgs[-1]


def test_not_a_directory(tmp_path):
    f = tmp_path / "file.onnx"
    f.write_bytes(b"x")
    broken(f, str(f), "not a directory", "eagle-export export")
    broken(tmp_path / "missing", "not a directory")


def test_missing_manifest(copy):
    (copy / MANIFEST_NAME).unlink()
    broken(copy, str(copy), f"no {MANIFEST_NAME}", "did not finish")


def test_manifest_not_json(copy):
    (copy / MANIFEST_NAME).write_text('{"schema_version": 1, "variant": ')
    broken(copy, str(copy / MANIFEST_NAME), "not valid JSON")


def test_manifest_not_an_object(copy):
    (copy / MANIFEST_NAME).write_text("[1, 2, 3]")
    broken(copy, "schema_version None", "re-export")


def test_schema_version_changed(copy):
    edit_manifest(copy, lambda m: m.update(schema_version=SCHEMA_VERSION + 1))
    broken(copy, f"schema_version {SCHEMA_VERSION + 1}", f"reads version {SCHEMA_VERSION}", "re-export")


def test_contract_version_changed(copy):
    edit_manifest(copy, lambda m: m.update(contract_version=CONTRACT_VERSION + 1))
    broken(copy, f"contract version {CONTRACT_VERSION + 1}", f"speaks {CONTRACT_VERSION}", "re-export")


def test_draft_embedding_outside_its_file(copy):
    """A table that would run past the end of its file, or names a file the artifact does not list, is refused at
    load (the runtime would otherwise read the wrong bytes)."""
    edit_manifest(copy, lambda m: m["draft_embedding"].update(offset=m["files"][m["draft_embedding"]["file"]]))
    broken(copy, "draft_embedding", "runs past the end of target_verify.onnx.data", "re-export")
    edit_manifest(copy, lambda m: m["draft_embedding"].update(offset=0, file="elsewhere.bin"))
    broken(copy, "draft_embedding names file 'elsewhere.bin'", "does not list")
    edit_manifest(copy, lambda m: m["draft_embedding"].update(file="target_verify.onnx.data", hidden_size=3))
    broken(copy, "draft_embedding is a", "x 3", "rows")


def test_missing_field(copy):
    edit_manifest(copy, lambda m: m.pop("target"))
    broken(copy, "malformed", "'target'", "re-export")


def test_eagle1_manifest_fields(artifact):
    m = load_manifest(artifact)
    assert m.variant == "eagle1" and m.target.feature_layers is None
    assert m.target.feature_dim == m.draft.feature_dim == m.target.hidden_size
    assert m.draft.vocab_size == m.target.vocab_size and m.draft.d2t_identity is True


@pytest.fixture(scope="module")
def artifact3(models) -> Path:
    preset, kw = EAGLE3_MODELS["llama-d2t"]
    return models(preset, **kw)[2]


@pytest.fixture
def copy3(artifact3, tmp_path) -> Path:
    return shutil.copytree(artifact3, tmp_path / "art3")


def test_eagle3_manifest_fields(artifact3, models):
    m = load_manifest(artifact3)
    assert m.variant == "eagle3" and m.target.feature_layers == [0, 1, 2]
    assert m.target.feature_dim == m.draft.feature_dim == 3 * 64
    assert (m.draft.vocab_size, m.draft.d2t_identity, m.target.vocab_size) == (32, False, 48)
    spec = m.graphs["draft_step"].spec
    assert [t.name for t in spec.inputs][:3] == ["input_embeds", "features", "hidden_in"]
    preset, kw = EAGLE3_MODELS["qwen2-identity"]
    m2 = load_manifest(models(preset, **kw)[2])
    assert (m2.draft.vocab_size, m2.draft.d2t_identity, m2.target.architecture) == (48, True, "Qwen2ForCausalLM")


@pytest.mark.parametrize("edit, fragments", [
    (lambda m: m["target"].update(feature_dim=128),
     ("target.feature_dim 128", "len(feature_layers [0, 1, 2]) x hidden_size 64 = 192", "re-export")),
    (lambda m: m["target"].update(feature_layers=[0, 7]), ("target.feature_layers", "[0, 3)", "[0, 7]")),
    (lambda m: m.update(variant="eagle1"), ("variant 'eagle1'", "feature_layers is [0, 1, 2]")),
    (lambda m: m["draft"].update(vocab_size=100), ("draft.vocab_size 100", "target.vocab_size 48")),
    (lambda m: m["draft"].update(d2t_identity=True), ("d2t_identity", "32", "48")),
    (lambda m: m["draft"].update(feature_dim=64), ("draft.feature_dim 64", "target.feature_dim 192")),
    (lambda m: m["graphs"]["draft_step"]["spec"]["inputs"][2].update(shape=["batch", "hidden_rows", 65]),
     ("draft_step", "'hidden_in' is 65 wide", "say 64")),
])
def test_eagle3_inconsistent_manifest_refused(copy3, edit, fragments):
    edit_manifest(copy3, edit)
    broken(copy3, *fragments)


def test_eagle1_artifact_relabelled_eagle3_refused(copy):
    edit_manifest(copy, lambda m: m.update(variant="eagle3"))
    broken(copy, "variant 'eagle3' needs target.feature_layers", "None")


def test_unknown_variant(copy):
    edit_manifest(copy, lambda m: m.update(variant="eagle4"))
    broken(copy, "variant 'eagle4'", "eagle1, eagle3")


@pytest.mark.parametrize("graph", ["target_verify", "draft_step"])
def test_graph_file_deleted(copy, graph):
    (copy / f"{graph}.onnx").unlink()
    broken(copy, f"graph {graph}", f"{graph}.onnx", "missing")


def test_external_data_deleted(copy):
    (copy / "draft_step.onnx.data").unlink()
    broken(copy, "could not load graph", str(copy / "draft_step.onnx"), "draft_step.onnx.data", runtime_only=True)


@pytest.mark.parametrize("how", ["few_bytes", "truncated"])
def test_corrupt_onnx(copy, how):
    m = load_manifest(copy)  # the target graph ONNX Runtime runs (the fused one, where there is one)
    path = copy / m.graphs[C.graph_for("ort", "target", m.graphs)].file
    data = path.read_bytes()
    path.write_bytes(b"\x08\x07garbage" if how == "few_bytes" else data[: len(data) // 3])
    load_manifest(copy)  # the manifest itself is fine; the runtime finds the broken graph
    broken(copy, "could not load graph", str(path), runtime_only=True)


def test_graph_with_other_inputs_than_listed(copy):
    # The target entry points at the draft graph: its inputs/outputs are not the listed ones.
    graph = C.graph_for("ort", "target", load_manifest(copy).graphs)
    edit_manifest(copy, lambda m: m["graphs"][graph].update(file="draft_step.onnx"))
    broken(copy, "draft_step.onnx", "inputs/outputs", "re-export", runtime_only=True)


def test_manifest_round_trip(artifact):
    m = load_manifest(artifact)
    d = m.to_dict()
    again = Manifest.from_dict(d)
    assert again.to_dict() == d
    assert again == m
    assert d == json.loads((artifact / MANIFEST_NAME).read_text())
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    assert m.schema_version == SCHEMA_VERSION and m.contract_version == CONTRACT_VERSION


def test_runtime_allocates_buffers_once(artifact):
    rt = EagleRuntime.open(artifact)
    g = rt.generator
    m = rt.manifest
    assert g.tcache.capacity == m.max_seq_len + m.tree_limits.max_total_tokens + 1
    assert len(g.tcache.buffers) == 2 * m.target.num_layers and len(g.dcache.buffers) == 2

    def pointers() -> list[int]:
        tensors = [*g.tcache.allocations, *g.dcache.allocations, g.logits,
                   g.tfeats, g.dvals, g.dids, g.dhidden, g.dfeats_in, g.dhidden_in]
        scratch = [g._mask, g._ids, g._pos, g._lidx]
        return [t.data_ptr() for t in tensors] + [s.array.ctypes.data for s in scratch]

    before = pointers()
    a = rt.generate(prompt_ids=[3, 9, 27, 33, 40], max_new_tokens=20, stop_on_eos=False)
    after_first = pointers()
    b = rt.generate(prompt_ids=list(range(3, 40)), max_new_tokens=30, stop_on_eos=False)
    c = rt.generate(prompt_ids=[3, 9, 27, 33, 40], max_new_tokens=20, stop_on_eos=False, use_draft=False)
    assert before == after_first == pointers()
    assert len(a.tokens) == 20 and len(b.tokens) == 30
    assert c.tokens == a.tokens  # a reused runtime gives the same answer

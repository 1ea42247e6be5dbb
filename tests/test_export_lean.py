"""The lean export path (export/data/lean.py) on tiny models pushed through it with lean_threshold_bytes=0:
the same graphs' values as the in-memory path, exactly the manifest's files, each graph on its own data file,
each tensor stored once, and nothing left behind on success or when the export fails halfway."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors
import torch

from eagle_export import contract as C
from eagle_export.errors import CheckpointError
from eagle_export.export.exporter import ExportOptions, export_with_report
from eagle_export.manifest import MANIFEST_NAME, load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.embedding import TokenEmbedding
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target

LEAN = 0  # lean_threshold_bytes: every safetensors target takes the lean path
IN_MEMORY = 1 << 60


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """A function that points TMPDIR (and tempfile's cached choice) at an empty folder of the test's own, and
    returns it. Called after the tiny models are made: libraries' first-use caches (torch's inductor folder,
    ONNX Runtime's session file) land in TMPDIR when they are first touched, and are not the export's doing."""

    def isolate() -> Path:
        d = tmp_path / "TMPDIR"
        d.mkdir()
        monkeypatch.setenv("TMPDIR", str(d))
        monkeypatch.setattr(tempfile, "tempdir", str(d))
        return d

    return isolate


def _export(target, draft, out, threshold, dtype="fp32", **kw):
    opts = ExportOptions(dtype=dtype, max_seq_len=64, lean_threshold_bytes=threshold, **kw)
    return export_with_report(target, draft, out, opts, progress=False)


def _initializers(graph_path: Path) -> list[onnx.TensorProto]:
    return list(onnx.load(str(graph_path), load_external_data=False).graph.initializer)


def _sharded_copy(target: Path, out: Path) -> Path:
    """The same target saved as save_pretrained shards it (several safetensors files + an index)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    model.save_pretrained(out, max_shard_size="40KB")
    for f in target.iterdir():
        if not f.name.endswith(".safetensors") and not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    return out


def _target_outputs(art: Path, n: int = 5, past: int = 3) -> list[np.ndarray]:
    """Every output of the artifact's target graph on one fixed input (random cache, a tree-like mask)."""
    m = load_manifest(art)
    t = m.target
    rng = np.random.default_rng(0)
    dt = np.dtype(m.dtype)
    feed = {C.INPUT_IDS: rng.integers(0, t.vocab_size, (1, n)), C.POSITION_IDS: np.arange(past, past + n)[None],
            C.ATTENTION_MASK: np.tril(np.ones((n, past + n), bool), past)[None],
            C.LOGIT_INDICES: np.arange(n)[None]}
    for name in C.past_names(t.num_layers):
        feed[name] = rng.standard_normal((1, past, t.kv_heads, t.head_dim)).astype(dt)
    sess = ort.InferenceSession(str(art / f"{C.TARGET_GRAPH}.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _draft_outputs(art: Path, n: int = 5) -> list[np.ndarray]:
    """Every output of the artifact's draft graph on one context pass, its input_embeds gathered by the runtime's
    TokenEmbedding from the artifact's table."""
    m = load_manifest(art)
    d = m.draft
    rng = np.random.default_rng(1)
    dt = np.dtype(m.dtype)
    feed = {C.INPUT_EMBEDS: TokenEmbedding.open(art, m).rows(rng.integers(0, m.target.vocab_size, (1, n))).numpy(),
            C.DRAFT_FEATURES: rng.standard_normal((1, n, d.feature_dim)).astype(dt),
            C.HIDDEN_IN: np.zeros((1, 0, d.hidden_size), dt), C.POSITION_IDS: np.arange(n)[None],
            C.ATTENTION_MASK: np.tril(np.ones((n, n), bool))[None]}
    for name in C.past_names(d.num_layers):
        feed[name] = np.zeros((1, 0, d.kv_heads, d.head_dim), dt)
    sess = ort.InferenceSession(str(art / f"{C.DRAFT_GRAPH}.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


@pytest.mark.parametrize("preset,eagle3,dtype", [("tied", False, "fp32"), ("gqa", True, "fp16"),
                                                  ("qwen3_moe", True, "fp32")])
def test_lean_export_equals_in_memory_export(tmp_path, preset, eagle3, dtype):
    """Same graph outputs and the same greedy tokens (EAGLE and no-draft) from a sharded checkpoint streamed
    tensor by tensor as from the whole model traced with its weights. Qwen3-MoE's checkpoint holds one tensor per
    expert and projection, which transformers merges into one parameter per layer: the lean path merges them the
    same way (a wrong order of gate and up, or of the experts, changes the outputs)."""
    target = make_tiny_target(tmp_path / "t", preset, with_tokenizer=False, vocab_size=48)
    draft = (make_tiny_eagle3_draft(tmp_path / "d", target, seed=1) if eagle3
             else make_tiny_draft(tmp_path / "d", target, seed=1, fc_bias=True))
    sharded = _sharded_copy(target, tmp_path / "t_sharded")
    ref = _export(target, draft, tmp_path / "mem", IN_MEMORY, dtype)
    lean = _export(sharded, draft, tmp_path / "lean", LEAN, dtype)
    assert (ref.lean, lean.lean) == (False, True)
    tol = 1e-5 if dtype == "fp32" else 2e-3
    for a, b in zip(_target_outputs(ref.path), _target_outputs(lean.path), strict=True):
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol, atol=tol)
    # The draft graph too, fed from each artifact's own table (the target's, in each target graph's data file).
    tables = [load_manifest(a).draft_embedding for a in (ref.path, lean.path)]
    assert all(t.shared and t.file == "target_verify.onnx.data" for t in tables)
    for a, b in zip(_draft_outputs(ref.path), _draft_outputs(lean.path), strict=True):
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol, atol=tol)
    runs = []
    for art in (ref.path, lean.path):
        rt = EagleRuntime.open(art)
        assert rt.open_s is not None and rt.open_s > 0  # open reports its load time
        runs.append([rt.generate(prompt_ids=[3, 5, 7, 9], max_new_tokens=24, stop_on_eos=False,
                                 use_draft=use).tokens for use in (True, False)])
    assert runs[0] == runs[1]
    assert runs[1][0] == runs[1][1]  # lossless on the lean artifact


def test_lean_export_leaves_exactly_the_manifest_files(tmp_path, tmpdir_env):
    """Files = the manifest's list (sizes included) + manifest.json; each graph's initializers all live in its own
    data file; no partial directory beside the artifact, nothing in TMPDIR; a tied embedding stored once."""
    target = make_tiny_target(tmp_path / "t", "tied", with_tokenizer=True, vocab_size=300)
    draft = make_tiny_draft(tmp_path / "d", target, seed=1, fc_bias=True)
    out = tmp_path / "out" / "art"
    tmpdir_env = tmpdir_env()
    rep = _export(target, draft, out, LEAN)
    assert rep.lean
    m = load_manifest(out)
    on_disk = {f.name: f.stat().st_size for f in out.iterdir()}
    assert set(on_disk) == set(m.files) | {MANIFEST_NAME}
    assert {k: on_disk[k] for k in m.files} == m.files
    assert {"tokenizer.json", "target_verify.onnx.data", "draft_step.onnx.data"} <= set(m.files)
    for name, g in m.graphs.items():
        inits = _initializers(out / g.file)
        assert inits
        # The fused target graph reads the weights it shares with the standard one from that graph's data file; the
        # draft tree graph its head's from the step graph's, the embedding from the target graph's.
        homes = {g.file + ".data"} | ({m.graphs[C.TARGET_GRAPH].file + ".data"} if name == C.TARGET_FUSED_GRAPH
                                     else set())
        if C.is_tree_graph(name):  # and what the tree graphs hold their own way, from the first one's
            first = next(iter(C.tree_graphs(m.graphs).values()))[0]
            homes |= {m.graphs[C.DRAFT_GRAPH].file + ".data", m.graphs[C.TARGET_GRAPH].file + ".data",
                      m.graphs[first].file + ".data"}
        for t in inits:
            assert t.data_location == onnx.TensorProto.EXTERNAL, t.name
            assert {e.key: e.value for e in t.external_data}["location"] in homes, t.name
    assert sorted(p.name for p in out.parent.iterdir()) == ["art"]
    assert list(tmpdir_env.iterdir()) == []
    # Tied embedding / lm_head: one [V, H]-sized initializer in the target graph, and its data is the
    # checkpoint's unique weights (nothing stored twice).
    mcfg = m.target
    big = [t for t in _initializers(out / "target_verify.onnx") if mcfg.vocab_size in t.dims]
    assert len(big) == 1, [(t.name, list(t.dims)) for t in big]
    assert list(big[0].dims) == [mcfg.vocab_size, mcfg.hidden_size]  # row-major, as its Gathers read it
    with safetensors.safe_open(str(target / "model.safetensors"), "pt") as f:
        ckpt = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) * 4  # fp32, as exported
    data = (out / "target_verify.onnx.data").stat().st_size
    assert ckpt <= data < ckpt * 1.02 + 64 * 1024
    # The draft reads that one table (no lookup of a copy in its graph; its one [V, H] initializer is the EAGLE-1/2
    # head's lm_head, kept on purpose: tools/lab/results.md): every row the runtime gathers is the checkpoint's.
    draft = onnx.load(str(out / "draft_step.onnx"), load_external_data=False).graph
    tables = {t.name for t in draft.initializer if mcfg.vocab_size in t.dims}
    assert len(tables) == 1 and not [n for n in draft.node if n.op_type == "Gather" and n.input[0] in tables]
    ref = m.draft_embedding
    assert (ref.file, ref.shared) == ("target_verify.onnx.data", True)
    with safetensors.safe_open(str(target / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.embed_tokens.weight")
    got = TokenEmbedding.open(out, m).rows(np.arange(mcfg.vocab_size))
    assert torch.equal(got, want)


def test_lean_export_failing_halfway_leaves_nothing(tmp_path, tmpdir_env, monkeypatch):
    """A read error in the middle of streaming the weights: the error propagates, no partial directory or temporary
    file stays anywhere, and the artifact an --overwrite export was replacing is left as it was."""
    target = make_tiny_target(tmp_path / "t", "mha", with_tokenizer=False, vocab_size=48)
    draft = make_tiny_draft(tmp_path / "d", target, seed=1, fc_bias=True)
    out = tmp_path / "out" / "art"
    tmpdir_env = tmpdir_env()
    _export(target, draft, out, LEAN)
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    real = safetensors.safe_open
    calls = {"n": 0}

    def failing_open(path, *args, **kwargs):  # the library as documented, until the disk "fails"
        calls["n"] += 1
        if calls["n"] == 12:
            raise OSError(5, "Input/output error", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", failing_open)
    with pytest.raises(OSError, match="Input/output error"):
        _export(target, draft, out, LEAN, overwrite=True)
    assert calls["n"] == 12  # it failed while streaming, after some tensors were written
    assert sorted(p.name for p in out.parent.iterdir()) == ["art"]
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert list(tmpdir_env.iterdir()) == []
    monkeypatch.setattr(safetensors, "safe_open", real)
    with pytest.raises(CheckpointError):  # a fresh export that fails leaves no directory at all
        (target / "model.safetensors").write_bytes(b"\0" * 16)
        _export(target, draft, tmp_path / "out" / "other", LEAN)
    assert sorted(p.name for p in out.parent.iterdir()) == ["art"]
    assert list(tmpdir_env.iterdir()) == []


def test_lean_export_shares_or_stores_a_heads_own_embedding(tmp_path):
    """On the lean path (the target never loaded), a head's embed_tokens equal to the target's (read from the
    checkpoint to compare) shares the target's table; a different one is stored once, in its own file, and is
    what the runtime gathers."""
    target = make_tiny_target(tmp_path / "t", "mha", with_tokenizer=False, vocab_size=48)
    with safetensors.safe_open(str(target / "model.safetensors"), "pt") as f:
        target_table = f.get_tensor("model.embed_tokens.weight")
    for kind in ("copy", "random"):
        draft = make_tiny_draft(tmp_path / f"d_{kind}", target, seed=1, own_embedding=kind)
        rep = _export(target, draft, tmp_path / kind, LEAN)
        m = load_manifest(rep.path)
        ref = m.draft_embedding
        rows = TokenEmbedding.open(rep.path, m).rows(np.arange(m.target.vocab_size))
        if kind == "copy":
            assert ref.shared and ref.file == "target_verify.onnx.data" and torch.equal(rows, target_table)
            assert "draft_embed_tokens.bin" not in m.files
        else:
            with safetensors.safe_open(str(draft / "model.safetensors"), "pt") as f:
                own = f.get_tensor("embed_tokens.weight")
            assert not ref.shared and ref.file == "draft_embed_tokens.bin" in m.files
            assert torch.equal(rows, own) and not torch.equal(rows, target_table)

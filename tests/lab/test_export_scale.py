"""tools/lab/export_scale: its streamed safetensors writer and its published-layout checkpoints, on tiny shapes."""

from __future__ import annotations

import json

import export_scale as S
import pytest
import safetensors
import torch

from eagle_export import contract as C
from eagle_export.export.exporter import ExportOptions, export_with_report
from eagle_export.export.quantization.artifact import QuantizeOptions
from eagle_export.manifest import load_manifest


def test_write_safetensors_reads_back_with_the_library(tmp_path):
    """Header offsets, padding and byte order as safetensors reads them: every tensor comes back equal."""
    want = {"a": torch.randn(3, 5).half(), "b": torch.arange(7, dtype=torch.int64), "c": torch.rand(2, 3) > 0.5,
            "d": torch.randn(4, 1, 2)}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in want.items()]
    path = tmp_path / "x.safetensors"
    S.write_safetensors(path, specs, lambda name, shape, dtype: want[name])
    with safetensors.safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for k, v in want.items():
            assert torch.equal(f.get_tensor(k), v), k


# head_dim 16: the fused target graph's smallest (GroupQueryAttention takes multiples of 16), so the artifact has
# both target graphs, as the real shapes' artifacts do.
TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, tie_word_embeddings=False, rope=S.LLAMA3_ROPE)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_published_layout_checkpoints_export_lean(tmp_path, monkeypatch, quantize):
    """A sharded random target (index + shards, as save_pretrained writes them) and an EAGLE-3 head in the
    published layout load, fit each other and go through the lean export (float, and --quantize int4); the
    open-and-time step times the target graph the runtime opened (the fused one)."""
    monkeypatch.setattr(S, "SHARD_BYTES", 3 << 20)
    monkeypatch.setattr(S, "CONTEXT", 40)  # the cache rows timed calls see; max_seq_len 64 holds 40 + 32
    target, head = tmp_path / "target", tmp_path / "eagle3"
    total = S.write_target(target, TINY)
    S.write_eagle3_head(head, TINY)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert len(set(index["weight_map"].values())) >= 2
    quant = None if quantize is None else QuantizeOptions(bits=4)
    rep = export_with_report(target, head, tmp_path / "art",
                             ExportOptions(dtype="fp16", max_seq_len=64, lean_threshold_bytes=0, quantize=quant),
                             progress=False)
    assert rep.lean and rep.weights_bytes > total  # target + head
    m = load_manifest(rep.path)
    assert (m.variant, m.draft.vocab_size, m.target.vocab_size) == ("eagle3", S.DRAFT_VOCAB, S.VOCAB)
    assert C.TARGET_FUSED_GRAPH in m.graphs
    opened = S.child_open(str(rep.path), reps=1, clock="cpu")
    assert opened["target_graph"] == C.TARGET_FUSED_GRAPH  # what the runtime opened (it has no standard session)
    assert set(opened["costs"]) == {"step", "verify_tree", "draft", *(f"verify{n}" for n in S.VERIFY_SIZES)}
    assert opened["open_s"] > 0 and opened["open_rss"] > 0
    if quantize is not None:
        return
    # Nothing is stored twice: the draft reads the target's embedding from the target's data file (a copy would be
    # S.VOCAB x 16 x 2 = 4 MiB more); what is left is the graph files' structure and the manifest.
    assert rep.weights_bytes <= rep.artifact_bytes < rep.weights_bytes + (1 << 20)
    assert m.draft_embedding.shared and m.draft_embedding.file == "target_verify.onnx.data"


@pytest.mark.parametrize("key", sorted(S.SHAPES))
def test_shapes_have_the_published_sizes(key):
    """Parameter counts of the published models: 1.24 B, 3.21 B, 8.03 B."""
    params = sum(S._nbytes(s) // 2 for s in S.target_specs(S.SHAPES[key]))
    assert abs(params / 1e9 - {"1b": 1.236, "3b": 3.213, "8b": 8.030}[key]) < 0.01

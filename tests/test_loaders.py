"""Loader checks: every malformed or mismatched checkpoint is a CheckpointError naming the problem,
raised before any export work (no output directory, no partial directory left behind)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from model_table import EAGLE3_MODELS
from safetensors.torch import load_file, save_file

from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.loaders import (
    load_draft_head,
    load_eagle1_head,
    load_target,
    read_draft_checkpoint,
)
from eagle_export.export.data.embedding_table import OWN_TABLE_FILE
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.embedding import TokenEmbedding
from eagle_export.tools.testing.tiny_models import make_tiny_target
from eagle_export.tree_params import TreeLimits

INV_FREQ = "layers.0.self_attn.rotary_emb.inv_freq"


# ---- helpers ---------------------------------------------------------------------------------


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_st(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def write_st(d: Path, weights: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))


def edit_json(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def export_fails(target: Path, draft: Path, tmp_path: Path, *fragments: str, options: ExportOptions | None = None
                 ) -> str:
    """Export must fail with a CheckpointError whose message holds every fragment, writing nothing."""
    parent = tmp_path / "exports"  # does not exist yet: the failed export must not create it either
    out = parent / "art"
    with pytest.raises(CheckpointError) as info:
        export_artifact(target, draft, out, options or ExportOptions(max_seq_len=64), progress=False)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    assert not out.exists()
    assert not parent.exists(), f"left behind: {list(parent.iterdir())}"
    assert not list(tmp_path.glob(".art.partial-*"))
    return msg


def draft_outputs(artifact: Path) -> list[np.ndarray]:
    """Run the exported draft step graph on fixed inputs (5 new tokens, empty past)."""
    m = load_manifest(artifact)
    sess = ort.InferenceSession(str(artifact / m.graphs["draft_step"].file), providers=["CPUExecutionProvider"])
    n, d = 5, m.draft
    rng = np.random.default_rng(0)
    empty = np.zeros((1, 0, d.kv_heads, d.head_dim), np.float32)
    feeds = {
        "input_embeds": TokenEmbedding.open(artifact, m).rows(rng.integers(3, m.target.vocab_size, (1, n))).numpy(),
        "features": rng.standard_normal((1, n, d.feature_dim)).astype(np.float32),
        "hidden_in": np.zeros((1, 0, d.hidden_size), np.float32),
        "position_ids": np.arange(n, dtype=np.int64)[None],
        "attention_mask": np.tril(np.ones((n, n), dtype=bool))[None],
        "past_key.0": empty,
        "past_value.0": empty,
    }
    return sess.run(None, feeds)


PROMPT = [(7 * i + 3) % 48 for i in range(12)]


def eagle_run(artifact: Path):
    rt = EagleRuntime.open(artifact)
    return rt.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_on_eos=False)


@pytest.fixture(scope="module")
def pair(models):
    target, draft, _ = models("mha")
    return target, draft


@pytest.fixture(scope="module")
def loaded_target(pair):
    return load_target(pair[0])


# ---- draft weights ---------------------------------------------------------------------------


def test_missing_required_key(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    w = read_st(bad)
    del w["layers.0.mlp.up_proj.weight"]
    write_st(bad, w)
    export_fails(target, bad, tmp_path, "lacks required keys", "layers.0.mlp.up_proj.weight")


def test_unknown_key(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    w = read_st(bad)
    w["layers.0.self_attn.q_norm.weight"] = torch.ones(64)
    write_st(bad, w)
    export_fails(target, bad, tmp_path, "does not have", "layers.0.self_attn.q_norm.weight")


def test_wrong_shape_names_key_and_both_shapes(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    w = read_st(bad)
    assert tuple(w["fc.weight"].shape) == (64, 128)
    w["fc.weight"] = torch.zeros(64, 100)
    write_st(bad, w)
    export_fails(target, bad, tmp_path, "fc.weight", "(64, 100)", "(64, 128)")


def test_hidden_size_mismatch_names_both_values(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    edit_json(bad / "config.json", hidden_size=32)
    export_fails(target, bad, tmp_path, "hidden_size 32", "hidden_size 64")


def test_vocab_size_mismatch(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    edit_json(bad / "config.json", vocab_size=1000)
    export_fails(target, bad, tmp_path, "vocab_size 1000", "vocab_size 48")


def test_declared_layer_count_must_match_the_weights(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    edit_json(bad / "config.json", num_hidden_layers=2)
    export_fails(target, bad, tmp_path, "num_hidden_layers=2", "hold 1 layer(s)", str(bad / "config.json"))


# ---- files and configs -----------------------------------------------------------------------


def test_unsupported_target_family(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(target, tmp_path / "target")
    edit_json(bad / "config.json", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    msg = export_fails(bad, draft, tmp_path, "'gpt2'", "GPT2LMHeadModel", "supported", "LlamaForCausalLM",
                       "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
    assert "llama" in msg


def test_target_without_weights(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(target, tmp_path / "target")
    for f in bad.glob("*.safetensors"):
        f.unlink()
    export_fails(bad, draft, tmp_path, str(bad), "no weights")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_config_missing(pair, tmp_path, which):
    target, draft = pair
    d = copy_dir(target if which == "target" else draft, tmp_path / which)
    (d / "config.json").unlink()
    args = (d, draft) if which == "target" else (target, d)
    export_fails(*args, tmp_path, f"{which}:", str(d / "config.json"), "not found")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_config_invalid_json(pair, tmp_path, which):
    target, draft = pair
    d = copy_dir(target if which == "target" else draft, tmp_path / which)
    (d / "config.json").write_text('{"hidden_size": 64,')
    args = (d, draft) if which == "target" else (target, d)
    export_fails(*args, tmp_path, f"{which}:", str(d / "config.json"), "not valid JSON")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_config_not_an_object(pair, tmp_path, which):
    target, draft = pair
    d = copy_dir(target if which == "target" else draft, tmp_path / which)
    (d / "config.json").write_text("[]")
    args = (d, draft) if which == "target" else (target, d)
    export_fails(*args, tmp_path, f"{which}:", str(d / "config.json"), "not an object")


def test_failed_export_leaves_existing_parent_untouched(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    edit_json(bad / "config.json", hidden_size=32)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="hidden_size 32"):
        export_artifact(target, bad, tmp_path / "art", ExportOptions(max_seq_len=64), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no art/, no .art.partial-*


def test_max_seq_len_above_target_positions(pair, tmp_path):
    target, draft = pair
    with pytest.raises(CheckpointError) as info:
        export_artifact(target, draft, tmp_path / "art", ExportOptions(max_seq_len=4096), progress=False)
    msg = str(info.value)
    assert "--max-seq-len 4096" in msg and "max_position_embeddings 2048" in msg
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.partial-*"))


def test_draft_dir_missing(pair, tmp_path):
    export_fails(pair[0], tmp_path / "nope", tmp_path, str(tmp_path / "nope"), "not a directory")


def test_draft_without_weights(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    (bad / "model.safetensors").unlink()
    export_fails(target, bad, tmp_path, "neither model.safetensors nor pytorch_model.bin")


def test_corrupt_bin_alone(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not a torch file")
    export_fails(target, bad, tmp_path, "could not read weights", str(bad))


def test_bin_that_is_not_a_state_dict(pair, tmp_path):
    target, draft = pair
    bad = copy_dir(draft, tmp_path / "draft")
    (bad / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], bad / "pytorch_model.bin")
    export_fails(target, bad, tmp_path, "pytorch_model.bin", "does not hold a state dict")


# ---- weights formats and optional parts --------------------------------------------------------


def test_bin_head_matches_safetensors_head(models):
    _, st_draft, st_art = models("mha")
    _, bin_draft, bin_art = models("mha", weights_format="bin")
    assert sorted(p.name for p in bin_draft.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert read_draft_checkpoint(bin_draft).weights_file.name == "pytorch_model.bin"
    assert read_draft_checkpoint(st_draft).weights_file.name == "model.safetensors"
    for a, b in zip(draft_outputs(st_art), draft_outputs(bin_art), strict=True):
        np.testing.assert_array_equal(a, b)
    ra, rb = eagle_run(st_art), eagle_run(bin_art)
    assert ra.tokens == rb.tokens and len(ra.tokens) == 24
    assert ra.stats.accept_lengths == rb.stats.accept_lengths


def test_safetensors_preferred_over_bin(pair, loaded_target, tmp_path):
    _, draft = pair
    d = copy_dir(draft, tmp_path / "draft")
    (d / "pytorch_model.bin").write_bytes(b"\x80corrupt pickle that must never be read")
    ckpt = read_draft_checkpoint(d)
    assert ckpt.weights_file == d / "model.safetensors"
    head, ckpt, _ = load_eagle1_head(d, loaded_target)
    ref = read_st(draft)
    torch.testing.assert_close(head.state_dict()["fc.weight"], ref["fc.weight"], rtol=0, atol=0)


def test_inv_freq_key_is_ignored(pair, loaded_target, tmp_path):
    _, draft = pair
    d = copy_dir(draft, tmp_path / "draft")
    w = read_st(d)
    w[INV_FREQ] = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    write_st(d, w)
    head, ckpt, _ = load_eagle1_head(d, loaded_target)
    assert ckpt.ignored_keys == [INV_FREQ]
    assert INV_FREQ not in ckpt.weights
    assert head is not None


def test_no_fc_bias(models):
    _, draft, art = models("mha", fc_bias=False)
    assert "fc.bias" not in read_st(draft)
    assert load_manifest(art).draft.fc_bias is False
    assert load_manifest(models("mha")[2]).draft.fc_bias is True


def test_own_embedding_is_used(models):
    _, _, shared = models("mha")
    _, rand_draft, rand = models("mha", own_embedding="random")
    _, _, copied = models("mha", own_embedding="copy")
    assert "embed_tokens.weight" in read_st(rand_draft)
    assert load_manifest(shared).draft.own_embedding is False
    assert load_manifest(rand).draft.own_embedding is True
    assert load_manifest(copied).draft.own_embedding is True
    # The draft reads the target's table unless the head's own differs: only the random one is stored (once).
    tables = {k: load_manifest(a).draft_embedding for k, a in (("shared", shared), ("rand", rand), ("copy", copied))}
    assert tables["shared"].shared and tables["copy"].shared and tables["shared"] == tables["copy"]
    assert not tables["rand"].shared and tables["rand"].file == OWN_TABLE_FILE
    assert not (shared / OWN_TABLE_FILE).exists() and not (copied / OWN_TABLE_FILE).exists()
    # Same seed: every other draft weight is equal, so only the embedding table differs.
    base, r, c = draft_outputs(shared), draft_outputs(rand), draft_outputs(copied)
    assert not np.allclose(base[2], r[2])  # the head's own random table changes the hidden output
    np.testing.assert_allclose(base[2], c[2], rtol=1e-5, atol=1e-5)  # a copy of the target's: same output


# ---- target families: what the graphs cannot reproduce is refused at load / before export ---------


def test_sliding_window_layers_read_as_transformers_applies_them(tmp_path):
    """Windows are exported (in the mask, export/graphs/families.py): each layer's plan is read as transformers applies
    it, Mistral's one window on every layer, Qwen2's from max_window_layers on; the fused graph is left out where
    a window is narrower than its cache (a wider one is full attention there). Catches a window read for the wrong
    layers, or a fused graph kept without the window."""
    from eagle_export.export.graphs.families import SLIDING, layer_plans, windowed
    from eagle_export.export.plan import fused_unsupported

    t = load_target(make_tiny_target(tmp_path / "m", "mistral", with_tokenizer=False, vocab_size=48,
                                     sliding_window=32))
    assert [(p.mask, p.span) for p in layer_plans(t.config)] == [(SLIDING, 32)] * 3
    assert "narrower than the cache on layers [0, 1, 2]" in fused_unsupported(32, "float32", t.model, 64)
    assert fused_unsupported(32, "float32", t.model, 32) is None  # a window covering the capacity
    t = load_target(make_tiny_target(tmp_path / "q", "qwen2", with_tokenizer=False, vocab_size=48,
                                     use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert windowed(layer_plans(t.config), 64) == [1, 2]


def test_length_dependent_rope_refused(pair, tmp_path):
    target = make_tiny_target(tmp_path / "t", "mha", with_tokenizer=False, vocab_size=48,
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    export_fails(target, pair[1], tmp_path, "target:", "rope_type 'dynamic'", "depend on the sequence length")


# ---- EAGLE-3 heads -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair3(models):
    """Llama target (hidden 64, vocab 48, 3 layers, 8 heads / 2 KV, head_dim 8) + EAGLE-3 head, draft vocab 32."""
    preset, kw = EAGLE3_MODELS["llama-d2t"]
    target, draft, _ = models(preset, **kw)
    return target, draft


@pytest.fixture(scope="module")
def narrow3(models):
    """Mistral target + an EAGLE-3 head of hidden 32 (target_hidden_size 64) with its own embedding."""
    preset, kw = EAGLE3_MODELS["mistral-narrow"]
    target, draft, _ = models(preset, **kw)
    return target, draft


def edit_weights(pair, tmp_path, fn) -> Path:
    bad = copy_dir(pair[1], tmp_path / "draft")
    w = read_st(bad)
    fn(w)
    write_st(bad, w)
    return bad


def test_eagle3_is_detected_and_loaded(pair3, loaded_target3):
    d = load_draft_head(pair3[1], loaded_target3)
    assert (d.variant, d.feature_layers, d.feature_dim, d.vocab_size, d.d2t_identity) == ("eagle3", [0, 1, 2],
                                                                                          192, 32, False)
    tid = read_st(pair3[1])["d2t"] + torch.arange(32)
    assert torch.equal(d.head.draft_to_target, tid)


@pytest.fixture(scope="module")
def loaded_target3(pair3):
    return load_target(pair3[0])


def test_eagle3_hidden_size_mismatch(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    edit_json(bad / "config.json", hidden_size=32)
    export_fails(pair3[0], bad, tmp_path, "hidden_size 32", "hidden_size 64", "target_hidden_size")


def test_eagle3_narrow_head_needs_its_own_embedding(narrow3, tmp_path):
    bad = edit_weights(narrow3, tmp_path, lambda w: w.pop("embed_tokens.weight"))
    export_fails(narrow3[0], bad, tmp_path, "hidden_size 32", "hidden_size 64", "no embed_tokens.weight")


def test_eagle3_target_hidden_size_mismatch(narrow3, tmp_path):
    bad = copy_dir(narrow3[1], tmp_path / "draft")
    edit_json(bad / "config.json", target_hidden_size=48)
    export_fails(narrow3[0], bad, tmp_path, "target_hidden_size 48", "hidden_size 64")


def test_eagle3_vocab_mismatch(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    edit_json(bad / "config.json", vocab_size=1000)
    export_fails(pair3[0], bad, tmp_path, "vocab_size 1000", "vocab_size 48")


def test_eagle3_draft_vocab_larger_than_target(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    edit_json(bad / "config.json", draft_vocab_size=60)
    export_fails(pair3[0], bad, tmp_path, "draft_vocab_size 60", "vocab_size 48")


def test_eagle3_lm_head_not_the_draft_vocab(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    edit_json(bad / "config.json", draft_vocab_size=30)
    export_fails(pair3[0], bad, tmp_path, "lm_head.weight", "(32, 64)", "(30, 64)", "draft_vocab_size=30")


def test_d2t_outside_target_vocab(pair3, tmp_path):
    def edit(w):
        w["d2t"][5] = 1000 - 5
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "d2t maps draft id 5 to target id 1000", "outside the target's vocabulary "
                 "[0, 48)")


def test_d2t_negative_target_id(pair3, tmp_path):
    def edit(w):
        w["d2t"][0] = -1
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "draft id 0 to target id -1", "[0, 48)")


def test_d2t_two_draft_ids_one_target_id(pair3, tmp_path):
    def edit(w):
        w["d2t"][1] = w["d2t"][0] - 1  # draft id 1 -> the target id of draft id 0
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "d2t maps draft ids [0, 1] to the same target id")


def test_d2t_missing_with_smaller_draft_vocab(pair3, tmp_path):
    bad = edit_weights(pair3, tmp_path, lambda w: (w.pop("d2t"), w.pop("t2d")))
    export_fails(pair3[0], bad, tmp_path, "draft_vocab_size 32", "vocab_size 48", "no d2t")


def test_t2d_disagrees_with_d2t(pair3, tmp_path):
    def edit(w):
        w["t2d"] = ~w["t2d"]
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "t2d", "disagrees with d2t")


def test_d2t_zeros_with_full_vocab_is_identity(models, tmp_path):
    preset, kw = EAGLE3_MODELS["qwen2-identity"]
    target, draft, _ = models(preset, **kw)

    def edit(w):
        w["d2t"] = torch.zeros(48, dtype=torch.int64)
        w["t2d"] = torch.ones(48, dtype=torch.bool)
    d = load_draft_head(edit_weights((target, draft), tmp_path, edit), load_target(target))
    assert d.d2t_identity and d.head.draft_to_target is None and d.vocab_size == 48


def test_eagle3_head_dim_mismatch(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    edit_json(bad / "config.json", head_dim=16)  # weights are 8 heads x 8
    export_fails(pair3[0], bad, tmp_path, "midlayer.self_attn.q_proj.weight", "(64, 128)", "(128, 128)",
                 "head_dim=16")


def test_eagle3_fc_width_mismatch(pair3, tmp_path):
    def edit(w):
        w["fc.weight"] = torch.zeros(64, 128)
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "fc.weight takes 128 input features",
                 "3 layers [0, 1, 2]", "x hidden_size 64 = 192", "reads 2 layers' features", "--feature-layers")


def test_eagle3_missing_and_unknown_keys(pair3, tmp_path):
    bad = edit_weights(pair3, tmp_path, lambda w: w.pop("midlayer.hidden_norm.weight"))
    export_fails(pair3[0], bad, tmp_path, "lacks required keys", "midlayer.hidden_norm.weight")
    shutil.rmtree(bad)

    def edit(w):
        w["midlayer.self_attn.q_norm.weight"] = torch.ones(8)
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "reference-eagle3", "does not have", "midlayer.self_attn.q_norm.weight")


def test_not_an_eagle_head(pair3, tmp_path):
    bad = copy_dir(pair3[1], tmp_path / "draft")
    write_st(bad, {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    export_fails(pair3[0], bad, tmp_path, "not an EAGLE head in a known format", "midlayer.*", "layers.0.*",
                 "model.layers.0.mlp.up_proj.weight")


def test_both_layouts_in_one_checkpoint(pair3, tmp_path):
    def edit(w):
        w["layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    bad = edit_weights(pair3, tmp_path, edit)
    export_fails(pair3[0], bad, tmp_path, "both a first EAGLE-3 layer (midlayer.*) and layers.0.* keys")


@pytest.mark.parametrize("layers, fragments", [
    ([0, 1, 3], ("--feature-layers [0, 1, 3]", "[0, 3)", "the target has 3 layers")),
    ([-1, 0, 1], ("--feature-layers [-1, 0, 1]", "[0, 3)")),
])
def test_bad_feature_layers(pair3, tmp_path, layers, fragments):
    export_fails(pair3[0], pair3[1], tmp_path, *fragments,
                 options=ExportOptions(max_seq_len=64, feature_layers=layers))


def test_feature_layers_with_an_eagle1_head(pair, tmp_path):
    export_fails(*pair, tmp_path, "--feature-layers applies to EAGLE-3 heads", "EAGLE-1/2 head",
                 options=ExportOptions(max_seq_len=64, feature_layers=[0, 1]))


def test_target_too_shallow_for_the_default_feature_layers(pair3, tmp_path):
    """2, L//2, L-3 with repeats is legal down to L = 3; a 2-layer target has no layer L-3."""
    target = make_tiny_target(tmp_path / "t", "mha", with_tokenizer=False, vocab_size=48, num_hidden_layers=2)
    export_fails(target, pair3[1], tmp_path, "2 decoder layers", "[-1, 1, 2]", "pass --feature-layers")


def test_max_top_k_above_draft_vocab(pair3, tmp_path):
    export_fails(*pair3, tmp_path, "--max-top-k 40", "draft vocabulary of 32",
                 options=ExportOptions(max_seq_len=64, limits=TreeLimits(max_top_k=40)))


def test_eagle3_bin_matches_safetensors(models):
    preset, kw = EAGLE3_MODELS["llama-d2t"]
    _, st_draft, st_art = models(preset, **kw)
    _, bin_draft, bin_art = models(preset, **kw, weights_format="bin")
    assert sorted(p.name for p in bin_draft.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert read_draft_checkpoint(bin_draft).weights_file.name == "pytorch_model.bin"
    for a, b in zip(draft_outputs(st_art), draft_outputs(bin_art), strict=True):
        np.testing.assert_array_equal(a, b)
    ra, rb = eagle_run(st_art), eagle_run(bin_art)
    assert ra.tokens == rb.tokens and ra.stats.accept_lengths == rb.stats.accept_lengths


def test_eagle3_safetensors_preferred_over_bin(pair3, loaded_target3, tmp_path):
    d = copy_dir(pair3[1], tmp_path / "draft")
    (d / "pytorch_model.bin").write_bytes(b"\x80corrupt pickle that must never be read")
    draft = load_draft_head(d, loaded_target3)
    assert draft.ckpt.weights_file == d / "model.safetensors"
    torch.testing.assert_close(draft.head.state_dict()["fc.weight"], read_st(pair3[1])["fc.weight"], rtol=0, atol=0)


# ---- the draft's position limit --------------------------------------------------------------------


def test_draft_position_limit_is_reported(pair3, tmp_path, caplog):
    target, draft = pair3
    d = copy_dir(draft, tmp_path / "draft")
    edit_json(d / "config.json", max_position_embeddings=40)
    with caplog.at_level(logging.WARNING, logger="eagle_export"):
        art = export_artifact(target, d, tmp_path / "art", ExportOptions(max_seq_len=128), progress=False)
    assert "max_position_embeddings is 40" in caplog.text and "positions reach 136" in caplog.text
    assert load_manifest(art).draft.max_position_embeddings == 40
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts, past the limit too
    short = rt.generate(prompt_ids=PROMPT, max_new_tokens=8, stop_on_eos=False)
    assert short.stats.draft_beyond_position_limit is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle_export"):
        res = rt.generate(prompt_ids=PROMPT, max_new_tokens=60, stop_on_eos=False)
    assert 40 <= res.stats.draft_beyond_position_limit < 40 + 8
    assert res.to_dict()["stats"]["draft_beyond_position_limit"] == res.stats.draft_beyond_position_limit
    assert "past its max_position_embeddings 40" in caplog.text and "lossless" in caplog.text
    # Past the limit the output is still the target's own greedy output.
    plain = rt.generate(prompt_ids=PROMPT, max_new_tokens=60, stop_on_eos=False, use_draft=False)
    assert res.tokens == plain.tokens

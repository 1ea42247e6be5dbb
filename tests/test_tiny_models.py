"""Tests for eagle_export.tools.testing.tiny_models (tiny random target / draft / tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_export.tools.testing import tiny_models as tm


def _load_draft(d):
    cfg = json.loads((d / "config.json").read_text())
    if (d / "model.safetensors").exists():
        return cfg, load_file(str(d / "model.safetensors"))
    return cfg, torch.load(d / "pytorch_model.bin", weights_only=True)


@pytest.mark.parametrize("preset", sorted(tm.TARGET_PRESETS))
def test_preset_loads_and_generates(tmp_path, preset):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    target = tm.make_tiny_target(tmp_path / "t", preset, seed=0)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    # The class the tiny tokenizer is saved as (AutoTokenizer would pick Qwen2Tokenizer for a qwen2 config.json,
    # which adds <|endoftext|> beyond the tiny vocabulary; the artifact holds no config.json, so the runtime's
    # AutoTokenizer gets this class too).
    tok = PreTrainedTokenizerFast.from_pretrained(target)
    cfg = model.config
    assert len(tok) == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert model.dtype == torch.float32

    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    with torch.no_grad():
        logits = model(torch.arange(3, 35)[None]).logits
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5  # not the near-flat logits of the default 0.02 init

    attn = model.model.layers[0].self_attn
    if preset == "headdim":
        assert cfg.head_dim == 24 and attn.q_proj.out_features == 4 * 24
    if preset == "gqa":
        assert attn.k_proj.out_features == 2 * 8 and cfg.num_hidden_layers == 3
    if preset == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert type(model).__name__ == tm.FAMILY_CLASSES[tm.TARGET_PRESETS[preset].get("model_type", "llama")]
    if preset == "qwen2":
        assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().max() > 0  # randomised, not zeros
    if preset == "qwen3":
        assert cfg.head_dim == 32 and attn.q_proj.out_features == 4 * 32
        assert (attn.q_norm.weight - 1).abs().max() > 0  # randomised, not ones
    if preset == "mistral":
        assert cfg.sliding_window == 4096
    if preset == "llama3rope":
        assert model.model.rotary_emb.rope_type == "llama3"
        assert cfg.rope_parameters["rope_theta"] == 500000.0
        assert cfg.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize(
    "preset,fc_bias,own_embedding,fmt",
    [
        ("mha", True, False, "safetensors"),
        ("gqa", False, True, "bin"),
        ("headdim", True, "copy", "safetensors"),
        ("llama3rope", False, False, "bin"),
    ],
)
def test_draft_keys_and_shapes(tmp_path, preset, fc_bias, own_embedding, fmt):
    target = tm.make_tiny_target(tmp_path / "t", preset, seed=1)
    draft = tm.make_tiny_draft(
        tmp_path / "d", target, seed=2, fc_bias=fc_bias, own_embedding=own_embedding, weights_format=fmt
    )
    tcfg = json.loads((target / "config.json").read_text())
    cfg, sd = _load_draft(draft)
    H, nH, nKV = tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd, inter, V = tcfg["head_dim"], tcfg["intermediate_size"], tcfg["vocab_size"]
    expected = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (nH * hd, H),
        "layers.0.self_attn.k_proj.weight": (nKV * hd, H),
        "layers.0.self_attn.v_proj.weight": (nKV * hd, H),
        "layers.0.self_attn.o_proj.weight": (H, nH * hd),
        "layers.0.mlp.gate_proj.weight": (inter, H),
        "layers.0.mlp.up_proj.weight": (inter, H),
        "layers.0.mlp.down_proj.weight": (H, inter),
        "layers.0.post_attention_layernorm.weight": (H,),
    }
    if fc_bias:
        expected["fc.bias"] = (H,)
    if own_embedding:
        expected["embed_tokens.weight"] = (V, H)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert cfg["bias"] is fc_bias and cfg["num_hidden_layers"] == 1
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert cfg[k] == tcfg[k]
    assert cfg["rope_theta"] == tcfg["rope_parameters"]["rope_theta"]
    assert cfg["rope_parameters"] == tcfg["rope_parameters"]
    if own_embedding == "copy":
        tsd = load_file(str(target / "model.safetensors"))
        assert torch.equal(sd["embed_tokens.weight"], tsd["model.embed_tokens.weight"])


def test_determinism(tmp_path):
    ta, da = tm.make_pair(tmp_path / "a", "gqa", seed=5, fc_bias=True, own_embedding=True)
    tb, db = tm.make_pair(tmp_path / "b", "gqa", seed=5, fc_bias=True, own_embedding=True)
    tc, dc = tm.make_pair(tmp_path / "c", "gqa", seed=6, fc_bias=True, own_embedding=True)
    for x, y, z in ((ta, tb, tc), (da, db, dc)):
        sx, sy, sz = (load_file(str(p / "model.safetensors")) for p in (x, y, z))
        assert sx.keys() == sy.keys()
        assert all(torch.equal(sx[k], sy[k]) for k in sx)
        assert any(not torch.equal(sx[k], sz[k]) for k in sx)
    assert (ta / "tokenizer.json").read_bytes() == (tb / "tokenizer.json").read_bytes()
    assert (da / "config.json").read_text() == (db / "config.json").read_text()


def test_overrides_and_eos(tmp_path):
    from transformers import AutoConfig

    t = tm.make_tiny_target(tmp_path / "t", "mha", num_hidden_layers=1, eos_token_id=250)
    cfg = AutoConfig.from_pretrained(t)
    assert cfg.num_hidden_layers == 1 and cfg.eos_token_id == 250
    gen = json.loads((t / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 250
    d = tm.make_tiny_draft(tmp_path / "d", t, fc_bias=False, intermediate_size=96)
    cfg_d, sd = _load_draft(d)
    assert cfg_d["intermediate_size"] == 96 and sd["layers.0.mlp.down_proj.weight"].shape == (64, 96)


def test_cli(tmp_path):
    from click.testing import CliRunner

    res = CliRunner().invoke(tm.main, ["--out", str(tmp_path), "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "target" / "config.json").exists()
    assert (tmp_path / "target" / "tokenizer.json").exists()
    assert (tmp_path / "draft" / "model.safetensors").exists()
    assert "target:" in res.output and "draft:" in res.output

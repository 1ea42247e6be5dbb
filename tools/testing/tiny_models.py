"""Tiny random models for tests and demos: targets (Llama, Qwen2, Qwen3, Mistral), EAGLE-1/2 and EAGLE-3
draft heads in the published layouts, a BPE tokenizer.

Everything is deterministic for a given seed (weights via a seeded torch RNG, the tokenizer via a
fixed built-in corpus). Weights use a large init scale (``initializer_range`` 0.2 by default) so
greedy decisions have clear margins instead of the near-ties that the default 0.02 init produces.

CLI::

    python -m eagle_export.tools.testing.tiny_models --out DIR [--preset mha] [--seed 0] [--fc-bias/--no-fc-bias]

writes DIR/target (HF model of the preset's family + tokenizer) and DIR/draft (EAGLE-1/2 head in the
published layout; ``--eagle3`` for an EAGLE-3 head, ``--draft-vocab-size`` for a smaller draft vocabulary).

Note on transformers 5.x: rope settings live in ``rope_parameters`` (with ``rope_theta`` inside);
legacy ``rope_theta`` / ``rope_scaling`` kwargs are still accepted and converted, but the saved
target config.json only has ``rope_parameters``. The draft config.json carries the legacy
top-level ``rope_theta`` / ``rope_scaling`` keys (as published EAGLE heads do) plus ``rope_parameters``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

import click
import torch

__all__ = [
    "TARGET_PRESETS",
    "TINY_CORPUS",
    "make_tiny_tokenizer",
    "make_tiny_target",
    "make_tiny_draft",
    "make_tiny_eagle3_draft",
    "make_pair",
    "draft_weight_shapes",
    "eagle3_weight_shapes",
]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (Llama order)

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _preset(**delta: Any) -> dict[str, Any]:
    out = copy.deepcopy(_BASE)
    out.update(delta)
    return out


#: name -> config kwargs (transformers 5.x spelling: rope settings in ``rope_parameters``); ``model_type``
#: picks the family (default "llama").
TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "mha": _preset(),
    "gqa": _preset(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "tied": _preset(tie_word_embeddings=True),
    "headdim": _preset(head_dim=24),
    "llama3rope": _preset(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    # Qwen2: q/k/v biases; GQA. No sliding window (use_sliding_window false, as the released configs).
    "qwen2": _preset(model_type="qwen2", num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=False),
    # Qwen3: per-head q/k RMSNorm, head_dim * heads != hidden (as in the released models), tied embeddings.
    "qwen3": _preset(model_type="qwen3", num_key_value_heads=2, num_hidden_layers=3, head_dim=32,
                     tie_word_embeddings=True),
    # Mistral: GQA, a sliding window (4096, as Mistral 7B v0.1) wider than any capacity the tests use.
    "mistral": _preset(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
                       sliding_window=4096),
    # The published configs' structure, scaled down (same keys, layer pattern; experts, windows, chunks smaller).
    # Qwen3-30B-A3B: 128 experts top-8 (here 8, top-2), norm_topk_prob, q/k norms, GQA, head_dim 128 (here 32);
    # mlp_only_layers [1] (the published one is [], decoder_sparse_step 1) so a dense layer sits between MoE ones.
    "qwen3_moe": _preset(model_type="qwen3_moe", num_key_value_heads=2, num_hidden_layers=3, head_dim=32,
                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False, sliding_window=None,
                         max_window_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # gpt-oss-20b: alternating sliding (128; here 8) / full layers, learned sinks, q/k/v/o biases, 32 experts top-4
    # (here 8, top-2) with biased clamped SwiGLU (limit 7), YaRN rope (factor 32 over 4096; here over 64).
    "gpt_oss": _preset(model_type="gpt_oss", num_key_value_heads=2, num_hidden_layers=4, head_dim=16,
                       intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True,
                       swiglu_limit=7.0, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "original_max_position_embeddings": 64,
                                        "truncate": False}),
    # Llama 4 (Scout's text model; Maverick's interleaving): MoE every 2nd layer (16 experts top-1 here 4) with a
    # shared expert, dense layers of intermediate_size_mlp, chunked attention (8192; here 8) on rope layers, a NoPE
    # layer every 4th, QK L2 norm, attention temperature tuning (floor_scale 8192; here 8), llama3 rope scaling.
    "llama4": _preset(model_type="llama4_text", num_key_value_heads=2, num_hidden_layers=4, head_dim=16,
                      intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                      interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layer_interval=4,
                      use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1,
                      rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}),
}
#: model_type -> the transformers class name written to config.json "architectures".
FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "llama4_text": "Llama4ForCausalLM"}

# Fixed training text for the tokenizer (built in, so the vocab is identical on every run and
# every Python version).
TINY_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long.",
    "Speculative decoding uses a small draft model to propose tokens that a large target model "
    "verifies in a single forward pass.",
    "A draft head reads the hidden state of the target and the next token, then predicts the "
    "next feature of the sequence.",
    "In a dynamic tree, the most likely candidates are expanded first, and the tree is pruned "
    "to a fixed number of tokens before verification.",
    "Once upon a time there was a little robot who liked to count numbers: one, two, three, "
    "four, five, six, seven, eight, nine, ten.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        "
    "print(i, 'is odd')\n",
    "The weather today is sunny with a light breeze from the west. Tomorrow it may rain in the "
    "afternoon and evening.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees. The ocean covers "
    "most of the planet.",
    "She opened the window, looked at the mountains, and wrote a letter to her brother about the "
    "long summer.",
    "Question: What is the capital of France? Answer: The capital of France is Paris.",
    "Question: How many legs does a spider have? Answer: A spider has eight legs.",
    "User: Tell me a short story about a cat.\nAssistant: A small cat found a warm box and "
    "decided it was the best home in the world.",
    "Attention is computed from queries, keys and values; rotary position embeddings rotate the "
    "queries and keys by an angle that depends on the position.",
    "The model accepts a token when the draft agrees with the target, and otherwise it samples a "
    "correction and starts a new round.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048.",
    "Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? , . ; : ' \" # @ $ _ \\ `",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness.",
    "The library opens at nine in the morning and closes at six in the evening, except on "
    "Sundays when it is closed.",
    "To make tea, boil the water, put the leaves in the pot, pour the water, and wait three "
    "minutes before drinking.",
    "import torch\nx = torch.zeros(4, 8)\ny = x.sum(dim=-1)\n",
    "The train left the station at noon and arrived in the city two hours later, just as the "
    "lights were coming on.",
    "Every student in the class wrote a poem about the sea, the stars, or the forest near the school.",
)


def _corpus_iter() -> list[str]:
    # A few passes so merge counts are not all ties; order is fixed.
    return [line for _ in range(4) for line in TINY_CORPUS]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _build_tokenizer(vocab_size: int, full_byte_alphabet: bool | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if full_byte_alphabet is None:
        full_byte_alphabet = vocab_size >= 320
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if full_byte_alphabet:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        # printable ASCII + \t \n as byte-level chars; other bytes map to <unk>.
        alphabet = sorted({_BYTE_TO_CHAR[b] for b in [9, 10, *range(32, 127)]})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(alphabet),
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_iter(), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte -> printable char table (what the ByteLevel pre-tokenizer uses).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


_BYTE_TO_CHAR = _bytes_to_unicode()


# A chat template in the Llama-2 style over the tiny tokenizer's own specials: each turn ends with </s> (eos),
# and the generation prompt opens the assistant's turn.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tiny_tokenizer(
    out_dir: str | Path, vocab_size: int = 256, *, full_byte_alphabet: bool | None = None,
    chat_template: str | None = None,
):
    """Train a byte-level BPE on the built-in corpus and save it (PreTrainedTokenizerFast) to out_dir.

    Special tokens: <unk>=0, <s>=1 (bos, prepended on encode), </s>=2 (eos).
    ``full_byte_alphabet``: all 256 bytes in the base vocab (lossless for any text); default is
    True only when vocab_size >= 320, because 256 bytes + 3 specials do not fit in 256. With the
    restricted alphabet (printable ASCII, tab, newline) other bytes encode as <unk>.
    ``chat_template``: a Jinja chat template saved with it (e.g. TINY_CHAT_TEMPLATE; None: none).
    Returns the transformers tokenizer; len(tokenizer) == vocab_size when the corpus allows.
    """
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size, full_byte_alphabet)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(out_dir)
    return hf_tok


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def make_tiny_target(
    out_dir: str | Path,
    preset: str | None = "mha",
    *,
    seed: int = 0,
    with_tokenizer: bool = True,
    initializer_range: float = 0.2,
    eos_token_id: int | None = None,
    chat_template: str | None = None,
    **overrides: Any,
) -> Path:
    """Make a random fp32 HF target in out_dir (config.json, model.safetensors, tokenizer).

    ``preset``: a TARGET_PRESETS name (None = the "mha" base), which also picks the family
    (Llama, Qwen2, Qwen3, Mistral); ``overrides``: extra/replacement config kwargs (e.g.
    num_hidden_layers=1, head_dim=32, rope_parameters={...}). For the non-Llama families the
    biases and RMSNorm weights (Qwen3's q/k norms included) are randomised too, so they are not the
    trivial zeros and ones of transformers' init; the Llama presets keep that init.
    With a tokenizer, vocab_size is len(tokenizer) (the tokenizer is trained to the requested
    vocab_size), bos/eos come from it. ``eos_token_id`` overrides the eos in config and
    generation_config (e.g. an id the model never emits, so generate runs to max_new_tokens).
    ``chat_template``: saved with the tokenizer (needs ``with_tokenizer``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if preset is None:
        preset = "mha"
    if preset not in TARGET_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(TARGET_PRESETS)}")
    kw = copy.deepcopy(TARGET_PRESETS[preset])
    kw.update(copy.deepcopy(overrides))
    kw["initializer_range"] = initializer_range
    family = kw.pop("model_type", "llama")
    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown model_type {family!r}; known: {sorted(FAMILY_CLASSES)}")

    if chat_template is not None and not with_tokenizer:
        raise ValueError("chat_template needs with_tokenizer=True")
    bos_id, eos_id = 1, 2
    if with_tokenizer:
        tok = make_tiny_tokenizer(out_dir, vocab_size=int(kw["vocab_size"]), chat_template=chat_template)
        kw["vocab_size"] = len(tok)
        bos_id, eos_id = tok.bos_token_id, tok.eos_token_id
    if eos_token_id is not None:
        eos_id = int(eos_token_id)
    kw.setdefault("bos_token_id", bos_id)
    kw.setdefault("eos_token_id", eos_id)
    kw.setdefault("pad_token_id", None)

    config = AutoConfig.for_model(family, **kw)
    config.architectures = [FAMILY_CLASSES[family]]
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        if family != "llama":
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("bias"):
                        param.normal_(0.0, initializer_range)
                    elif "norm" in name:
                        param.mul_(1.0 + 0.1 * torch.randn_like(param))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.eos_token_id,
        do_sample=False,
    )
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 100 KB model
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return out_dir


# ---------------------------------------------------------------------------------------------
# Draft (EAGLE-1/2 head)
# ---------------------------------------------------------------------------------------------

_DRAFT_FROM_TARGET = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "head_dim",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
)


def _rope_parameters(tcfg: dict[str, Any]) -> dict[str, Any]:
    rp = tcfg.get("rope_parameters")
    if rp:
        return dict(rp)
    rp = dict(tcfg.get("rope_scaling") or {"rope_type": "default"})
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_theta", float(tcfg.get("rope_theta", 10000.0)))
    return rp


def draft_weight_shapes(config: dict[str, Any], *, fc_bias: bool, own_embedding: bool, qkv_bias: bool = False,
                        hass: bool = False, num_layers: int = 1) -> dict[str, tuple]:
    """Expected EAGLE-1/2 head tensor names -> shapes for a draft config.json dict (checkpoint-formats.md
    section 1): ``qkv_bias`` adds q/k/v biases (Qwen2 heads), ``hass`` the three HASS norms, layers after the
    first are plain pre-norm layers with ``input_layernorm``."""
    H = int(config["hidden_size"])
    nH = int(config["num_attention_heads"])
    nKV = int(config.get("num_key_value_heads") or nH)
    hd = int(config.get("head_dim") or H // nH)
    inter = int(config["intermediate_size"])
    V = int(config["vocab_size"])
    shapes: dict[str, tuple] = {"fc.weight": (H, 2 * H)}
    if fc_bias:
        shapes["fc.bias"] = (H,)
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (nH * hd, H)
        shapes[p + "self_attn.k_proj.weight"] = (nKV * hd, H)
        shapes[p + "self_attn.v_proj.weight"] = (nKV * hd, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, nH * hd)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nH * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nKV * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nKV * hd,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, H)
        shapes[p + "mlp.up_proj.weight"] = (inter, H)
        shapes[p + "mlp.down_proj.weight"] = (H, inter)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if i > 0:
            shapes[p + "input_layernorm.weight"] = (H,)
    if hass:
        for name in ("embed_layernorm.weight", "hidden_layernorm.weight", "lm_head_layernorm.weight"):
            shapes[name] = (H,)
    if own_embedding:
        shapes["embed_tokens.weight"] = (V, H)
    return shapes


def _finish_draft_config(cfg: dict[str, Any], tcfg: dict, init_scale: float, config_overrides: dict) -> None:
    """Fields every tiny head's config.json shares: head dims, the target's rope in both spellings, no biases."""
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    rp = _rope_parameters(tcfg)
    cfg["rope_theta"] = float(rp.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    cfg["rope_parameters"] = rp
    cfg.update({"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "pretraining_tp": 1,
                "torch_dtype": "float32", "initializer_range": init_scale})
    cfg.update(copy.deepcopy(config_overrides))
    if "rope_theta" in config_overrides:
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": float(cfg["rope_theta"])}


def _head_prelude(out_dir, target_dir, weights_format: str, own_embedding) -> tuple[Path, Path, dict]:
    """What every head writer does first: check the common options, make the folder, read the target's config."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights_format not in ("safetensors", "bin"):
        raise ValueError(f"weights_format must be 'safetensors' or 'bin', got {weights_format!r}")
    if own_embedding not in (False, True, "random", "copy"):
        raise ValueError(f"own_embedding must be False, True, 'random' or 'copy', got {own_embedding!r}")
    target_dir = Path(target_dir)
    return out_dir, target_dir, json.loads((target_dir / "config.json").read_text())


def make_tiny_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    fc_bias: bool = True,
    own_embedding: bool | Literal["random", "copy"] = False,
    weights_format: Literal["safetensors", "bin"] = "safetensors",
    init_scale: float = 0.1,
    norm_noise: float = 0.05,
    qkv_bias: bool = False,
    bias_key: bool = True,
    hass: bool = False,
    num_layers: int = 1,
    **config_overrides: Any,
) -> Path:
    """Make a random EAGLE-1/2 head for the target in target_dir, in the published layout.

    Variants (checkpoint-formats.md section 1): ``qkv_bias`` (Qwen2 heads: q/k/v biases and
    ``"qkv_bias": true``), ``bias_key=False`` (no ``"bias"`` key in config.json, which means True: needs
    ``fc_bias``), ``hass`` (HASS norms ``embed_layernorm``, ``hidden_layernorm``, ``lm_head_layernorm``),
    ``num_layers`` > 1 (``layers.N.*``, pre-norm ``input_layernorm`` from layer 1 on).

    config.json: Llama-style, num_hidden_layers 1, dims/rope/vocab copied from the target
    (``config_overrides`` replace any key, e.g. intermediate_size=96), plus "bias": fc_bias.
    Weights (model.safetensors or pytorch_model.bin): see draft_weight_shapes(). Matrices are
    N(0, init_scale); the norm is 1 + N(0, norm_noise). ``own_embedding``: False = no
    embed_tokens.weight; True/"random" = a random [V, H] table N(0, init_scale) (differs from the
    target's, so tests can tell which one is used); "copy" = a copy of the target's embedding.
    """
    out_dir, target_dir, tcfg = _head_prelude(out_dir, target_dir, weights_format, own_embedding)

    if not bias_key and not fc_bias:
        raise ValueError("a config without a 'bias' key means bias=True: bias_key=False needs fc_bias=True")
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": num_layers,
    }
    for k in _DRAFT_FROM_TARGET:
        if tcfg.get(k) is not None:
            cfg[k] = tcfg[k]
    _finish_draft_config(cfg, tcfg, init_scale, config_overrides)
    if bias_key:
        cfg["bias"] = bool(fc_bias)
    if qkv_bias:
        cfg["qkv_bias"] = True

    shapes = draft_weight_shapes(cfg, fc_bias=fc_bias, own_embedding=bool(own_embedding), qkv_bias=qkv_bias,
                                 hass=hass, num_layers=num_layers)
    gen = torch.Generator().manual_seed(seed)
    tensors = _random_weights(shapes, gen, init_scale, norm_noise, own_embedding, target_dir)

    return write_head(out_dir, cfg, tensors, weights_format)


def eagle3_weight_shapes(
    config: dict[str, Any], *, own_embedding: bool, num_feature_layers: int = 3, num_layers: int = 1,
    norm_before_fc: bool = False, fc_norm: bool = False,
) -> dict[str, tuple]:
    """Expected EAGLE-3 head tensor names -> shapes for a draft config.json dict (d2t/t2d not included), in the
    reference names (``midlayer.*``; layers after the first ``layers.{i}.*`` with ``input_layernorm``);
    ``EAGLE3_LAYOUTS`` renames them for the other formats."""
    H = int(config["hidden_size"])
    TH = int(config.get("target_hidden_size") or H)
    nH = int(config["num_attention_heads"])
    nKV = int(config.get("num_key_value_heads") or nH)
    hd = int(config.get("head_dim") or H // nH)
    inter = int(config["intermediate_size"])
    V = int(config["vocab_size"])
    Vd = int(config.get("draft_vocab_size") or V)
    p = "midlayer."
    shapes: dict[str, tuple] = {
        "fc.weight": (H, num_feature_layers * TH),
        p + "self_attn.q_proj.weight": (nH * hd, 2 * H),
        p + "self_attn.k_proj.weight": (nKV * hd, 2 * H),
        p + "self_attn.v_proj.weight": (nKV * hd, 2 * H),
        p + "self_attn.o_proj.weight": (H, nH * hd),
        p + "mlp.gate_proj.weight": (inter, H),
        p + "mlp.up_proj.weight": (inter, H),
        p + "mlp.down_proj.weight": (H, inter),
        p + "hidden_norm.weight": (H,),
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    for i in range(1, num_layers):
        q = f"layers.{i}."
        shapes.update({
            q + "self_attn.q_proj.weight": (nH * hd, H), q + "self_attn.k_proj.weight": (nKV * hd, H),
            q + "self_attn.v_proj.weight": (nKV * hd, H), q + "self_attn.o_proj.weight": (H, nH * hd),
            q + "mlp.gate_proj.weight": (inter, H), q + "mlp.up_proj.weight": (inter, H),
            q + "mlp.down_proj.weight": (H, inter), q + "input_layernorm.weight": (H,),
            q + "post_attention_layernorm.weight": (H,),
        })
    if norm_before_fc:
        shapes["input_norm.weight"] = (num_feature_layers * TH,)
    if fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (TH,) for i in range(num_feature_layers)})
    if own_embedding:
        shapes["embed_tokens.weight"] = (V, H)
    return shapes


def _rename_speculators(key: str) -> str:
    # speculators' converter renames midlayer. -> layers.0.; later layers are layers.{i} with input_layernorm.
    return "layers.0." + key[len("midlayer."):] if key.startswith("midlayer.") else key


def _rename_modelopt(key: str) -> str:
    # ModelOpt (since 2026-03): layers.{i}.*; layers after the first name their pre-norm hidden_norm
    # (what TensorRT-LLM reads).
    if key.startswith("midlayer."):
        return "layers.0." + key[len("midlayer."):]
    return key.replace(".input_layernorm.", ".hidden_norm.") if key.startswith("layers.") else key


def _rename_modelopt_midlayer(key: str, num_layers: int) -> str:
    # ModelOpt before 2026-03: midlayer.* (one layer) or midlayer.{i}.* (several, from 2025-12).
    if num_layers == 1:
        return key
    if key.startswith("midlayer."):
        return "midlayer.0." + key[len("midlayer."):]
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        return f"midlayer.{i}." + rest.replace("input_layernorm.", "hidden_norm.")
    return key


#: layout name -> what checkpoint-formats.md says that producer writes.
EAGLE3_LAYOUTS = ("reference", "specforge", "speculators", "modelopt", "modelopt-midlayer")


def make_tiny_eagle3_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    weights_format: Literal["safetensors", "bin"] = "safetensors",
    own_embedding: bool | Literal["random", "copy"] = False,
    hidden_size: int | None = None,
    num_feature_layers: int = 3,
    init_scale: float = 0.1,
    norm_noise: float = 0.05,
    layout: str = "reference",
    num_layers: int = 1,
    feature_ids: list[int] | None = None,
    norm_before_residual: bool | None = None,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool | None = None,
    **config_overrides: Any,
) -> Path:
    """Make a random EAGLE-3 head for the target in target_dir, in one of the published layouts.

    ``layout`` (checkpoint-formats.md sections 2-5): "reference" (SafeAILab cnets: midlayer.*, no eagle_config),
    "specforge" (reference keys, ``LlamaForCausalLMEagle3``, ``eagle_config``, top-level ``fc_norm`` /
    ``norm_output``), "speculators" (``speculators_model_type`` eagle3, ``transformer_layer_config``, top-level
    ids and norm flags, ``layers.N.*`` keys, ``embed_tokens`` saved unless own_embedding is False),
    "modelopt" (``eagle_config`` with ModelOpt switches, ``layers.N.*``, ``lm_head`` always, ``d2t`` only when
    the draft vocabulary is smaller, no ``t2d``/``embed_tokens``) and "modelopt-midlayer" (the same with the
    pre-2026-03 ``midlayer[.N].*`` names). ``feature_ids``: the ids written into the config, in the layout's
    own convention (None: none written). ``num_layers`` > 1 (speculators, modelopt): plain layers after the
    first. The norm flags are written only when not None / True (speculators' norm_before_residual defaults to
    true when absent, as vLLM reads it).

    config.json: Llama-style, num_hidden_layers 1, dims/rope/vocab copied from the target, plus
    ``draft_vocab_size``. Weights: see eagle3_weight_shapes(); matrices N(0, init_scale), norms
    1 + N(0, norm_noise).
    ``draft_vocab_size``: None or the target's vocab size = the same vocabulary (no d2t/t2d
    buffers: identity); smaller = a random subset of the target's ids (seeded), written as
    ``d2t`` int64 [Vd] (target_id = draft_id + d2t[draft_id], ascending) and ``t2d`` bool [V].
    ``hidden_size``: the head's width when it differs from the target's; config.json then carries
    ``target_hidden_size`` and fc is [hidden_size, 3 * target hidden] (needs ``own_embedding``, as
    the target's embedding has the target's width). ``num_feature_layers``: fc reads that many
    target layers' features (3 in the published heads).
    """
    out_dir, target_dir, tcfg = _head_prelude(out_dir, target_dir, weights_format, own_embedding)
    V = int(tcfg["vocab_size"])
    Vd = V if draft_vocab_size is None else int(draft_vocab_size)
    if not 1 <= Vd <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {Vd}")
    TH = int(tcfg["hidden_size"])

    if layout not in EAGLE3_LAYOUTS:
        raise ValueError(f"layout must be one of {EAGLE3_LAYOUTS}, got {layout!r}")
    if num_layers > 1 and layout in ("reference", "specforge"):
        raise ValueError("reference and SpecForge EAGLE-3 heads have exactly one layer")
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if layout == "reference" else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": num_layers,
    }
    for k in _DRAFT_FROM_TARGET:
        if tcfg.get(k) is not None:
            cfg[k] = tcfg[k]
    if hidden_size is not None and int(hidden_size) != TH:
        if own_embedding == "copy" or not own_embedding:
            raise ValueError("a head narrower or wider than its target needs its own random embedding")
        cfg["hidden_size"] = int(hidden_size)
        cfg["target_hidden_size"] = TH
        cfg["head_dim"] = int(hidden_size) // int(cfg["num_attention_heads"])
        cfg["intermediate_size"] = 2 * int(hidden_size)
    cfg["draft_vocab_size"] = Vd
    _finish_draft_config(cfg, tcfg, init_scale, config_overrides)

    shapes = eagle3_weight_shapes(cfg, own_embedding=bool(own_embedding), num_feature_layers=num_feature_layers,
                                  num_layers=num_layers, norm_before_fc=norm_before_fc, fc_norm=fc_norm)
    gen = torch.Generator().manual_seed(seed)
    tensors = _random_weights(shapes, gen, init_scale, norm_noise, own_embedding, target_dir)
    if Vd < V:
        target_ids = torch.randperm(V, generator=gen)[:Vd].sort().values
        tensors["d2t"] = (target_ids - torch.arange(Vd)).to(torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
    flags = {"norm_before_fc": norm_before_fc or None, "fc_norm": fc_norm or None, "norm_output": norm_output,
             "norm_before_residual": norm_before_residual}
    flags = {k: v for k, v in flags.items() if v is not None}
    cfg, tensors = _eagle3_layout(layout, cfg, tensors, flags, feature_ids, num_layers, Vd, V)
    return write_head(out_dir, cfg, tensors, weights_format)


def _eagle3_layout(layout: str, cfg: dict, tensors: dict, flags: dict, feature_ids, num_layers: int, Vd: int,
                   V: int) -> tuple[dict, dict]:
    """Config and tensor names as each producer writes them (checkpoint-formats.md sections 2-5)."""
    ids = None if feature_ids is None else [int(i) for i in feature_ids]
    if layout in ("reference", "specforge"):
        cfg.update(flags)
        if layout == "specforge":
            cfg["eagle_config"] = {} if ids is None else {"eagle_aux_hidden_state_layer_ids": ids}
        elif ids is not None:
            raise ValueError("the reference EAGLE-3 layout has no place for feature ids")
        return cfg, tensors
    if layout == "speculators":
        # As transformers 5 writes it (published 2026 configs): rope only in rope_parameters, dtype not torch_dtype.
        top_only = ("draft_vocab_size", "target_hidden_size", "rope_theta", "rope_scaling", "torch_dtype")
        layer_cfg = {k: v for k, v in cfg.items() if k not in top_only}
        layer_cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
        out = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                   "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer_cfg, "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg.get("target_hidden_size"), "embed_requires_grad": False, **flags,
        }
        if ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = ids
        return out, {_rename_speculators(k): v for k, v in tensors.items()}
    # ModelOpt: eagle_config with its switches; lm_head always, d2t only when Vd < V, no t2d / embed_tokens.
    eagle_config = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                    "use_mtp_layernorm": False, "use_aux_hidden_state": True, "next_layer_regular": True,
                    "parallel_draft_step": 1, **flags}
    if ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["eagle_config"] = eagle_config
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tensors = {k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight")}
    if Vd == V:
        tensors.pop("d2t", None)
    if layout == "modelopt":
        return cfg, {_rename_modelopt(k): v for k, v in tensors.items()}
    return cfg, {_rename_modelopt_midlayer(k, num_layers): v for k, v in tensors.items()}


def _random_weights(shapes: dict[str, tuple], gen: torch.Generator, init_scale: float, norm_noise: float,
                    own_embedding, target_dir: Path) -> dict[str, torch.Tensor]:
    """Norm weights 1 + N(0, norm_noise), the embedding copied from the target if asked, the rest N(0, init_scale)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + norm_noise * torch.randn(shape, generator=gen)
        elif name == "embed_tokens.weight" and own_embedding == "copy":
            t = _load_target_embedding(target_dir)
            if tuple(t.shape) != shape:
                raise ValueError(f"target embedding shape {tuple(t.shape)} != draft {shape}")
        else:
            t = init_scale * torch.randn(shape, generator=gen)
        tensors[name] = t.to(torch.float32).contiguous()
    return tensors


def write_head(out_dir: Path, cfg: dict, tensors: dict[str, torch.Tensor], weights_format: str) -> Path:
    """The published layout: config.json plus model.safetensors or pytorch_model.bin (never both)."""
    for stale in ("model.safetensors", "pytorch_model.bin"):
        (out_dir / stale).unlink(missing_ok=True)
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(tensors, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


def _load_target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if key in fh.keys():
                    return fh.get_tensor(key).clone()
    raise FileNotFoundError(f"no embed_tokens.weight in {target_dir}")


# ---------------------------------------------------------------------------------------------
# Pair + CLI
# ---------------------------------------------------------------------------------------------


def make_pair(
    root: str | Path,
    preset: str = "mha",
    seed: int = 0,
    fc_bias: bool = True,
    *,
    own_embedding: bool | Literal["random", "copy"] = False,
    weights_format: Literal["safetensors", "bin"] = "safetensors",
    with_tokenizer: bool = True,
    initializer_range: float = 0.2,
    init_scale: float = 0.1,
    eos_token_id: int | None = None,
    eagle3: bool = False,
    draft_vocab_size: int | None = None,
    **head: Any,
) -> tuple[Path, Path]:
    """Make root/target and root/draft (draft seeded with seed + 1). Returns (target_dir, draft_dir).

    ``eagle3``: an EAGLE-3 head (``fc_bias`` does not apply) with ``draft_vocab_size`` (None: the target's).
    ``head``: more keywords for the head writer (``layout``, ``num_layers``, ``hass``, ``qkv_bias``, ...).
    """
    root = Path(root)
    target = make_tiny_target(
        root / "target",
        preset,
        seed=seed,
        with_tokenizer=with_tokenizer,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
    )
    common = dict(seed=seed + 1, own_embedding=own_embedding, weights_format=weights_format, init_scale=init_scale)
    if eagle3:
        return target, make_tiny_eagle3_draft(root / "draft", target, draft_vocab_size=draft_vocab_size, **common,
                                              **head)
    return target, make_tiny_draft(root / "draft", target, fc_bias=fc_bias, **common, **head)


@click.command()
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", default="mha", show_default=True, type=click.Choice(sorted(TARGET_PRESETS)))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--fc-bias/--no-fc-bias", default=True, show_default=True)
@click.option(
    "--own-embedding", type=click.Choice(["none", "random", "copy"]), default="none", show_default=True
)
@click.option(
    "--weights-format", type=click.Choice(["safetensors", "bin"]), default="safetensors", show_default=True
)
@click.option("--eagle3", is_flag=True, help="Write an EAGLE-3 head (midlayer.*) instead of an EAGLE-1/2 one.")
@click.option("--draft-vocab-size", type=int, default=None, help="EAGLE-3: draft vocabulary (default: the target's).")
@click.option("--layout", type=click.Choice(["reference", "specforge", "speculators", "modelopt", "modelopt-midlayer"]),
              default="reference", show_default=True, help="EAGLE-3: which producer's format to write.")
@click.option("--num-layers", type=int, default=1, show_default=True, help="Decoder layers in the head.")
def main(out: Path, preset: str, seed: int, fc_bias: bool, own_embedding: str, weights_format: str, eagle3: bool,
         draft_vocab_size: int | None, layout: str, num_layers: int) -> None:
    """Write OUT/target (tiny HF model of the preset's family + tokenizer) and OUT/draft (EAGLE head)."""
    target, draft = make_pair(
        out,
        preset,
        seed,
        fc_bias,
        own_embedding=False if own_embedding == "none" else own_embedding,
        weights_format=weights_format,  # type: ignore[arg-type]
        eagle3=eagle3,
        draft_vocab_size=draft_vocab_size,
        num_layers=num_layers,
        **({"layout": layout} if eagle3 else {}),
    )
    tcfg = json.loads((target / "config.json").read_text())
    dcfg = json.loads((draft / "config.json").read_text())
    click.echo(
        f"target: {target}  preset={preset} ({tcfg['architectures'][0]}) seed={seed} hidden={tcfg['hidden_size']} "
        f"layers={tcfg['num_hidden_layers']} heads={tcfg['num_attention_heads']}/"
        f"{tcfg['num_key_value_heads']} head_dim={tcfg.get('head_dim')} vocab={tcfg['vocab_size']} "
        f"rope={tcfg['rope_parameters']}"
    )
    kind = (f"eagle3 layout={layout} draft_vocab_size={dcfg['draft_vocab_size']}" if eagle3
            else f"eagle1 bias={dcfg.get('bias')}")
    click.echo(
        f"draft:  {draft}  {kind} own_embedding={own_embedding} "
        f"files={sorted(p.name for p in draft.iterdir())}"
    )


if __name__ == "__main__":
    main()

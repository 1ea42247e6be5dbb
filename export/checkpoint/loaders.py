"""Load a Hugging Face target and an EAGLE draft head, and check that they fit, before any export work."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.formats import (
    BY_NAME,
    EAGLE1,
    EAGLE3,
    HASS_NORMS,
    INPUT_OF_LAYER,
    HeadDescription,
    HeadFormat,
    HeadOptions,
    detect_format,
    reference_default_layers,
    to_input_ids,
)

log = logging.getLogger(__name__)

# model_type -> the class transformers builds. Every family here has the Llama decoder-layer shape
# (input_layernorm, self_attn with q/k/v/o projections, post_attention_layernorm, an MLP) that
# TargetVerify traces; Qwen2's q/k/v biases come with its Linear modules, Qwen3's per-head q/k norms are
# applied by tree_attention, the rest (experts, windows, sinks, Llama 4's layers) by export/graphs/families.py.
SUPPORTED_TARGETS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    # Routed experts, windows, sinks, NoPE/chunked layers: export/graphs/families.py.
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}
# Families refused by name, with what their support would need (docs/formats.md).
MLA_NEEDS = ("multi-head latent attention (MLA) caches a compressed latent, not per-head K/V; it needs a latent "
             "KV cache contract")
HYBRID_NEEDS = ("its linear-attention layers keep a recurrent state, not a K/V cache; rejected draft tokens would "
                "need the state rolled back")
REFUSED_TARGETS = {
    "deepseek_v3": ("DeepSeek V3", MLA_NEEDS), "deepseek_v2": ("DeepSeek V2", MLA_NEEDS),
    "kimi_k2": ("Kimi K2", MLA_NEEDS), "mistral_large_3": ("Mistral Large 3", MLA_NEEDS),
    "qwen3_next": ("Qwen3-Next", HYBRID_NEEDS), "qwen3_5": ("Qwen3.5", HYBRID_NEEDS),
    "qwen3_5_moe": ("Qwen3.5", HYBRID_NEEDS),
    "llama4": ("Llama 4 (Llama4ForConditionalGeneration, the multimodal checkpoint)",
               "the text model alone (Llama4ForCausalLM, model_type llama4_text) is supported: save its "
               "language_model as a Llama4ForCausalLM checkpoint"),
}


def refused_family(cfg: dict) -> tuple[str, str] | None:
    """(family, what its support needs) for a target we refuse by name: listed model types, any config with an MLA
    ``kv_lora_rank`` (Kimi K2 and Mistral Large 3 ship DeepSeek-V3-shaped configs) or ``linear_attention`` layers."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for c in (cfg, text):
        mt = c.get("model_type")
        if mt in REFUSED_TARGETS:
            return REFUSED_TARGETS[mt]
    for c in (cfg, text):
        if c.get("kv_lora_rank"):
            return f"an MLA model ({c.get('model_type')})", MLA_NEEDS
        if "linear_attention" in (c.get("layer_types") or []):
            return f"a hybrid linear-attention model ({c.get('model_type')})", HYBRID_NEEDS
    return None
# RoPE types whose frequencies depend on the sequence length at run time ("dynamic" NTK, "longrope"):
# a traced graph would freeze the tracing length's frequencies, so these are refused.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)
# Checkpoint keys some published heads carry that hold no weights we need.
IGNORABLE_KEY = re.compile(r".*rotary_emb\.inv_freq$")


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


@dataclass
class LoadedTarget:
    path: Path
    model: torch.nn.Module
    config: object
    tokenizer_files: list[Path]
    eos_token_ids: list[int]
    bos_token_id: int | None


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
                weights: bool = True) -> LoadedTarget:
    """Load a target LLM from a Hugging Face directory (config.json + safetensors).

    weights=False builds the model on the meta device from its config (no weight memory; the lean export
    reads the checkpoint tensor by tensor later, export/data/lean.py).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"target: {path} is not a directory")
    cfg = _read_json(path / "config.json", "target")
    model_type = cfg.get("model_type")
    refused = refused_family(cfg)
    if refused is not None:
        raise CheckpointError(f"target: {path} is {refused[0]}, which is not supported: {refused[1]}")
    if model_type not in SUPPORTED_TARGETS:
        arch = ", ".join(cfg.get("architectures") or []) or "unknown architecture"
        supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_TARGETS.items())
        raise CheckpointError(
            f"target: {path} is model_type={model_type!r} ({arch}); supported target families: {supported}"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"target: {path} has config.json but no weights (*.safetensors or *.bin)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    except Exception as e:  # transformers raises many types; name the directory and its message
        raise CheckpointError(f"target: could not load {path}: {e}") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.eval()
    check_rope_traceable(model.config, f"target: {path}")
    tokenizer_files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    eos = _as_list(cfg.get("eos_token_id"))
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos += [i for i in _as_list(_read_json(gen_cfg, "target").get("eos_token_id")) if i not in eos]
    return LoadedTarget(path, model, model.config, tokenizer_files, eos, cfg.get("bos_token_id"))


def _rope_type(config) -> str:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type
        types = {str(v.get("rope_type", v.get("type", "default"))) for v in rp.values()}
        return ",".join(sorted(types))
    return str(rp.get("rope_type", rp.get("type", "default"))) if isinstance(rp, dict) else "default"


def check_rope_traceable(config, what: str) -> None:
    """Refuse RoPE variants whose frequencies change with the sequence length (a trace would freeze them)."""
    rope_type = _rope_type(config)
    if any(t in rope_type for t in LENGTH_DEPENDENT_ROPE):
        raise CheckpointError(
            f"{what} uses rope_type {rope_type!r}, whose frequencies depend on the sequence length at run time; "
            "the exported graphs cannot follow that. Supported: default, linear, llama3, yarn"
        )


@dataclass
class DraftCheckpoint:
    path: Path
    config: dict
    weights: dict[str, torch.Tensor]
    weights_file: Path
    ignored_keys: list[str] = field(default_factory=list)


def read_draft_checkpoint(path: str | Path) -> DraftCheckpoint:
    """Read config.json and the weights, preferring safetensors (never unpickles when one is present)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"draft: {path} is not a directory")
    config = _read_json(path / "config.json", "draft")
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            weights, wfile = load_file(str(st)), st
        elif pt.is_file():
            weights, wfile = torch.load(pt, map_location="cpu", weights_only=True), pt
        else:
            raise CheckpointError(f"draft: {path} has neither model.safetensors nor pytorch_model.bin")
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"draft: could not read weights from {path}: {e}") from e
    if not isinstance(weights, dict):
        raise CheckpointError(f"draft: {wfile} does not hold a state dict")
    ignored = sorted(k for k in weights if IGNORABLE_KEY.match(k))
    weights = {k: v for k, v in weights.items() if k not in ignored}
    return DraftCheckpoint(path, config, weights, wfile, ignored)


def _target_dims(tcfg) -> dict:
    heads = tcfg.num_attention_heads
    return {
        "hidden_size": tcfg.hidden_size,
        "vocab_size": tcfg.vocab_size,
        "num_layers": tcfg.num_hidden_layers,
        "head_dim": getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
    }


def _attention_dims(dcfg: dict, hidden: int) -> tuple[int, int, int, int]:
    """(heads, kv_heads, head_dim, intermediate) from the draft's layer config."""
    heads = int(dcfg.get("num_attention_heads", 0) or 0)
    if heads <= 0:
        raise CheckpointError("draft: config.json lacks num_attention_heads")
    kv = int(dcfg.get("num_key_value_heads") or heads)
    hd = int(dcfg.get("head_dim") or hidden // heads)
    inter = dcfg.get("intermediate_size")
    if not inter:
        raise CheckpointError("draft: config.json lacks intermediate_size")
    return heads, kv, hd, int(inter)


def _layer_shapes(prefix: str, lcfg: dict, hidden: int, in_dim: int, opts: HeadOptions,
                  pre_norm: str | None) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors: q/k/v read ``in_dim``; ``pre_norm`` names its pre-attention norm (or None)."""
    heads, kv, hd, inter = _attention_dims(lcfg, hidden)
    p = prefix
    out = {
        p + "self_attn.q_proj.weight": (heads * hd, in_dim),
        p + "self_attn.k_proj.weight": (kv * hd, in_dim),
        p + "self_attn.v_proj.weight": (kv * hd, in_dim),
        p + "self_attn.o_proj.weight": (hidden, heads * hd),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "post_attention_layernorm.weight": (hidden,),
    }
    if pre_norm:
        out[p + pre_norm + ".weight"] = (hidden,)
    if opts.qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                    p + "self_attn.v_proj.bias": (kv * hd,)})
    return out


def expected_shapes(desc: HeadDescription, hidden: int, vocab: int, draft_vocab: int, target_hidden: int,
                    num_features: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(canonical key -> shape, optional keys) of a head with these options, for either kind."""
    o, lc = desc.options, desc.layer_config
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    optional = {"embed_tokens.weight"}
    if o.kind == EAGLE1:
        shapes["fc.weight"] = (hidden, 2 * hidden)
        shapes.update(_layer_shapes("layers.0.", lc, hidden, hidden, o, None))
        for name, on in zip(HASS_NORMS, (o.embed_norm, o.hidden_fc_norm, o.lm_head_norm), strict=True):
            if on:
                shapes[name] = (hidden,)
    else:
        feature_dim = num_features * target_hidden
        shapes["fc.weight"] = (hidden, feature_dim)
        shapes.update(_layer_shapes("midlayer.", lc, hidden, 2 * hidden, o, "input_layernorm"))
        shapes["midlayer.hidden_norm.weight"] = (hidden,)
        shapes.update({"norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,),
                       "t2d": (vocab,)})
        optional |= {"d2t", "t2d"}
        if o.norm_before_fc:
            shapes["input_norm.weight"] = (feature_dim,)
        if o.fc_norm:
            shapes.update({f"fc_norm.{i}.weight": (target_hidden,) for i in range(num_features)})
    if o.fc_bias:
        shapes["fc.bias"] = (hidden,)
    for i in range(1, o.num_layers):
        shapes.update(_layer_shapes(f"layers.{i}.", lc, hidden, hidden, o, "input_layernorm"))
    return shapes, optional


INT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
              "vocab_size", "num_hidden_layers", "max_position_embeddings", "draft_vocab_size",
              "target_hidden_size")


def _check_config_ints(dcfg: dict, where: str = "config.json") -> None:
    for key in INT_FIELDS:
        value = dcfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CheckpointError(f"draft: {where} field {key!r} must be a non-negative integer, got {value!r}")


def _check_keys_and_shapes(ckpt: DraftCheckpoint, desc: HeadDescription, expected: dict, optional: set,
                           context: str) -> None:
    fmt = BY_NAME[desc.format]
    unknown = sorted(set(desc.weights) - set(expected))
    if unknown:
        raise CheckpointError(
            f"draft: {ckpt.weights_file} has keys a {fmt.title} head ({desc.format}) with these options does not "
            f"have: {', '.join(unknown[:8])}" + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        )
    missing = sorted(k for k in expected if k not in desc.weights and k not in optional)
    if missing:
        raise CheckpointError(f"draft: {ckpt.weights_file} lacks required keys: {', '.join(missing)}")
    for key, shape in expected.items():
        if key in desc.weights and tuple(desc.weights[key].shape) != shape:
            raise CheckpointError(
                f"draft: key {key!r} has shape {tuple(desc.weights[key].shape)} but {context} need {shape}"
            )


def _config_context(dcfg: dict, t: dict, hidden: int) -> str:
    heads, kv, hd, inter = _attention_dims(dcfg, hidden)
    return (f"the target (hidden_size={t['hidden_size']}, vocab_size={t['vocab_size']}) and the draft config "
            f"(hidden_size={hidden}, num_attention_heads={heads}, num_key_value_heads={kv}, head_dim={hd}, "
            f"intermediate_size={inter})")


def default_feature_layers(num_layers: int) -> list[int]:
    """The reference's EAGLE-3 choice: inputs of decoder layers 2, L//2 and L-3, in layer order, repeats kept."""
    return reference_default_layers(num_layers)


def _check_layer_ids(layers: list, n: int, what: str, hint: str = "") -> list[int]:
    if (not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
            or not all(0 <= i < n for i in layers)):
        raise CheckpointError(
            f"{what} {layers} must be decoder-layer indices in [0, {n}) (inputs of target layers; the target has "
            f"{n} layers){hint}"
        )
    return list(layers)


def resolve_feature_layers(target_config, requested: list[int] | None, desc: HeadDescription | None = None
                           ) -> tuple[list[int], str]:
    """(inputs of target layers the EAGLE-3 features are, where that came from): ``--feature-layers``, else the
    checkpoint's ids converted from its convention, else the format's default. Repeats are legal."""
    n = target_config.num_hidden_layers
    fmt = BY_NAME[desc.format] if desc is not None else None
    if requested is not None:
        layers = _check_layer_ids(list(requested), n, "--feature-layers")
        if desc is not None and desc.feature_ids is not None:
            own = to_input_ids(desc.feature_ids, desc.feature_convention)
            if own != layers:
                log.warning("--feature-layers %s overrides the checkpoint's %s (= inputs of layers %s)",
                            layers, desc.feature_source, own)
        return layers, "--feature-layers"
    if desc is not None and desc.feature_ids is not None:
        layers = to_input_ids(desc.feature_ids, desc.feature_convention)
        src = f"checkpoint {desc.feature_source} ({desc.feature_convention} of layer i)"
        return _check_layer_ids(layers, n, f"draft: {src} names target layers (as inputs)"), src
    ids = fmt.default_ids(n) if fmt is not None else default_feature_layers(n)
    conv = fmt.ids_convention if fmt is not None else INPUT_OF_LAYER
    layers = to_input_ids(ids, conv)
    src = f"default of {fmt.name if fmt else 'the reference'}: {ids} ({conv} of layer i)"
    _check_layer_ids(layers, n, f"target has {n} decoder layers, so the default EAGLE-3 feature layers",
                     "; pass --feature-layers")
    return layers, src


def _draft_to_target(d2t: torch.Tensor | None, t2d: torch.Tensor | None, vd: int, tv: int) -> torch.Tensor | None:
    """Absolute target ids of the draft vocabulary (draft_id + d2t[draft_id]), or None for the identity."""
    if d2t is None:
        if vd != tv:
            raise CheckpointError(
                f"draft: draft_vocab_size {vd} is smaller than the target's vocab_size {tv} but the checkpoint has "
                "no d2t to map draft ids to target ids"
            )
        if t2d is not None and not bool(t2d.bool().all()):
            raise CheckpointError("draft: t2d marks target ids missing from the draft vocabulary, but there is no d2t")
        return None
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"draft: d2t must hold integer offsets, got dtype {d2t.dtype}")
    tid = torch.arange(vd, dtype=torch.long) + d2t.to(torch.long)
    bad = torch.nonzero((tid < 0) | (tid >= tv)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(
            f"draft: d2t maps draft id {i} to target id {int(tid[i])} (= {i} + d2t[{i}] = {i} + {int(d2t[i])}), "
            f"outside the target's vocabulary [0, {tv}) ({bad.numel()} such ids)"
        )
    uniq, counts = torch.unique(tid, return_counts=True)
    if uniq.numel() != vd:
        dup = int(uniq[counts > 1][0])
        ids = torch.nonzero(tid == dup).flatten().tolist()
        raise CheckpointError(f"draft: d2t maps draft ids {ids} to the same target id {dup}")
    if t2d is not None:
        mask = t2d.bool()
        if int(mask.sum()) != vd or not bool(mask[tid].all()):
            raise CheckpointError(
                f"draft: t2d (marks {int(mask.sum())} target ids) disagrees with d2t (maps {vd} draft ids)"
            )
    if vd == tv and bool((tid == torch.arange(vd)).all()):
        return None  # an all-zero d2t over the full vocabulary: identity
    if t2d is None and not bool(d2t.any()):
        raise CheckpointError(
            f"draft: d2t is all zeros with draft_vocab_size {vd} < the target's vocab_size {tv} and there is no t2d: "
            f"the draft vocabulary would be target ids 0..{vd - 1}, which is what a d2t buffer that training never "
            "filled looks like (the mapping is missing); save the head with its vocabulary mapping")
    return tid


# Layer-config keys the head's LlamaConfig is built from; everything else in the draft config is format
# business (read by the format's spec) or metadata.
LAYER_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                     "vocab_size", "hidden_act")


def draft_llama_config(layer_config: dict, target_config, num_layers: int, where: str):
    """A transformers LlamaConfig for the head's decoder layers, filled from the draft's layer config."""
    from transformers import LlamaConfig

    d = {k: layer_config[k] for k in LAYER_CONFIG_KEYS if layer_config.get(k) is not None}
    d.setdefault("vocab_size", target_config.vocab_size)
    d.setdefault("rms_norm_eps", getattr(target_config, "rms_norm_eps", 1e-6))
    d.setdefault("max_position_embeddings", target_config.max_position_embeddings)
    d["num_hidden_layers"] = num_layers
    d["attention_bias"] = False
    d["mlp_bias"] = False
    cfg = LlamaConfig(**d)
    cfg._attn_implementation = "eager"
    check_rope_traceable(cfg, f"draft: {where}")
    return cfg


@dataclass
class LoadedDraft:
    """A draft head ready to trace, with what the manifest records about it."""

    head: torch.nn.Module
    ckpt: DraftCheckpoint
    config: object  # the LlamaConfig the head was built from
    variant: str  # "eagle1" | "eagle3"
    feature_layers: list[int] | None  # target layers whose inputs are the features (EAGLE-3), else None
    feature_dim: int  # width of the draft's `features` input (= the target's `features` output)
    vocab_size: int  # draft vocabulary (top-k is taken over it)
    d2t_identity: bool
    fc_bias: bool
    own_embedding: bool
    format: str = ""  # the detected checkpoint format (export/checkpoint/formats.py)
    options: HeadOptions | None = None
    feature_layers_source: str | None = None
    reading: str = "config"  # how the head was read (export/checkpoint/readings.py): config, or a writer's reading
    notice: str | None = None  # the one line that says what was assumed about the writer, if anything


def describe_draft(ckpt: DraftCheckpoint) -> tuple[HeadFormat, HeadDescription]:
    """Detect the checkpoint's format from its files and read it into canonical form."""
    where = str(ckpt.path / "config.json")
    _check_config_ints(ckpt.config)
    fmt = detect_format(ckpt.config, set(ckpt.weights), where)
    desc = fmt.describe(ckpt.config, ckpt.weights, where)
    _check_config_ints(desc.layer_config, where + " (layer config)")
    return fmt, desc


def detect_variant(ckpt: DraftCheckpoint) -> str:
    """"eagle1" or "eagle3", from the detected format."""
    return describe_draft(ckpt)[0].kind


def _load_weights(head: torch.nn.Module, weights: dict[str, torch.Tensor], shared: tuple[str, ...]) -> None:
    """Load the checkpoint's tensors; only the modules shared with the target (``shared``) may stay unloaded."""
    result = head.load_state_dict(weights, strict=False)
    # Missing keys other than the shared target modules would be a loader bug: fail loudly.
    bad = [k for k in result.missing_keys if not k.startswith(shared)]
    if bad or result.unexpected_keys:
        raise CheckpointError(f"draft: internal key mapping error: missing {bad}, unexpected {result.unexpected_keys}")


def _check_hidden(desc: HeadDescription, t: dict, where: str) -> tuple[int, int, int]:
    """(H, T, V) of the head against the target; one clear error on a mismatch."""
    lc = desc.layer_config
    th, tv = t["hidden_size"], t["vocab_size"]
    if not lc.get("hidden_size"):
        raise CheckpointError(f"draft: {where} lacks hidden_size")
    hidden = int(lc["hidden_size"])
    if "vocab_size" in lc and lc["vocab_size"] is not None and int(lc["vocab_size"]) != tv:
        raise CheckpointError(f"draft: vocab_size {lc['vocab_size']} (draft config.json) does not match the "
                              f"target's vocab_size {tv}")
    if desc.options.kind == EAGLE1:
        if hidden != th:
            raise CheckpointError(f"draft: hidden_size {hidden} (draft config.json) does not match the target's "
                                  f"hidden_size {th}")
        return hidden, th, tv
    if desc.target_hidden_size is not None and int(desc.target_hidden_size) != th:
        raise CheckpointError(f"draft: target_hidden_size {desc.target_hidden_size} (draft config.json) does not "
                              f"match the target's hidden_size {th}")
    if hidden != th:
        if desc.target_hidden_size is None:
            raise CheckpointError(
                f"draft: hidden_size {hidden} (draft config.json) does not match the target's hidden_size {th} "
                "(an EAGLE-3 head narrower or wider than its target declares target_hidden_size in config.json)")
        if "embed_tokens.weight" not in desc.weights:
            raise CheckpointError(
                f"draft: hidden_size {hidden} (draft config.json) does not match the target's hidden_size {th}, and "
                f"the head has no embed_tokens.weight of its own (the target's embedding is {th} wide)")
    return hidden, th, tv


def load_draft_head(path: str | Path, target: LoadedTarget, feature_layers: list[int] | None = None,
                    reading: str = "auto") -> LoadedDraft:
    """Read a draft checkpoint, detect its format from the files, check it fits the target, build the head.

    feature_layers: EAGLE-3 only; inputs of the target layers the head reads (default: the checkpoint's ids,
    converted from its convention, else its format's default).
    reading: ``--head-reading`` (export/checkpoint/readings.py): auto (the writer's reading where the files name the
    writer), config, or a writer's reading forced.
    """
    from eagle_export.export.checkpoint.readings import apply_reading, choose_reading
    from eagle_export.export.graphs.heads import Eagle1Head, Eagle3Head

    ckpt = read_draft_checkpoint(path)
    fmt, desc = describe_draft(ckpt)
    chosen = choose_reading(fmt.name, ckpt.config, desc, reading)
    apply_reading(chosen, ckpt.config, desc)
    notice = chosen.notice()
    if notice:
        log.warning("%s", notice)
    opts = desc.options
    where = str(ckpt.path / "config.json")
    t = _target_dims(target.config)
    hidden, th, tv = _check_hidden(desc, t, where)
    w = desc.weights
    if opts.kind == EAGLE1:
        if feature_layers is not None:
            raise CheckpointError(
                f"--feature-layers applies to EAGLE-3 heads; {ckpt.path} is an EAGLE-1/2 head ({fmt.name}), "
                "which reads the target's last hidden state"
            )
        layers, source, vd, nfeat = None, None, tv, 1
    else:
        layers, source = resolve_feature_layers(target.config, feature_layers, desc)
        nfeat = len(layers)
        if "lm_head.weight" not in w:
            raise CheckpointError(f"draft: {ckpt.weights_file} has no lm_head.weight (an EAGLE-3 head without its "
                                  "own lm_head, e.g. draft_vocab_size null, is not supported)")
        if desc.layer_config.get("tie_word_embeddings") or ckpt.config.get("tie_word_embeddings"):
            log.warning("draft: %s sets tie_word_embeddings, which is not followed: the head's own lm_head.weight "
                        "is used, as the reference does (SGLang would tie it to the embedding)", where)
        vd = int(desc.draft_vocab_size or w["lm_head.weight"].shape[0])
        if not 1 <= vd <= tv:
            raise CheckpointError(f"draft: draft_vocab_size {vd} (draft config.json) must be between 1 and the "
                                  f"target's vocab_size {tv}")
        fc = w.get("fc.weight")
        if fc is not None and fc.dim() == 2 and fc.shape[1] != nfeat * th:
            hint = ""
            if fc.shape[1] % th == 0 and fc.shape[1] // th != nfeat:
                hint = f" (the head reads {fc.shape[1] // th} layers' features: pass that many with --feature-layers)"
            raise CheckpointError(
                f"draft: fc.weight takes {fc.shape[1]} input features but the target's EAGLE-3 features are "
                f"{nfeat} layers {layers} ({source}) x hidden_size {th} = {nfeat * th}{hint}")
    expected, optional = expected_shapes(desc, hidden, tv, vd, th, nfeat)
    _check_keys_and_shapes(ckpt, desc, expected, optional,
                           _config_context(desc.layer_config, t, hidden)
                           + (f" with draft_vocab_size={vd}" if opts.kind == EAGLE3 else ""))
    cfg = draft_llama_config(desc.layer_config, target.config, opts.num_layers, where)
    dtype = target.model.lm_head.weight.dtype
    embed = target.model.model.embed_tokens
    own = "embed_tokens.weight" in w
    if own:
        embed = torch.nn.Embedding(*w["embed_tokens.weight"].shape)
    if opts.kind == EAGLE1:
        head = Eagle1Head(cfg, opts, embed, target.model.lm_head)
        _load_weights(head, dict(w), ("embed_tokens.", "lm_head.", "rotary_emb."))
        d2t = None
    else:
        d2t = _draft_to_target(w.get("d2t"), w.get("t2d"), vd, tv)
        head = Eagle3Head(cfg, opts, nfeat * th, vd, embed, d2t, target_hidden=th)
        _load_weights(head, {k: v for k, v in w.items() if k not in ("d2t", "t2d")}, ("embed_tokens.", "rotary_emb."))
    head.to(dtype).eval()
    return LoadedDraft(head, ckpt, cfg, opts.kind, layers, nfeat * th, vd, d2t is None, opts.fc_bias, own,
                       fmt.name, opts, source, chosen.name, notice)


def load_eagle1_head(path: str | Path, target: LoadedTarget):
    """Build an EAGLE-1/2 head with the checkpoint's weights and the target's embedding / lm_head:
    (head, checkpoint, LlamaConfig)."""
    d = load_draft_head(path, target)
    if d.variant != EAGLE1:
        raise CheckpointError(f"draft: {path} is an EAGLE-3 head ({d.format}), not EAGLE-1/2")
    return d.head, d.ckpt, d.config

"""Load a Hugging Face target and an EAGLE draft head, and check that they fit, before any export work."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_export.errors import CheckpointError

log = logging.getLogger(__name__)

# model_type -> the class transformers builds. Every family here has the Llama decoder-layer shape
# (input_layernorm, self_attn with q/k/v/o projections, post_attention_layernorm, mlp) that
# TargetVerify traces; Qwen2's q/k/v biases come with its Linear modules, Qwen3's per-head q/k norms are
# applied by tree_attention.
SUPPORTED_TARGETS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
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
    reads the checkpoint tensor by tensor later, export/weights.py).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"target: {path} is not a directory")
    cfg = _read_json(path / "config.json", "target")
    model_type = cfg.get("model_type")
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


def sliding_window_layers(config) -> tuple[int | None, list[int]]:
    """(window, layers that use it) as transformers applies them; (None, []) when attention is full everywhere."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, []
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral: one window for every layer
        return int(window), list(range(config.num_hidden_layers))
    return int(window), [i for i, t in enumerate(types) if t == "sliding_attention"]


def check_sliding_window(target: LoadedTarget, max_seq_len: int) -> None:
    """The graphs implement full causal attention; that equals sliding-window attention only while every
    query-key distance stays below the window, i.e. when the window >= the capacity (--max-seq-len)."""
    window, layers = sliding_window_layers(target.config)
    if layers and window < max_seq_len:
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise CheckpointError(
            f"target: {target.path} uses sliding-window attention (sliding_window={window} on layers {shown}) and "
            f"--max-seq-len {max_seq_len} is larger than the window; the exported graphs use full attention, which "
            f"would differ from the model past {window} tokens: export with --max-seq-len {window} or less"
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
    """(heads, kv_heads, head_dim, intermediate) from the draft config."""
    heads = int(dcfg.get("num_attention_heads", 0) or 0)
    if heads <= 0:
        raise CheckpointError("draft: config.json lacks num_attention_heads")
    kv = int(dcfg.get("num_key_value_heads") or heads)
    hd = int(dcfg.get("head_dim") or hidden // heads)
    inter = dcfg.get("intermediate_size")
    if not inter:
        raise CheckpointError("draft: config.json lacks intermediate_size")
    return heads, kv, hd, int(inter)


def eagle1_expected_shapes(dcfg: dict, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the published EAGLE-1/2 keys (optional ones included) implied by the draft config."""
    heads, kv, hd, inter = _attention_dims(dcfg, hidden)
    p = "layers.0."
    return {
        "fc.weight": (hidden, 2 * hidden),
        "fc.bias": (hidden,),
        "embed_tokens.weight": (vocab, hidden),
        p + "self_attn.q_proj.weight": (heads * hd, hidden),
        p + "self_attn.k_proj.weight": (kv * hd, hidden),
        p + "self_attn.v_proj.weight": (kv * hd, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * hd),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "post_attention_layernorm.weight": (hidden,),
    }


EAGLE1_OPTIONAL = {"fc.bias", "embed_tokens.weight"}


def eagle3_expected_shapes(dcfg: dict, hidden: int, vocab: int, draft_vocab: int,
                           feature_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the published EAGLE-3 keys (optional ones included) implied by the draft config."""
    heads, kv, hd, inter = _attention_dims(dcfg, hidden)
    p = "midlayer."
    return {
        "fc.weight": (hidden, feature_dim),
        "embed_tokens.weight": (vocab, hidden),
        p + "self_attn.q_proj.weight": (heads * hd, 2 * hidden),
        p + "self_attn.k_proj.weight": (kv * hd, 2 * hidden),
        p + "self_attn.v_proj.weight": (kv * hd, 2 * hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * hd),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "hidden_norm.weight": (hidden,),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


EAGLE3_OPTIONAL = {"embed_tokens.weight", "d2t", "t2d"}


INT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
              "vocab_size", "num_hidden_layers", "max_position_embeddings", "draft_vocab_size",
              "target_hidden_size")


def _check_config_ints(dcfg: dict) -> None:
    for key in INT_FIELDS:
        value = dcfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CheckpointError(f"draft: config.json field {key!r} must be a non-negative integer, got {value!r}")


def _check_keys_and_shapes(ckpt: DraftCheckpoint, expected: dict, optional: set, variant_name: str,
                           context: str) -> None:
    unknown = sorted(set(ckpt.weights) - set(expected))
    if unknown:
        raise CheckpointError(
            f"draft: {ckpt.weights_file} has keys an {variant_name} head does not have: {', '.join(unknown[:8])}"
            + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        )
    missing = sorted(k for k in expected if k not in ckpt.weights and k not in optional)
    if missing:
        raise CheckpointError(f"draft: {ckpt.weights_file} lacks required keys: {', '.join(missing)}")
    for key, shape in expected.items():
        if key in ckpt.weights and tuple(ckpt.weights[key].shape) != shape:
            raise CheckpointError(
                f"draft: key {key!r} has shape {tuple(ckpt.weights[key].shape)} but {context} need {shape}"
            )


def _config_context(dcfg: dict, t: dict, hidden: int) -> str:
    heads, kv, hd, inter = _attention_dims(dcfg, hidden)
    return (f"the target (hidden_size={t['hidden_size']}, vocab_size={t['vocab_size']}) and the draft config "
            f"(hidden_size={hidden}, num_attention_heads={heads}, num_key_value_heads={kv}, head_dim={hd}, "
            f"intermediate_size={inter})")


def check_eagle1_fits(ckpt: DraftCheckpoint, target_config) -> None:
    """Every key known, every required key present, every shape as the target implies; else one clear error."""
    t = _target_dims(target_config)
    dcfg = ckpt.config
    _check_config_ints(dcfg)
    if int(dcfg.get("hidden_size", -1)) != t["hidden_size"]:
        raise CheckpointError(
            f"draft: hidden_size {dcfg.get('hidden_size')} (draft config.json) does not match the target's "
            f"hidden_size {t['hidden_size']}"
        )
    if "vocab_size" in dcfg and int(dcfg["vocab_size"]) != t["vocab_size"]:
        raise CheckpointError(
            f"draft: vocab_size {dcfg['vocab_size']} (draft config.json) does not match the target's "
            f"vocab_size {t['vocab_size']}"
        )
    if int(dcfg.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(
            f"draft: num_hidden_layers={dcfg.get('num_hidden_layers')}; EAGLE-1/2 heads have exactly one layer"
        )
    expected = eagle1_expected_shapes(dcfg, t["hidden_size"], t["vocab_size"])
    _check_keys_and_shapes(ckpt, expected, EAGLE1_OPTIONAL, "EAGLE-1/2",
                           _config_context(dcfg, t, t["hidden_size"]))


def default_feature_layers(num_layers: int) -> list[int]:
    """The reference's EAGLE-3 choice: inputs of decoder layers 2, L//2 and L-3, in layer order."""
    return sorted({2, num_layers // 2, num_layers - 3})


def resolve_feature_layers(target_config, requested: list[int] | None) -> list[int]:
    """The target layers whose inputs form the EAGLE-3 features: the reference's default, or the caller's."""
    n = target_config.num_hidden_layers
    if requested is None:
        layers = default_feature_layers(n)
        if len(layers) != 3 or layers[0] < 0 or layers[-1] >= n:
            raise CheckpointError(
                f"target has {n} decoder layers, so the reference's EAGLE-3 feature layers (2, L//2, L-3) = "
                f"({2}, {n // 2}, {n - 3}) are not three distinct layers in [0, {n}); pass --feature-layers"
            )
        return layers
    layers = list(requested)
    if (not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
            or len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers)):
        raise CheckpointError(
            f"--feature-layers {layers} must be distinct decoder-layer indices in [0, {n}) (the target has {n} layers)"
        )
    return layers


@dataclass
class Eagle3Fit:
    """What check_eagle3_fits found out about an EAGLE-3 checkpoint."""

    hidden_size: int
    feature_dim: int
    draft_vocab_size: int
    draft_to_target: torch.Tensor | None  # [Vd] absolute target ids; None = identity


def check_eagle3_fits(ckpt: DraftCheckpoint, target_config, feature_layers: list[int]) -> Eagle3Fit:
    """Config, keys, shapes and the d2t mapping of an EAGLE-3 head against the target; else one clear error."""
    t = _target_dims(target_config)
    dcfg = ckpt.config
    w = ckpt.weights
    _check_config_ints(dcfg)
    tv, th = t["vocab_size"], t["hidden_size"]
    if "vocab_size" in dcfg and int(dcfg["vocab_size"]) != tv:
        raise CheckpointError(
            f"draft: vocab_size {dcfg['vocab_size']} (draft config.json) does not match the target's vocab_size {tv}"
        )
    if "target_hidden_size" in dcfg and int(dcfg["target_hidden_size"]) != th:
        raise CheckpointError(
            f"draft: target_hidden_size {dcfg['target_hidden_size']} (draft config.json) does not match the "
            f"target's hidden_size {th}"
        )
    if not dcfg.get("hidden_size"):
        raise CheckpointError("draft: config.json lacks hidden_size")
    hidden = int(dcfg["hidden_size"])
    if hidden != th:
        if "target_hidden_size" not in dcfg:
            raise CheckpointError(
                f"draft: hidden_size {hidden} (draft config.json) does not match the target's hidden_size {th} "
                "(an EAGLE-3 head narrower or wider than its target declares target_hidden_size in config.json)"
            )
        if "embed_tokens.weight" not in w:
            raise CheckpointError(
                f"draft: hidden_size {hidden} (draft config.json) does not match the target's hidden_size {th}, and "
                f"the head has no embed_tokens.weight of its own (the target's embedding is {th} wide)"
            )
    if int(dcfg.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(
            f"draft: num_hidden_layers={dcfg.get('num_hidden_layers')}; EAGLE-3 heads have exactly one layer "
            "(midlayer)"
        )
    vd = int(dcfg.get("draft_vocab_size") or tv)
    if not 1 <= vd <= tv:
        raise CheckpointError(
            f"draft: draft_vocab_size {vd} (draft config.json) must be between 1 and the target's vocab_size {tv}"
        )
    feature_dim = len(feature_layers) * th
    fc = w.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != feature_dim:
        hint = ""
        if fc.shape[1] % th == 0 and fc.shape[1] // th != len(feature_layers):
            hint = f" (the head reads {fc.shape[1] // th} layers' features: pass that many with --feature-layers)"
        raise CheckpointError(
            f"draft: fc.weight takes {fc.shape[1]} input features but the target's EAGLE-3 features are "
            f"{len(feature_layers)} layers {feature_layers} x hidden_size {th} = {feature_dim}{hint}"
        )
    expected = eagle3_expected_shapes(dcfg, hidden, tv, vd, feature_dim)
    _check_keys_and_shapes(ckpt, expected, EAGLE3_OPTIONAL, "EAGLE-3",
                           _config_context(dcfg, t, hidden) + f" with draft_vocab_size={vd}")
    return Eagle3Fit(hidden, feature_dim, vd, _draft_to_target(w.get("d2t"), w.get("t2d"), vd, tv))


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
        return None
    return tid


def draft_llama_config(ckpt: DraftCheckpoint, target_config):
    """A transformers LlamaConfig for the head's decoder layer, filled from the draft config."""
    from transformers import LlamaConfig

    d = dict(ckpt.config)
    for key in ("architectures", "model_type", "bias", "draft_vocab_size", "target_hidden_size", "auto_map"):
        d.pop(key, None)
    d.setdefault("vocab_size", target_config.vocab_size)
    d.setdefault("rms_norm_eps", getattr(target_config, "rms_norm_eps", 1e-6))
    d["num_hidden_layers"] = 1
    d["attention_bias"] = False
    d["mlp_bias"] = False
    cfg = LlamaConfig(**d)
    cfg._attn_implementation = "eager"
    check_rope_traceable(cfg, f"draft: {ckpt.path}")
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


def detect_variant(ckpt: DraftCheckpoint) -> str:
    """From the keys: `midlayer.*` is an EAGLE-3 head, `layers.0.*` an EAGLE-1/2 head."""
    e3 = any(k.startswith("midlayer.") for k in ckpt.weights)
    e1 = any(k.startswith("layers.") for k in ckpt.weights)
    if e3 and e1:
        raise CheckpointError(
            f"draft: {ckpt.weights_file} has both midlayer.* (EAGLE-3) and layers.* (EAGLE-1/2) keys: not one head"
        )
    if e3:
        return "eagle3"
    if e1:
        return "eagle1"
    shown = ", ".join(sorted(ckpt.weights)[:6]) or "no tensors"
    raise CheckpointError(
        f"draft: {ckpt.weights_file} is not an EAGLE head: expected midlayer.* keys (EAGLE-3) or layers.0.* keys "
        f"(EAGLE-1/2), found {shown}"
    )


def _load_weights(head: torch.nn.Module, weights: dict[str, torch.Tensor], shared: tuple[str, ...]) -> None:
    """Load the checkpoint's tensors; only the modules shared with the target (``shared``) may stay unloaded."""
    result = head.load_state_dict(weights, strict=False)
    # Missing keys other than the shared target modules would be a loader bug: fail loudly.
    bad = [k for k in result.missing_keys if not k.startswith(shared)]
    if bad or result.unexpected_keys:
        raise CheckpointError(f"draft: internal key mapping error: missing {bad}, unexpected {result.unexpected_keys}")


def load_eagle1_head(path: str | Path, target: LoadedTarget):
    """Build an Eagle1Head with the checkpoint's weights and the target's embedding / lm_head."""
    return _load_eagle1(read_draft_checkpoint(path), target)


def _load_eagle1(ckpt: DraftCheckpoint, target: LoadedTarget):
    from .modules import Eagle1Head

    check_eagle1_fits(ckpt, target.config)
    cfg = draft_llama_config(ckpt, target.config)
    dtype = target.model.lm_head.weight.dtype
    embed = target.model.model.embed_tokens
    if "embed_tokens.weight" in ckpt.weights:
        embed = torch.nn.Embedding(*ckpt.weights["embed_tokens.weight"].shape)
    head = Eagle1Head(cfg, "fc.bias" in ckpt.weights, embed, target.model.lm_head)
    _load_weights(head, dict(ckpt.weights), ("embed_tokens.", "lm_head.", "rotary_emb."))
    head.to(dtype).eval()
    return head, ckpt, cfg


def _load_eagle3(ckpt: DraftCheckpoint, target: LoadedTarget, feature_layers: list[int]):
    from .modules import Eagle3Head

    fit = check_eagle3_fits(ckpt, target.config, feature_layers)
    cfg = draft_llama_config(ckpt, target.config)
    dtype = target.model.lm_head.weight.dtype
    embed = target.model.model.embed_tokens
    if "embed_tokens.weight" in ckpt.weights:
        embed = torch.nn.Embedding(*ckpt.weights["embed_tokens.weight"].shape)
    head = Eagle3Head(cfg, fit.feature_dim, fit.draft_vocab_size, embed, fit.draft_to_target)
    _load_weights(head, {k: v for k, v in ckpt.weights.items() if k not in ("d2t", "t2d")},
                  ("embed_tokens.", "rotary_emb."))
    head.to(dtype).eval()
    return head, cfg, fit


def load_draft_head(path: str | Path, target: LoadedTarget, feature_layers: list[int] | None = None) -> LoadedDraft:
    """Read a draft checkpoint, tell EAGLE-1/2 from EAGLE-3 by its keys, check it fits the target, build the head.

    feature_layers: EAGLE-3 only; the target layers whose inputs the head reads (default: the reference's
    2, L//2, L-3).
    """
    ckpt = read_draft_checkpoint(path)
    variant = detect_variant(ckpt)
    own = "embed_tokens.weight" in ckpt.weights
    if variant == "eagle1":
        if feature_layers is not None:
            raise CheckpointError(
                f"--feature-layers applies to EAGLE-3 heads; {ckpt.path} is an EAGLE-1/2 head (layers.0.* keys), "
                "which reads the target's last hidden state"
            )
        head, ckpt, cfg = _load_eagle1(ckpt, target)
        return LoadedDraft(head, ckpt, cfg, "eagle1", None, target.config.hidden_size, target.config.vocab_size,
                           True, "fc.bias" in ckpt.weights, own)
    layers = resolve_feature_layers(target.config, feature_layers)
    head, cfg, fit = _load_eagle3(ckpt, target, layers)
    return LoadedDraft(head, ckpt, cfg, "eagle3", layers, fit.feature_dim, fit.draft_vocab_size,
                       fit.draft_to_target is None, False, own)

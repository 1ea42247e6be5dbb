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

# model_type -> the class transformers builds; extended family by family.
SUPPORTED_TARGETS = {"llama": "LlamaForCausalLM"}

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


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True) -> LoadedTarget:
    """Load a target LLM from a Hugging Face directory (config.json + safetensors)."""
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
        raise CheckpointError(f"target: {path} has config.json but no weights (*.safetensors)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    except Exception as e:  # transformers raises many types; name the directory and its message
        raise CheckpointError(f"target: could not load {path}: {e}") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.eval()
    tokenizer_files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    eos = _as_list(cfg.get("eos_token_id"))
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos += [i for i in _as_list(_read_json(gen_cfg, "target").get("eos_token_id")) if i not in eos]
    return LoadedTarget(path, model, model.config, tokenizer_files, eos, cfg.get("bos_token_id"))


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
        "head_dim": getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
    }


def eagle1_expected_shapes(dcfg: dict, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the published EAGLE-1/2 keys (optional ones included) implied by the draft config."""
    heads = int(dcfg.get("num_attention_heads", 0) or 0)
    if heads <= 0:
        raise CheckpointError("draft: config.json lacks num_attention_heads")
    kv = int(dcfg.get("num_key_value_heads") or heads)
    hd = int(dcfg.get("head_dim") or hidden // heads)
    inter = dcfg.get("intermediate_size")
    if not inter:
        raise CheckpointError("draft: config.json lacks intermediate_size")
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


INT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
              "vocab_size", "num_hidden_layers", "max_position_embeddings")


def _check_config_ints(dcfg: dict) -> None:
    for key in INT_FIELDS:
        value = dcfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CheckpointError(f"draft: config.json field {key!r} must be a non-negative integer, got {value!r}")


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
    unknown = sorted(set(ckpt.weights) - set(expected))
    if unknown:
        raise CheckpointError(
            f"draft: {ckpt.weights_file} has keys an EAGLE-1/2 head does not have: {', '.join(unknown[:8])}"
            + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        )
    missing = sorted(k for k in expected if k not in ckpt.weights and k not in EAGLE1_OPTIONAL)
    if missing:
        raise CheckpointError(f"draft: {ckpt.weights_file} lacks required keys: {', '.join(missing)}")
    for key, shape in expected.items():
        if key in ckpt.weights and tuple(ckpt.weights[key].shape) != shape:
            raise CheckpointError(
                f"draft: key {key!r} has shape {tuple(ckpt.weights[key].shape)} but the target "
                f"(hidden_size={t['hidden_size']}, vocab_size={t['vocab_size']}) and the draft config need {shape}"
            )


def draft_llama_config(ckpt: DraftCheckpoint, target_config):
    """A transformers LlamaConfig for the head's decoder layer, filled from the draft config."""
    from transformers import LlamaConfig

    d = dict(ckpt.config)
    d.pop("architectures", None)
    d.pop("model_type", None)
    bias = d.pop("bias", None)
    del bias
    d.setdefault("vocab_size", target_config.vocab_size)
    d.setdefault("rms_norm_eps", getattr(target_config, "rms_norm_eps", 1e-6))
    d["num_hidden_layers"] = 1
    d["attention_bias"] = False
    d["mlp_bias"] = False
    cfg = LlamaConfig(**d)
    cfg._attn_implementation = "eager"
    return cfg


def load_eagle1_head(path: str | Path, target: LoadedTarget):
    """Build an Eagle1Head with the checkpoint's weights and the target's embedding / lm_head."""
    from .modules import Eagle1Head

    ckpt = read_draft_checkpoint(path)
    check_eagle1_fits(ckpt, target.config)
    cfg = draft_llama_config(ckpt, target.config)
    dtype = target.model.lm_head.weight.dtype
    embed = target.model.model.embed_tokens
    if "embed_tokens.weight" in ckpt.weights:
        embed = torch.nn.Embedding(*ckpt.weights["embed_tokens.weight"].shape)
    head = Eagle1Head(cfg, "fc.bias" in ckpt.weights, embed, target.model.lm_head)
    own = {k: v for k, v in ckpt.weights.items()}
    result = head.load_state_dict(own, strict=False)
    # Missing keys other than the shared target modules would be a loader bug: fail loudly.
    shared = ("embed_tokens.", "lm_head.", "rotary_emb.")
    bad = [k for k in result.missing_keys if not k.startswith(shared)]
    if bad or result.unexpected_keys:
        raise CheckpointError(f"draft: internal key mapping error: missing {bad}, unexpected {result.unexpected_keys}")
    head.to(dtype).eval()
    return head, ckpt, cfg

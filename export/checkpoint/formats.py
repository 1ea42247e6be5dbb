"""The published EAGLE head formats, one small spec object each: how the format is recognised from its files,
how its tensor names map to the canonical names the head modules load, how its config is read (layer config,
math options) and which convention its feature-layer ids use.

The specification is ``shared/docs/checkpoint-formats.md`` (summarised in ``docs/formats.md``). Adding a format
means adding one ``HeadFormat`` subclass to ``FORMATS``; nothing else branches on the format.

Canonical names (what ``export/graphs/heads.py`` loads):

- EAGLE-1/2: ``fc.*``, ``layers.{i}.*`` (layer 0 without ``input_layernorm``), optional ``embed_tokens.weight``
  and the HASS norms ``embed_layernorm.weight``, ``hidden_layernorm.weight``, ``lm_head_layernorm.weight``.
- EAGLE-3: ``fc.*``, ``midlayer.*`` (first layer: q/k/v over 2H, ``hidden_norm``, ``input_layernorm`` on the
  embedding), ``layers.{i}.*`` for i >= 1 (plain pre-norm decoder layers, pre-norm ``input_layernorm``),
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional ``embed_tokens.weight``, ``input_norm.weight``
  (norm_before_fc), ``fc_norm.{i}.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eagle_export.errors import CheckpointError

EAGLE1, EAGLE3 = "eagle1", "eagle3"
# Feature-layer id conventions (checkpoint-formats.md section 6): the manifest always states inputs of layers.
INPUT_OF_LAYER, OUTPUT_OF_LAYER = "input", "output"

HASS_NORMS = ("embed_layernorm.weight", "hidden_layernorm.weight", "lm_head_layernorm.weight")

# Config keys that change the math and that no format here implements, with the value that is harmless
# (the key is accepted only with that value; None: any presence is refused). Looked up at the top level and
# inside ``eagle_config``.
UNSUPPORTED_CONFIG = {
    "quantization_config": (None, "quantized heads (ModelOpt hf_quant_config) are not supported"),
    "kv_lora_rank": (None, "MLA (DeepSeek/Kimi) draft layers are not supported"),
    "eh_proj_before_attn": (False, "TensorRT-LLM's eh_proj/enorm layout is not supported"),
    "use_mtp_layernorm": (False, "the MTP layernorm variant is not supported"),
    "parallel_draft_step": (1, "parallel-draft (Medusa-style) heads are not supported"),
    "use_aux_hidden_state": (True, "a ModelOpt head without aux hidden states (no fc) is not supported"),
    "next_layer_regular": (True, "layers after the first that are not regular decoder layers are not supported"),
    "use_last_layernorm": (True, "a head without the final norm before lm_head is not supported"),
    "use_input_layernorm_in_first_layer": (True, "a first layer without its embedding norm is not supported"),
    "attention_bias": (False, "o_proj biases in the draft layer are not supported"),
    "mlp_bias": (False, "MLP biases in the draft layer are not supported"),
    "pretraining_tp": (1, "pretraining_tp > 1 is not supported"),
}


@dataclass
class HeadOptions:
    """Everything about a head's math that is not a shape: the same fields for every format."""

    kind: str  # EAGLE1 | EAGLE3
    num_layers: int = 1
    fc_bias: bool = False
    qkv_bias: bool = False  # EAGLE-1/2 Qwen2 heads
    embed_norm: bool = False  # HASS: RMSNorm on the embedding before fc
    hidden_fc_norm: bool = False  # HASS: RMSNorm on the feature before fc
    lm_head_norm: bool = False  # HASS: RMSNorm before the target's lm_head
    norm_before_residual: bool = False  # EAGLE-3: residual = hidden_norm(z)
    norm_before_fc: bool = False  # EAGLE-3: one RMSNorm over the k*T feature vector (input_norm)
    fc_norm: bool = False  # EAGLE-3: one RMSNorm per T-wide feature chunk (fc_norm.{i})
    norm_output: bool = False  # EAGLE-3.1: feed norm(g) back instead of g
    # Readings of particular writers (export/checkpoint/readings.py sets them; the config alone never does):
    hidden_input_norm: bool = False  # ModelOpt: hidden stream = hidden_norm(input_layernorm(z)) in the first layer
    final_norm: bool = True  # SpecForge 0.2.0 norm_output false: logits = lm_head(g), no final norm
    # The head's own sliding window (speculators layer_types / sliding_window): keys at distance >= window are
    # masked in the listed draft layers (0 = the first layer); 0 = full attention everywhere.
    sliding_window: int = 0
    sliding_layers: list[int] = field(default_factory=list)


@dataclass
class HeadDescription:
    """What a format's spec read from the files: canonical weights, the layer config, options, feature ids."""

    format: str
    options: HeadOptions
    layer_config: dict  # Llama-style config of the draft layers (hidden_size, heads, rope, ...)
    weights: dict  # canonical name -> tensor
    feature_ids: list[int] | None = None  # as the checkpoint states them (None: the format's default)
    feature_convention: str = INPUT_OF_LAYER
    feature_source: str = ""
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None


def _layer_index_keys(keys, prefix: str) -> set[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return {int(m.group(1)) for k in keys if (m := pat.match(k))}


def _flag(cfg: dict, key: str, default: bool | None = None):
    """A config value from the top level, else from ``eagle_config``, else default."""
    if key in cfg:
        return cfg[key]
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict) and key in ec:
        return ec[key]
    return default


def _bool(cfg: dict, key: str, default: bool, where: str) -> bool:
    v = _flag(cfg, key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"draft: {where} field {key!r} must be true or false, got {v!r}")
    return v


def reference_default_layers(num_layers: int) -> list[int]:
    """The reference's EAGLE-3 feature layers: inputs of decoder layers 2, L//2 and L-3 (repeats kept), in layer
    order (the order the reference's forward appends them)."""
    return sorted([2, num_layers // 2, num_layers - 3])


class HeadFormat:
    """One published head format. Subclasses set ``name``/``kind`` and override what differs."""

    name = ""
    kind = EAGLE3
    title = ""
    # Feature ids: where they live in the config (dotted path), their convention.
    ids_key: str | None = None
    ids_convention = INPUT_OF_LAYER

    def detect(self, cfg: dict, keys: set[str]) -> bool:
        raise NotImplementedError

    def layer_config(self, cfg: dict, where: str) -> dict:
        """The Llama-style config of the draft layers."""
        return cfg

    def rename(self, key: str) -> str:
        """Canonical name of a tensor of this format (identity by default)."""
        return key

    def default_ids(self, num_target_layers: int) -> list[int]:
        """Feature ids when the checkpoint names none, in this format's convention."""
        return reference_default_layers(num_target_layers)

    def read_ids(self, cfg: dict) -> list[int] | None:
        if self.ids_key is None:
            return None
        node = cfg
        for part in self.ids_key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def options(self, cfg: dict, keys: set[str], where: str) -> HeadOptions:
        raise NotImplementedError

    def describe(self, cfg: dict, weights: dict, where: str) -> HeadDescription:
        """Read the files into a HeadDescription (canonical weights, options, layer config, feature ids)."""
        canon: dict = {}
        for k, v in weights.items():
            c = self.rename(k)
            if c in canon:
                raise CheckpointError(f"draft: {where}: keys {k!r} and another both map to {c!r}")
            canon[c] = v
        check_unsupported_config(cfg, where)
        opts = self.options(cfg, set(canon), where)
        ids = self.read_ids(cfg)
        if ids is not None and (not isinstance(ids, list) or not ids
                                or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
            raise CheckpointError(f"draft: {where} {self.ids_key} must be a list of integers, got {ids!r}")
        d = HeadDescription(self.name, opts, self.layer_config(cfg, where), canon, ids, self.ids_convention,
                            f"{self.ids_key} {ids}" if ids is not None else "")
        opts.sliding_window, opts.sliding_layers = head_window(d.layer_config, opts.num_layers, where)
        d.draft_vocab_size = cfg.get("draft_vocab_size")
        d.target_hidden_size = cfg.get("target_hidden_size")
        return d


def head_window(lc: dict, num_layers: int, where: str) -> tuple[int, list[int]]:
    """(sliding window, draft layers that use it) from the layer config, as transformers reads it: ``layer_types``
    entries "sliding_attention" (speculators writes ``["sliding_attention"]`` with ``sliding_window`` 2048 by
    default), or ``use_sliding_window`` true for every layer (Qwen2 style); (0, []) for full attention."""
    types = lc.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) < num_layers:
            raise CheckpointError(f"draft: {where} layer_types {types!r} must list the type of each of the head's "
                                  f"{num_layers} layer(s)")
        other = sorted({t for t in types[:num_layers] if t not in ("full_attention", "sliding_attention")})
        if other:
            raise CheckpointError(f"draft: {where} layer_types {other} are not supported in a draft head (only "
                                  "full_attention and sliding_attention)")
        layers = [i for i, t in enumerate(types[:num_layers]) if t == "sliding_attention"]
    elif lc.get("use_sliding_window") is True:
        layers = list(range(num_layers))
    else:
        return 0, []
    if not layers:
        return 0, []
    window = lc.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"draft: {where} has sliding-attention layers {layers} but sliding_window is "
                              f"{window!r} (a positive integer is needed)")
    return window, layers


def check_unsupported_config(cfg: dict, where: str) -> None:
    """Refuse every math-changing config key that no format implements (unless it holds the harmless value)."""
    for key, (ok, why) in UNSUPPORTED_CONFIG.items():
        for scope, node in (("", cfg), ("eagle_config.", cfg.get("eagle_config"))):
            if not isinstance(node, dict) or key not in node:
                continue
            value = node[key]
            if ok is None or value != ok:
                if ok is None and value in (None, False, {}, []):
                    continue
                raise CheckpointError(f"draft: {where} sets {scope}{key}={value!r}: {why}")


def _eagle3_options(cfg: dict, keys: set[str], where: str, *, nbr_default: bool = False) -> HeadOptions:
    """The EAGLE-3 norm options, read from the top level or ``eagle_config``, checked against the tensors."""
    nbf = _bool(cfg, "norm_before_fc", False, where)
    fcn = _bool(cfg, "fc_norm", False, where)
    out = _bool(cfg, "norm_output", False, where) or _bool(cfg, "return_hidden_post_norm", False, where)
    nbr = _bool(cfg, "norm_before_residual", nbr_default, where)
    if nbf and fcn:
        raise CheckpointError(f"draft: {where} sets both norm_before_fc and fc_norm; they are mutually exclusive")
    has_in = "input_norm.weight" in keys
    has_fcn = any(k.startswith("fc_norm.") for k in keys)
    if has_in != nbf:
        raise CheckpointError(f"draft: {where}: norm_before_fc is {nbf} but the weights "
                              f"{'have' if has_in else 'lack'} input_norm.weight")
    if has_fcn != fcn:
        raise CheckpointError(f"draft: {where}: fc_norm is {fcn} but the weights "
                              f"{'have' if has_fcn else 'lack'} fc_norm.* tensors")
    later = _layer_index_keys(keys, "layers.")
    if 0 in later:
        raise CheckpointError(f"draft: {where}: the weights have both a first EAGLE-3 layer (midlayer.*) and "
                              "layers.0.* keys: not one head")
    if later and sorted(later) != list(range(1, max(later) + 1)):
        raise CheckpointError(f"draft: {where}: draft layers {sorted(later)} after the first are not numbered 1..N")
    return HeadOptions(EAGLE3, num_layers=1 + len(later), fc_bias="fc.bias" in keys,
                       norm_before_residual=nbr,
                       norm_before_fc=nbf, fc_norm=fcn, norm_output=out)


class ReferenceEagle1(HeadFormat):
    """SafeAILab EAGLE-1/2 (cnets1.py): fc [H, 2H], layers.N.*, no lm_head/norm; HASS norms optional."""

    name, kind, title = "reference-eagle1", EAGLE1, "SafeAILab EAGLE-1/2 (incl. Qwen2 qkv_bias, HASS, N layers)"

    def detect(self, cfg, keys):
        return ("fc.weight" in keys and any(k.startswith("layers.") for k in keys)
                and "lm_head.weight" not in keys and "norm.weight" not in keys
                and "layers.0.input_layernorm.weight" not in keys and "layers.0.hidden_norm.weight" not in keys)

    def rename(self, key):
        return key

    def options(self, cfg, keys, where):
        layers = _layer_index_keys(keys, "layers.")
        n = len(layers)
        if layers != set(range(n)):
            raise CheckpointError(f"draft: {where}: layers {sorted(layers)} are not numbered 0..N-1")
        declared = cfg.get("num_hidden_layers", 1)
        if declared != n:
            raise CheckpointError(
                f"draft: {where} declares num_hidden_layers={declared} but its weights hold {n} layer(s) "
                f"(layers.0..{n - 1})")
        bias = cfg.get("bias", cfg.get("eagle_fc_bias", True))  # a missing key means True (ea_model.py)
        if not isinstance(bias, bool):
            raise CheckpointError(f"draft: {where} field 'bias' must be true or false, got {bias!r}")
        if bias and "fc.bias" not in keys:
            said = "\"bias\": true" if "bias" in cfg else "no \"bias\" key (which means true, as in the reference)"
            raise CheckpointError(f"draft: {where} has {said} but the weights lack fc.bias")
        if not bias and "fc.bias" in keys:
            raise CheckpointError(f"draft: {where} sets \"bias\": false but the weights have fc.bias")
        qkv = bool(cfg.get("qkv_bias", False))
        has_qkv = "layers.0.self_attn.q_proj.bias" in keys
        if qkv != has_qkv:
            raise CheckpointError(f"draft: {where}: qkv_bias is {qkv} but the weights "
                                  f"{'have' if has_qkv else 'lack'} q/k/v biases")
        return HeadOptions(EAGLE1, num_layers=n, fc_bias=bias, qkv_bias=qkv,
                           embed_norm=HASS_NORMS[0] in keys, hidden_fc_norm=HASS_NORMS[1] in keys,
                           lm_head_norm=HASS_NORMS[2] in keys)


class ReferenceEagle3(HeadFormat):
    """SafeAILab EAGLE-3 (cnets.py): midlayer.*, no eagle_config, the target's architecture string; feature
    layers fixed at 2, L//2, L-3."""

    name, title = "reference-eagle3", "SafeAILab EAGLE-3"

    def detect(self, cfg, keys):
        return any(k.startswith("midlayer.") for k in keys)  # after SpecForge: no eagle_config, the target's arch

    def options(self, cfg, keys, where):
        # num_hidden_layers is ignored by the reference (always exactly one midlayer; yuhuili ships 40).
        return _eagle3_options(cfg, keys, where)


class SpecForgeEagle3(HeadFormat):
    """SpecForge (SGLang) EAGLE-3: reference keys plus eagle_config with output-of-layer ids."""

    name, title = "specforge-eagle3", "SpecForge / SGLang EAGLE-3"
    ids_key = "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids_convention = OUTPUT_OF_LAYER

    def detect(self, cfg, keys):
        # An eagle_config, or SGLang's architecture string with no eagle_config (the lmsys/sglang-EAGLE3-* copies;
        # their default ids name the same tensors as the reference's).
        return any(k.startswith("midlayer.") for k in keys) and (
            isinstance(cfg.get("eagle_config"), dict) or "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []))

    def default_ids(self, n):
        return [1, n // 2 - 1, n - 4]

    def options(self, cfg, keys, where):
        return _eagle3_options(cfg, keys, where)


class SpeculatorsEagle3(HeadFormat):
    """vLLM speculators Eagle3Speculator: speculators_model_type eagle3, transformer_layer_config, layers.N."""

    name, title = "speculators-eagle3", "vLLM speculators Eagle3Speculator"
    ids_key = "eagle_aux_hidden_state_layer_ids"

    def detect(self, cfg, keys):
        # By speculators_model_type, never by the architecture string (section 4); other kinds are refused below.
        return "speculators_model_type" in cfg

    def layer_config(self, cfg, where):
        tlc = cfg.get("transformer_layer_config")
        if not isinstance(tlc, dict):
            raise CheckpointError(f"draft: {where} (speculators) lacks the transformer_layer_config object")
        if tlc.get("model_type", "llama") != "llama":
            # qwen3 layer configs add per-head q/k norms; how vLLM serves them is unconfirmed (section 9).
            raise CheckpointError(f"draft: {where} transformer_layer_config model_type {tlc.get('model_type')!r} "
                                  "is not supported (llama only)")
        out = {k: v for k, v in tlc.items() if k not in ("architectures", "num_hidden_layers")}
        return out

    def rename(self, key):
        if key.startswith("layers.0."):
            return "midlayer." + key[len("layers.0."):]
        return key

    def options(self, cfg, keys, where):
        kind = cfg.get("speculators_model_type")
        if kind != "eagle3":
            raise CheckpointError(
                f"draft: {where} has speculators_model_type {kind!r}, which is not supported (only 'eagle3'; the "
                "legacy EAGLE-1 speculators format was removed from speculators in 2026)")
        check_unsupported_config(cfg.get("transformer_layer_config") or {}, where + " transformer_layer_config")
        # vLLM (the engine that serves this format) defaults norm_before_residual to True when the key is absent.
        return _eagle3_options(cfg, keys, where, nbr_default=True)


class ModelOptEagle3(HeadFormat):
    """NVIDIA ModelOpt export: eagle_config with ModelOpt-only switches; layers.N.* (new) or midlayer[.N].* (old)."""

    name, title = "modelopt-eagle3", "NVIDIA ModelOpt (TensorRT-LLM)"
    ids_key = "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids_convention = OUTPUT_OF_LAYER
    MARKERS = ("use_input_layernorm_in_first_layer", "next_layer_regular", "parallel_draft_step",
               "use_aux_hidden_state", "use_last_layernorm", "use_mtp_layernorm")

    def detect(self, cfg, keys):
        ec = cfg.get("eagle_config")
        if isinstance(ec, dict) and any(m in ec for m in self.MARKERS):
            return True
        # Key style alone (section 7, steps 3-4): multi-layer midlayer.N.*, or layers.0.hidden_norm.
        return any(k.startswith("midlayer.0.") or k == "layers.0.hidden_norm.weight" for k in keys)

    def default_ids(self, n):
        return sorted({1, n // 2 - 1, n - 4})

    def rename(self, key):
        m = re.match(r"(layers|midlayer)\.(\d+)\.(.*)", key)
        if m:
            i, rest = int(m.group(2)), m.group(3)
            if i == 0:
                return "midlayer." + rest
            # Layers after the first: TensorRT-LLM names their pre-norm hidden_norm; canonical input_layernorm.
            return f"layers.{i}." + ("input_layernorm.weight" if rest == "hidden_norm.weight" else rest)
        return key

    def options(self, cfg, keys, where):
        opts = _eagle3_options(cfg, keys, where)
        if opts.norm_before_residual:
            raise CheckpointError(f"draft: {where} sets norm_before_residual, which TensorRT-LLM (the engine "
                                  "serving ModelOpt heads) does not implement; refusing to guess")
        return opts


# Detection order (checkpoint-formats.md section 7): speculators, ModelOpt, then the midlayer layouts, EAGLE-1/2.
FORMATS: tuple[HeadFormat, ...] = (SpeculatorsEagle3(), ModelOptEagle3(), SpecForgeEagle3(), ReferenceEagle3(),
                                   ReferenceEagle1())
BY_NAME = {f.name: f for f in FORMATS}


def detect_format(cfg: dict, keys: set[str], where: str) -> HeadFormat:
    """The one format whose files these are; a clear error naming what was found otherwise."""
    if any(k.startswith("fusion_fc.") for k in keys):
        raise CheckpointError(f"draft: {where} is a legacy speculators EAGLE-1 head (fusion_fc.*): not supported")
    for f in FORMATS:
        if f.detect(cfg, keys):
            return f
    shown = ", ".join(sorted(keys)[:6]) or "no tensors"
    raise CheckpointError(
        f"draft: {where} is not an EAGLE head in a known format (reference EAGLE-1/2 fc + layers.0.*, EAGLE-3 "
        f"midlayer.* / layers.0.hidden_norm with speculators or ModelOpt config); found {shown}"
    )


def to_input_ids(ids: list[int], convention: str) -> list[int]:
    """Feature ids in the manifest's convention: input of decoder layer i (HF hidden_states[i])."""
    return [i + 1 for i in ids] if convention == OUTPUT_OF_LAYER else list(ids)

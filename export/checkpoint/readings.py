"""Heads read as their writers trained them, where the config alone says something else.

A head's config is what its engine reads (SGLang, vLLM, TensorRT-LLM), but three training libraries trained with other
math than the config they saved states (``shared/docs/checkpoint-formats.md`` section 8b):

- **NVIDIA ModelOpt** writes ``rope_scaling`` = its export-time YaRN override (``eagle_export_rope_scaling``, YaRN
  factor 32 over 2048 positions) into a head trained with default rope, and its first layer applies
  ``layers.0.input_layernorm`` to the hidden stream before ``hidden_norm`` (``EagleModule``'s attention pre-hook runs
  after the decoder layer's own input norm).
- **SpecForge 0.2.0** (before its PR 879) reads ``norm_output`` as: true = plain EAGLE-3 (feed g back, logits
  lm_head(norm(g))), false = no final norm before lm_head; SGLang and later SpecForge read it as EAGLE-3.1.
- **eagle-llm 1.2.1** (SafeAILab's PyPI package) builds its rotary embedding with base 10000 whatever ``rope_theta``
  says; the SafeAILab GitHub code honours ``rope_theta``. The files do not say which one trained a head.

``choose_reading`` picks the reading from the files (``--head-reading auto``) or as forced; ``apply_reading``
changes the head description accordingly; ``notice`` is the one line the export prints. ``config`` reads the config as
written (the engines' reading).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.formats import HeadDescription

AUTO, CONFIG = "auto", "config"
MODELOPT, SPECFORGE_020, EAGLE_LLM_121 = "modelopt", "specforge-0.2", "eagle-llm-1.2"
WRITER_READINGS = (MODELOPT, SPECFORGE_020, EAGLE_LLM_121)
READING_CHOICES = (AUTO, CONFIG, *WRITER_READINGS)

# ModelOpt's default eagle_export_rope_scaling (modelopt/torch/speculative/config.py), written only when training used
# rope_type "default".
MODELOPT_EXPORT_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}
# SpecForge 0.2.0 pins transformers 5.8.1, whose save_pretrained stamps the config's transformers_version.
SPECFORGE_020_TRANSFORMERS = "5.8.1"
EAGLE_LLM_ROPE_BASE = 10000.0
# The format each writer reading applies to.
READING_FORMATS = {MODELOPT: ("modelopt-eagle3",), SPECFORGE_020: ("specforge-eagle3", "reference-eagle3"),
                   EAGLE_LLM_121: ("reference-eagle1",)}  # eagle-llm 1.2.1 has EAGLE-1/2 heads only


@dataclass
class Reading:
    """How a head is read: ``name`` (config or a writer reading), who wrote it and where the files say so, and what
    differs from the config as written."""

    name: str
    writer: str = ""
    evidence: str = ""
    changes: list[str] = field(default_factory=list)
    forced: bool = False
    hint: str = ""  # auto, when the files leave the writer open: what to pass for the other one

    def notice(self) -> str | None:
        """The one line printed at export, or None when nothing was assumed."""
        if self.changes:
            how = "--head-reading " + self.name if self.forced else f"{self.evidence}"
            return (f"draft: read as {self.writer} trained it ({how}): {'; '.join(self.changes)}; "
                    f"--head-reading config reads the config as written")
        return self.hint or None


def _rope_scaling(lc: dict) -> dict | None:
    rs = lc.get("rope_scaling")
    if not isinstance(rs, dict):
        rp = lc.get("rope_parameters")
        rs = rp if isinstance(rp, dict) else None
    return rs


def _is_modelopt_override(rs: dict | None) -> bool:
    if not rs:
        return False
    kind = rs.get("rope_type", rs.get("type"))
    return kind == "yarn" and all(float(rs.get(k, -1)) == float(v) for k, v in MODELOPT_EXPORT_ROPE.items()
                                  if k != "rope_type")


def _theta(lc: dict) -> float | None:
    for node in (lc, lc.get("rope_parameters"), lc.get("rope_scaling")):
        if isinstance(node, dict) and node.get("rope_theta") is not None:
            return float(node["rope_theta"])
    return None


def _default_rope(lc: dict, theta: float) -> None:
    """Make the layer config say default rope with base ``theta``."""
    lc.pop("rope_scaling", None)
    lc.pop("rope_parameters", None)
    lc["rope_theta"] = theta


def _modelopt_marker(cfg: dict) -> str:
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    from eagle_export.export.checkpoint.formats import ModelOptEagle3

    found = [m for m in ModelOptEagle3.MARKERS if m in ec]
    return f"eagle_config.{found[0]}" if found else "ModelOpt key names"


def choose_reading(fmt_name: str, cfg: dict, desc: HeadDescription, requested: str = AUTO) -> Reading:
    """The reading of this head: the writer's where the files name it (auto), the config's, or the one forced."""
    if requested not in READING_CHOICES:
        raise CheckpointError(f"--head-reading {requested!r} is not one of {', '.join(READING_CHOICES)}")
    if requested == CONFIG:
        return Reading(CONFIG)
    if requested != AUTO:
        if fmt_name not in READING_FORMATS[requested]:
            raise CheckpointError(f"--head-reading {requested} applies to {' or '.join(READING_FORMATS[requested])} "
                                  f"heads; this head is {fmt_name}")
        return _writer_reading(requested, cfg, desc, forced=True)
    if fmt_name == "modelopt-eagle3":
        return _writer_reading(MODELOPT, cfg, desc)
    if fmt_name == "specforge-eagle3" and "norm_output" in cfg \
            and cfg.get("transformers_version") == SPECFORGE_020_TRANSFORMERS:
        return _writer_reading(SPECFORGE_020, cfg, desc)
    if fmt_name in READING_FORMATS[EAGLE_LLM_121]:
        theta = _theta(desc.layer_config)
        if theta is not None and theta != EAGLE_LLM_ROPE_BASE:
            return Reading(CONFIG, hint=(
                f"draft: the files do not say which program trained this {fmt_name} head: read with its rope_theta "
                f"{theta:g}, as the SafeAILab GitHub code trains; eagle-llm 1.2.1 (PyPI) trains at base 10000 "
                f"whatever the config says: --head-reading {EAGLE_LLM_121} reads it so"))
    return Reading(CONFIG)


def _writer_reading(name: str, cfg: dict, desc: HeadDescription, forced: bool = False) -> Reading:
    lc = desc.layer_config
    if name == MODELOPT:
        r = Reading(name, "NVIDIA ModelOpt", _modelopt_marker(cfg), forced=forced)
        rs = _rope_scaling(lc)
        if _is_modelopt_override(rs):
            theta = _theta(lc) or EAGLE_LLM_ROPE_BASE
            r.changes.append(f"default rope (theta {theta:g}) instead of the config's rope_scaling (ModelOpt's "
                             f"export-time YaRN override, factor {rs.get('factor')}, not used in training)")
        r.changes.append("layers.0.input_layernorm on the hidden stream before hidden_norm")
        return r
    if name == SPECFORGE_020:
        r = Reading(name, "SpecForge 0.2.0", f"transformers_version {cfg.get('transformers_version')}, which "
                    "SpecForge 0.2.0 pins, and a norm_output key", forced=forced)
        if "norm_output" in cfg:
            r.changes.append("norm_output true = plain EAGLE-3 (feeds g back)" if cfg["norm_output"] else
                             "norm_output false = no final norm before lm_head")
        return r
    r = Reading(name, "eagle-llm 1.2.1", "", forced=forced)
    theta = _theta(lc)
    if theta is not None and theta != EAGLE_LLM_ROPE_BASE:
        r.changes.append(f"rope base 10000 instead of the config's rope_theta {theta:g}")
    return r


def apply_reading(reading: Reading, cfg: dict, desc: HeadDescription) -> None:
    """Change the description's layer config (a copy: the checkpoint's config stays as read) and options to the
    reading's math."""
    desc.layer_config = lc = {k: dict(v) if isinstance(v, dict) else v for k, v in desc.layer_config.items()}
    o = desc.options
    if reading.name == MODELOPT:
        if _is_modelopt_override(_rope_scaling(lc)):
            _default_rope(lc, _theta(lc) or EAGLE_LLM_ROPE_BASE)
        o.hidden_input_norm = True
    elif reading.name == SPECFORGE_020 and "norm_output" in cfg:
        o.norm_output = False
        o.final_norm = bool(cfg["norm_output"])
    elif reading.name == EAGLE_LLM_121:
        if lc.get("rope_scaling") is None and not isinstance(lc.get("rope_parameters"), dict):
            _default_rope(lc, EAGLE_LLM_ROPE_BASE)
        else:  # eagle-llm honours linear/dynamic rope_scaling, with base 10000
            for node in (lc, lc.get("rope_parameters"), lc.get("rope_scaling")):
                if isinstance(node, dict) and "rope_theta" in node:
                    node["rope_theta"] = EAGLE_LLM_ROPE_BASE
            lc["rope_theta"] = EAGLE_LLM_ROPE_BASE

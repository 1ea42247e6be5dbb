"""`validate --against-library`: the exported draft graph against the forward of the library that wrote the head.

`validate`'s other checks compare the artifact with our own PyTorch modules, which read the head as export did; a
head whose writer trained other math than its config says passes them. This check runs the writer library's own
modules (when it is installed) on the same inputs as the draft graph:

- step 1, a context pass: n rows (target features, next token) at positions 0..n-1, causal;
- step 2, fed back: n rows, row i = (the head's own step-1 state of row i, a token) at position i+1, seeing context
  rows 0..i and itself (one tree level per context row),

and reports the largest log-probability error over the graph's top-k, the fed-back state's error and the top-1
agreement. The library runs both steps as one sequence of 2n rows with that mask. A library that is not installed,
or whose writer has no adapter here, is skipped with the reason (docs/validate.md#--against-library).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.manifest import Manifest

# The library each head format is written by.
LIBRARY_OF_FORMAT = {"modelopt-eagle3": "nvidia-modelopt", "speculators-eagle3": "speculators",
                     "specforge-eagle3": "specforge", "reference-eagle3": "eagle-llm", "reference-eagle1": "eagle-llm"}
# Largest top-k log-probability error that still counts as the same forward (fp32 artifact; fp16: 5e-2).
LOGP_TOL = {"float32": 1e-3, "float16": 5e-2}


class LibraryUnavailable(Exception):
    """The writer library cannot run here: the message says why (not installed, no adapter)."""


@dataclass
class LibraryCheck:
    """The draft graph against the writer library's forward."""

    library: str
    version: str = ""
    skipped: str | None = None
    rows: int = 0  # rows compared (both steps)
    max_logprob_error: float = float("nan")
    max_state_error: float = float("nan")
    top1_agree: int = 0
    tol: float = 0.0
    state_tol: float = 0.0  # the fed-back state's tolerance: tol relative to its largest element (at least 1)

    @property
    def passed(self) -> bool:
        return self.skipped is not None or (self.max_logprob_error <= self.tol and self.top1_agree == self.rows
                                            and self.max_state_error <= self.state_tol)

    def to_dict(self) -> dict:
        return {"library": self.library, "version": self.version, "skipped": self.skipped, "passed": self.passed,
                "rows": self.rows, "max_logprob_error": self.max_logprob_error,
                "max_state_error": self.max_state_error, "top1_agree": self.top1_agree, "tol": self.tol,
                "state_tol": self.state_tol}

    def format(self) -> str:
        if self.skipped is not None:
            return f"draft graph vs {self.library}: skipped ({self.skipped})"
        verdict = "PASS" if self.passed else "FAIL (the head is not read as its writer trained it)"
        return (f"draft graph vs {self.library} {self.version} forward: {verdict}; steps 1 and 2 (fed back), "
                f"{self.rows} rows: worst top-k log-prob error {self.max_logprob_error:.2e} (tol {self.tol:.0e}), "
                f"fed-back state error {self.max_state_error:.2e} (tol {self.state_tol:.0e}), top-1 agrees on "
                f"{self.top1_agree}/{self.rows}")


class LibraryForward:
    """A writer library's own forward over a sequence of rows.

    ``__call__(features [n, F], fed [m, H], embeds [n+m, H], positions [n+m], mask bool [n+m, n+m])`` returns
    (state fed back [n+m, H], log-probs over the draft vocabulary [n+m, Vd]): rows 0..n-1 read target features,
    rows n.. the head's own fed-back state."""

    library = ""
    version = ""

    def __call__(self, features, fed, embeds, positions, mask):
        raise NotImplementedError


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _additive(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)[None, None]


class ModelOptForward(LibraryForward):
    """nvidia-modelopt's ``EagleModule`` (its HF training module) built from the exported files. ModelOpt's exporter
    writes its ``eagle_export_rope_scaling`` override only over a head trained with default rope, so the module is
    built with the rope it trained with; the state fed back is the pre-norm output, as its training loop does."""

    library = "nvidia-modelopt"

    def __init__(self, draft_dir: Path):
        try:
            from modelopt.torch.speculative.plugins.modeling_eagle import EagleModule
        except ImportError as e:
            raise LibraryUnavailable(f"nvidia-modelopt is not installed ({e}); pip install "
                                     "'eagle-export[writers]'") from None
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from eagle_export.export.checkpoint.loaders import read_draft_checkpoint
        from eagle_export.export.checkpoint.readings import _is_modelopt_override, _theta

        self.version = _version("nvidia-modelopt")
        ckpt = read_draft_checkpoint(draft_dir)
        cfg = dict(ckpt.config)
        arch = {k: v for k, v in cfg.items() if k not in ("eagle_config", "architectures", "transformers_version",
                                                          "torch_dtype", "dtype")}
        arch.update(cfg.get("eagle_config") or {})
        if _is_modelopt_override(arch.get("rope_scaling")):
            theta = _theta(arch) or 10000.0
            arch["rope_scaling"] = {"rope_type": "default", "rope_theta": theta}
            arch["rope_theta"] = theta
        arch["has_lm_head"] = True
        config = LlamaConfig(**arch)
        config.eagle_decoder_type = "llama"
        config._attn_implementation = "eager"
        self.module = EagleModule(config, LlamaDecoderLayer)
        weights = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.weights.items()}
        if "midlayer." in "".join(weights):  # exports before 2026-03 used the reference's names
            weights = {k.replace("midlayer.", "layers.0.") if not k.startswith("midlayer.0.") else
                       k.replace("midlayer.", "layers."): v for k, v in weights.items()}
        missing, unexpected = self.module.load_state_dict(weights, strict=False)
        if [k for k in missing if not k.startswith("rotary_emb")] or unexpected:
            raise LibraryUnavailable(f"nvidia-modelopt's EagleModule does not take these files: missing {missing}, "
                                     f"unexpected {unexpected}")
        self.module.float().eval()
        try:
            self.module._maybe_init_rope()
        except TypeError:  # it passes device=, which transformers 5.23's LlamaRotaryEmbedding no longer takes
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            self.module.rotary_emb = LlamaRotaryEmbedding(config=self.module.config)

    @torch.no_grad()
    def __call__(self, features, fed, embeds, positions, mask):
        z = torch.cat((self.module.fc(features), fed))
        post, pre, _ = self.module(z[None], embeds[None], attention_mask=_additive(mask),
                                   position_ids=positions[None])
        logp = torch.log_softmax(self.module.lm_head(post[0]).float(), -1)
        return pre[0], logp


class SpecForgeForward(LibraryForward):
    """specforge's ``LlamaForCausalLMEagle3`` built from the files: ``project_hidden_states`` (fc), ``backbone``
    (the midlayer), ``compute_logits``; the state fed back is the backbone's output, as its training loop does.
    specforge 0.2.0 pins torch 2.11 and sglang: it runs here only when installed without them
    (``pip install --no-deps specforge==0.2.0``)."""

    library = "specforge"

    def __init__(self, draft_dir: Path):
        try:
            from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        except ImportError as e:
            raise LibraryUnavailable(f"specforge is not installed ({e}); it pins torch 2.11.0, transformers 5.8.1 and "
                                     "sglang: `pip install --no-deps specforge==0.2.0` runs its modules here") from None
        from transformers import LlamaConfig

        from eagle_export.export.checkpoint.loaders import read_draft_checkpoint

        self.version = _version("specforge")
        ckpt = read_draft_checkpoint(draft_dir)
        skip = ("architectures", "eagle_config", "transformers_version")
        cfg = {k: v for k, v in ckpt.config.items() if k not in skip}
        self.model = LlamaForCausalLMEagle3(LlamaConfig(**cfg))
        missing, unexpected = self.model.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in ckpt.weights.items()}, strict=False)
        if [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")] or unexpected:
            raise LibraryUnavailable(f"specforge's LlamaForCausalLMEagle3 does not take these files: missing "
                                     f"{missing}, unexpected {unexpected}")
        self.model.float().eval()

    @torch.no_grad()
    def __call__(self, features, fed, embeds, positions, mask):
        z = torch.cat((self.model.project_hidden_states(features), fed))
        g = self.model.backbone(input_embeds=embeds[None], hidden_states=z[None], cache_hidden=None,
                                attention_mask=_additive(mask), position_ids=positions[None], use_cache=False)
        return g[0], torch.log_softmax(self.model.compute_logits(g)[0].float(), -1)


class EagleLlmForward(LibraryForward):
    """eagle-llm's (SafeAILab's PyPI package) EAGLE-1/2 ``cnets.Model`` built from the files, run by its parts (its own
    ``forward`` builds a causal mask itself): ``fc`` over [embedding; feature or fed-back state], its decoder layers,
    then the target's ``lm_head``; the state fed back is the last layer's output. eagle-llm 1.2.1 pins accelerate 0.21,
    pydantic 1 and gradio 3: it runs here only when installed without them (``pip install --no-deps
    eagle-llm==1.2.1``)."""

    library = "eagle-llm"

    def __init__(self, draft_dir: Path, target_dir: Path):
        try:
            from eagle.model.cnets import Model
            from eagle.model.configs import EConfig
        except ImportError as e:
            raise LibraryUnavailable(f"eagle-llm is not installed ({e}); it pins accelerate 0.21, pydantic 1 and "
                                     "gradio 3: `pip install --no-deps eagle-llm==1.2.1` runs its modules "
                                     "here") from None
        from safetensors.torch import load_file

        from eagle_export.export.checkpoint.loaders import read_draft_checkpoint

        self.version = _version("eagle-llm")
        ckpt = read_draft_checkpoint(draft_dir)
        cfg = dict(ckpt.config)
        if cfg.get("num_hidden_layers", 1) != 1 or any(k.endswith("layernorm.weight") and "layers." not in k
                                                        for k in ckpt.weights):
            raise LibraryUnavailable("eagle-llm 1.2.1 writes one-layer heads without HASS norms; this head is not one")
        config = EConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        rs = getattr(config, "rope_scaling", None)
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) in (None, "default"):
            config.rope_scaling = None  # transformers 5 fills in a default; eagle-llm expects None (transformers 4)
        self.model = Model(config, bias=bool(cfg.get("bias", True)))
        missing, unexpected = self.model.load_state_dict(
            {k: v.float() for k, v in ckpt.weights.items()}, strict=False)
        if [k for k in missing if not k.startswith("embed_tokens")] or unexpected:
            raise LibraryUnavailable(f"eagle-llm's Model does not take these files: missing {missing}, unexpected "
                                     f"{unexpected}")
        self.model.float().eval()
        tw = {}
        for f in sorted(Path(target_dir).glob("*.safetensors")):
            tw.update(load_file(str(f)))
        self.lm_head = tw.get("lm_head.weight", tw.get("model.embed_tokens.weight")).float()

    @torch.no_grad()
    def __call__(self, features, fed, embeds, positions, mask):
        x = self.model.fc(torch.cat((embeds, torch.cat((features, fed))), -1))[None]
        for layer in self.model.layers:
            x = layer(x, attention_mask=_additive(mask), position_ids=positions[None])[0]
        return x[0], torch.log_softmax(x[0] @ self.lm_head.T, -1)


ADAPTERS = {"nvidia-modelopt": ModelOptForward, "specforge": SpecForgeForward, "eagle-llm": EagleLlmForward}


def library_forward(fmt: str, draft_dir: Path, target_dir: Path) -> LibraryForward:
    """The forward of the library that writes heads of format ``fmt``; LibraryUnavailable says why not."""
    lib = LIBRARY_OF_FORMAT.get(fmt)
    if lib is None:
        raise LibraryUnavailable(f"no writer library is known for head format {fmt!r}")
    adapter = ADAPTERS.get(lib)
    if adapter is None:
        raise LibraryUnavailable(f"{lib} cannot be installed beside this package (its pinned torch/transformers "
                                 "differ from ours) and has no adapter here; docs/validate.md#--against-library")
    if adapter is EagleLlmForward:
        if fmt != "reference-eagle1":
            raise LibraryUnavailable("eagle-llm 1.2.1 has EAGLE-1/2 heads only (its EAGLE-3 code is not on PyPI)")
        return adapter(draft_dir, target_dir)
    return adapter(draft_dir)


def compare_with_library(directory: Path, m: Manifest, fwd: LibraryForward, table, draft_to_target=None,
                         rows: int = 12, seed: int = 0) -> LibraryCheck:
    """Run the artifact's draft graph (ONNX Runtime) for steps 1 and 2 and ``fwd`` on the same inputs.

    table: the artifact's token-embedding rows (``runtime.embedding.TokenEmbedding``), fed to both.
    draft_to_target: the head's absolute target id of each draft id (None: the identity)."""
    import onnxruntime as ort

    d, n = m.draft, min(rows, max(2, m.max_seq_len // 2))
    rng = np.random.default_rng(seed)
    sess = ort.InferenceSession(str(directory / m.graphs[C.DRAFT_GRAPH].file), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    dt = np.float16 if m.dtype == "float16" else np.float32
    ids = rng.integers(0, m.target.vocab_size, (1, 2 * n))
    emb = table.rows(ids).float().numpy()
    feats = rng.standard_normal((1, n, d.feature_dim)).astype(np.float32)
    mask = np.zeros((2 * n, 2 * n), dtype=bool)
    mask[:n, :n] = np.tri(n, dtype=bool)
    mask[n:, :n] = np.tri(n, dtype=bool)
    mask[n:, n:] = np.eye(n, dtype=bool)
    pos = np.concatenate([np.arange(n), np.arange(1, n + 1)])

    def run(e, f, h, p, msk, past):
        feed = OrderedDict(zip(names, [e.astype(dt), f.astype(dt), h.astype(dt), p[None].astype(np.int64), msk[None],
                                       *past], strict=True))
        return sess.run(None, feed)

    empty = [np.zeros((1, 0, d.kv_heads, d.head_dim), dt)] * (2 * d.num_layers)
    v1, i1, h1, *present = run(emb[:, :n], feats, np.zeros((1, 0, d.hidden_size)), pos[:n], mask[:n, :n], empty)
    v2, i2, h2, *_ = run(emb[:, n:], feats[:, :0], h1.astype(np.float32), pos[n:], mask[n:], present)
    with torch.no_grad():  # the library's step 2 is fed its own step-1 states
        f0, e0, p0, m0 = (torch.from_numpy(x) for x in (feats[0], emb[0], pos, mask))
        own, _ = fwd(f0, f0.new_zeros((0, d.hidden_size)), e0[:n], p0[:n], m0[:n, :n])
        state, logp = fwd(f0, own.float(), e0, p0, m0)
    vals = np.concatenate([v1[0], v2[0]]).astype(np.float64)
    tids = np.concatenate([i1[0], i2[0]])
    hidden = np.concatenate([h1[0], h2[0]]).astype(np.float64)
    k = vals.shape[-1]
    state = state.double().numpy()
    want_vals, want_ids = torch.topk(logp.double(), k, -1)
    want_top1 = want_ids[:, 0].numpy()
    if draft_to_target is not None:
        want_top1 = np.asarray(draft_to_target)[want_top1]
    return LibraryCheck(
        fwd.library, fwd.version, rows=2 * n, tol=LOGP_TOL[m.dtype],
        max_logprob_error=float(np.abs(vals - want_vals.numpy()).max()),
        max_state_error=float(np.abs(hidden - state).max()),
        state_tol=LOGP_TOL[m.dtype] * max(1.0, float(np.abs(state).max())),
        top1_agree=int((tids[:, 0] == want_top1).sum()))


def check_against_library(directory: Path, m: Manifest, draft_dir: Path, table, draft_to_target=None,
                          seed: int = 0, fwd: LibraryForward | None = None,
                          target_dir: Path | None = None) -> LibraryCheck:
    """The whole check: the writer library's forward (or ``fwd``), or a skip with the reason."""
    lib = LIBRARY_OF_FORMAT.get(m.draft.format, m.draft.format)
    if fwd is None:
        try:
            fwd = library_forward(m.draft.format, Path(draft_dir), Path(target_dir or m.target.source))
        except LibraryUnavailable as e:
            return LibraryCheck(lib, skipped=str(e))
    return compare_with_library(directory, m, fwd, table, draft_to_target, seed=seed)


"""`validate` on a quantized artifact (`export --quantize`): what changes, and the drift report.

- **Parity** is checked against a PyTorch model holding the dequantized weights ``W' = (q - zp) * scale``, rebuilt
  here from the float checkpoint with the exporter's own quantizer (``export/quantization/matmuls.py``), so a graph
  whose stored codes or scales are wrong fails. ONNX Runtime's fast int4 kernel (accuracy level 4) quantizes activations
  to int8, which is not exact against ``W'``; the parity checks therefore run on a *parity copy* of the artifact
  (its files hard-linked, each MatMulNBits and the manifest's level set to ``PARITY_LEVEL``, float compute), with
  the same tolerances as a float artifact.
- **Lossless at the artifact's own settings**: EAGLE tokens equal the same artifact's ``--no-draft`` tokens.
- **Drift** against the unquantized model: over each prompt and its greedy continuation, the artifact's next-token
  distribution (its standard graph, at its own accuracy level) against the float PyTorch model's: top-1 agreement
  and mean KL(float || quantized). Reported, not judged.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.errors import EagleExportError
from eagle_export.manifest import MANIFEST_NAME, Manifest, QuantizationInfo

PARITY_LEVEL = 1  # MatMulNBits' float-compute level (0 and 1 are the same kernel: tools/lab/results.md)


@dataclass
class QuantReport:
    settings: dict  # the manifest's quantization record
    parity_level: int = PARITY_LEVEL
    lossless_prompts: int = 0
    lossless_tokens: int = 0
    lossless_failures: list[str] = field(default_factory=list)
    divergences: list[dict] = field(default_factory=list)  # per failure: prompt index and bench.Divergence.to_dict()
    # The fused graph's one-row call against row 0 of wider calls over the same cache (``check_one_row``): the max
    # |logit difference| (0.0: bit for bit, so plain decoding computes its rows as a verify does), None: not run.
    one_row_diff: float | None = None
    positions: int = 0
    top1_agreement: float = float("nan")
    mean_kl: float = float("nan")

    @property
    def passed(self) -> bool:
        return not self.lossless_failures

    def to_dict(self) -> dict:
        return {"passed": self.passed, "settings": self.settings, "parity_accuracy_level": self.parity_level,
                "lossless_vs_no_draft": {"prompts": self.lossless_prompts, "tokens": self.lossless_tokens,
                                         "failures": self.lossless_failures, "divergences": self.divergences},
                "drift_vs_unquantized": {"positions": self.positions, "top1_agreement": self.top1_agreement,
                                         "mean_kl": self.mean_kl},
                "one_row_call_max_logit_diff": self.one_row_diff}

    def format(self) -> list[str]:
        s = self.settings
        ok = "PASS" if self.passed else "FAIL"
        which = ("the draft alone" if not s.get("target", True) else
                 ", ".join(["the target"] + ["its lm_head"] * bool(s["lm_head"]) + ["the draft"] * bool(s["draft"])))
        lines = [f"quantization {s['method']} ({which}; block {s['block_size']}, "
                 f"{'symmetric' if s['symmetric'] else 'asymmetric'}, accuracy level {s['accuracy_level']}"
                 f"): graphs compared with the dequantized "
                 f"weights at accuracy level {self.parity_level}",
                 f"  lossless at the artifact's settings (EAGLE == --no-draft): {ok} ({self.lossless_prompts} "
                 f"prompts, {self.lossless_tokens} tokens)"]
        lines += [f"    {f}" for f in self.lossless_failures[:5]]
        if self.one_row_diff is not None:
            same = self.one_row_diff == 0.0
            lines.append("  a one-row call computes its row as a verify does (fused graph, bit for bit): "
                         + ("yes" if same else f"NO (logits up to {self.one_row_diff:.3g} apart: this CPU's kernels "
                                               "compute one row otherwise at these settings, so EAGLE can differ "
                                               "from --no-draft at near-ties; tools/lab/results.md)"))
        if self.positions:
            lines.append(f"  drift vs the unquantized model over {self.positions} positions: top-1 agreement "
                         f"{self.top1_agreement:.4f}, mean KL {self.mean_kl:.3g} nats")
        return lines


def parity_copy(directory: Path, out: Path) -> Path:
    """``out``: the artifact's files hard-linked (copied across file systems), its MatMulNBits nodes and manifest at
    ``PARITY_LEVEL``; the graphs' weights are the same bytes."""
    import onnx

    out.mkdir(parents=True, exist_ok=True)
    for f in directory.iterdir():
        if f.is_file() and f.name != MANIFEST_NAME and not f.name.endswith(".onnx"):
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copy2(f, out / f.name)
    for f in directory.glob("*.onnx"):
        model = onnx.load(str(f), load_external_data=False)
        for node in model.graph.node:
            if node.op_type == "MatMulNBits":
                for a in node.attribute:
                    if a.name == "accuracy_level":
                        a.i = PARITY_LEVEL
        onnx.save_model(model, str(out / f.name))
    raw = json.loads((directory / MANIFEST_NAME).read_text())
    raw["quantization"]["accuracy_level"] = PARITY_LEVEL
    (out / MANIFEST_NAME).write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    seen, out = set(), []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


@torch.no_grad()
def dequantize_reference(lm: torch.nn.Module, head: torch.nn.Module, q: QuantizationInfo, dtype: str) -> None:
    """Give the PyTorch reference, in place, the weights the artifact's graphs hold: each nn.Linear the export
    quantized gets ``W'`` of its weight at the artifact's dtype (with ``q.target`` the decoder layers' projections,
    and with ``q.lm_head`` the target's lm_head; with ``q.draft`` the draft head's, its lm_head included). A tied
    lm_head is untied (the embedding stays float, as in the artifact); an EAGLE-1/2 head, which reads the target's
    lm_head, gets its own copy of it when one side quantizes it and the other does not. Raises when the count differs
    from the manifest's (a model this rebuild does not cover)."""
    from eagle_export.dtypes import DTYPES
    from eagle_export.export.quantization.matmuls import quantize_weight

    np_dtype = DTYPES[dtype].numpy
    done: dict[int, torch.Tensor] = {}

    def deq(linear: torch.nn.Linear) -> None:
        w = linear.weight
        if id(linear) not in done:
            k_n = w.detach().float().numpy().T.astype(np_dtype)
            done[id(linear)] = torch.from_numpy(
                np.ascontiguousarray(quantize_weight(k_n, q.bits, q.block_size, q.symmetric).dequantized.T))
        linear.weight = torch.nn.Parameter(done[id(linear)].to(w.dtype), requires_grad=False)

    target_lm_head = q.target and q.lm_head
    if target_lm_head != q.draft and getattr(head, "lm_head", None) is lm.lm_head:
        head.lm_head = copy.deepcopy(lm.lm_head)  # one side quantized, the other float
    target = [lin for layer in lm.model.layers for lin in _linears(layer)] if q.target else []
    if target_lm_head:
        target.append(lm.lm_head)
    want = q.matmuls.get(C.TARGET_GRAPH)
    if want is not None and len(target) != want:
        raise EagleExportError(f"validate: the artifact quantized {want} MatMuls of {C.TARGET_GRAPH} but the "
                               f"reference has {len(target)} projections to dequantize: cannot build its reference")
    draft = _linears(head) if q.draft else []
    want = q.matmuls.get(C.DRAFT_GRAPH)
    if q.draft and want is not None and len(draft) != want:
        raise EagleExportError(f"validate: the artifact quantized {want} MatMuls of {C.DRAFT_GRAPH} but the head has "
                               f"{len(draft)} linear layers: cannot build its reference")
    for lin in target + draft:
        deq(lin)


def check_lossless(rt, prompts: list[list[int]], max_new: int, report: QuantReport) -> list[list[int]]:
    """EAGLE == --no-draft on the artifact as the runtime runs it; returns the --no-draft continuations."""
    from eagle_export.tools.commands.bench import find_divergence

    conts = []
    for i, p in enumerate(prompts):
        eagle = rt.generate(prompt_ids=p, max_new_tokens=max_new, stop_on_eos=False)
        plain = rt.generate(prompt_ids=p, max_new_tokens=max_new, use_draft=False, stop_on_eos=False)
        report.lossless_prompts += 1
        report.lossless_tokens += len(plain.tokens)
        d = find_divergence(rt, list(p), eagle.tokens, plain.tokens)
        if d is not None:
            report.lossless_failures.append(f"prompt {i} {list(p)[:8]}...: EAGLE differs from --no-draft "
                                            f"{d.describe()}")
            report.divergences.append({"prompt": i, **d.to_dict()})
        conts.append(plain.tokens)
    return conts


def check_one_row(directory: Path, m: Manifest, threads: int | None, report: QuantReport, past: int = 37) -> None:
    """The fused target graph's one-row call over ``past`` cached rows against row 0 of 2-, 5- and 13-row calls over
    the same rows: ``report.one_row_diff``, the largest logit difference (0.0 where the kernels at the artifact's
    settings compute a row alike whatever the call's width, as plain decoding needs to equal EAGLE). Skipped (None)
    without a fused graph."""
    from .graphs import FusedAsStandard

    if C.TARGET_FUSED_GRAPH not in m.graphs:
        return
    t = m.target
    run = FusedAsStandard(directory / m.graphs[C.TARGET_FUSED_GRAPH].file, m, threads)
    dt = np.dtype(m.dtype)
    ids = np.random.default_rng(0).integers(0, t.vocab_size, past + 13)

    def call(start: int, n: int, cache: list[np.ndarray]) -> dict:
        mask = np.concatenate([np.ones((n, start), bool), np.tri(n, dtype=bool)], 1)
        feed = {C.INPUT_IDS: ids[None, start:start + n], C.ATTENTION_MASK: mask[None],
                C.POSITION_IDS: np.arange(start, start + n, dtype=np.int64)[None],
                C.LOGIT_INDICES: np.arange(n, dtype=np.int64)[None]}
        feed.update(zip(C.past_names(t.num_layers), cache, strict=True))
        return run(feed)[0]

    pre = call(0, past, [np.zeros((1, 0, t.kv_heads, t.head_dim), dt)] * (2 * t.num_layers))
    cache = [pre[n] for n in C.present_names(t.num_layers)]
    one = call(past, 1, cache)[C.LOGITS][0, 0]
    report.one_row_diff = max(float(np.abs(call(past, n, cache)[C.LOGITS][0, 0] - one).max()) for n in (2, 5, 13))


@torch.no_grad()
def measure_drift(directory: Path, m: Manifest, float_lm: torch.nn.Module, sequences: list[list[int]],
                  threads: int | None, report: QuantReport) -> None:
    """Top-1 agreement and mean KL(float || artifact) of the next-token distributions over every position of
    ``sequences``; the artifact's from its standard graph with the runtime's session settings."""
    import onnxruntime as ort

    from eagle_export.runtime.ort_backend import quantized_session_config, session_options

    sess = ort.InferenceSession(str(directory / m.graphs[C.TARGET_GRAPH].file),
                                sess_options=session_options(threads, config=quantized_session_config(m)),
                                providers=["CPUExecutionProvider"])
    t = m.target
    dt = np.dtype(m.dtype)
    agree, kl, n = 0, 0.0, 0
    for seq in sequences:
        T = len(seq)
        feed = {C.INPUT_IDS: np.array([seq], np.int64), C.POSITION_IDS: np.arange(T, dtype=np.int64)[None],
                C.ATTENTION_MASK: np.tril(np.ones((T, T), bool))[None],
                C.LOGIT_INDICES: np.arange(T, dtype=np.int64)[None]}
        for name in C.past_names(t.num_layers):
            feed[name] = np.zeros((1, 0, t.kv_heads, t.head_dim), dt)
        got = torch.from_numpy(sess.run([C.LOGITS], feed)[0][0]).float().log_softmax(-1)
        want = float_lm(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        kl += float((want.exp() * (want - got)).sum(-1).sum())
        n += T
    report.positions = n
    if n:
        report.top1_agreement, report.mean_kl = agree / n, kl / n

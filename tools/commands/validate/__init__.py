"""`eagle-export validate`: prove an artifact behaves like the PyTorch model, or find where it does not.

Three checks, each against the original checkpoints named in the manifest (``target.source``,
``draft.source``), loaded in float32:

1. **Graphs.** Every output of both graphs, on inputs that cover prefill (cache 0 and a later
   chunk), tree verification with random trees (cache 0, mid, and near capacity), plain decode,
   and draft context passes and tree levels (cache 0 and near capacity), run by Polygraphy's
   ``Comparator`` with an ``OnnxrtRunner`` over the artifact's graphs and a PyTorch runner over
   the traced modules (``TargetVerify``, ``DraftStep``), compared with ``CompareFunc.simple`` at
   a tolerance per dtype and per output. When a graph is out of tolerance, both runners run
   again on the failing input with the residual stream of every decoder layer marked as an
   output (after attention and after the MLP), and the first layer out of tolerance is named.
2. **Greedy tokens** of the runtime (EAGLE and ``--no-draft``) versus transformers' greedy
   ``generate`` on random prompts.
3. **EAGLE rounds** versus the PyTorch oracle (``runtime/oracle.py``): same tree, same accepted
   lengths, same tokens, round by round.

EAGLE-1/2 and EAGLE-3 artifacts alike: for EAGLE-3 the target's features are the inputs of the
manifest's ``target.feature_layers``, the draft's probes are the head's own parts (fc, norms,
``midlayer`` attention and MLP), and the oracle runs the EAGLE-3 head.

See docs/validate.md for tolerances and how layers are located."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.errors import EagleExportError, ManifestError
from eagle_export.manifest import Manifest, load_manifest, read_draft_vocab

from .cases import TIE_FACTOR, TIE_FLOOR, draft_cases, target_cases, tree_cases
from .graphs import check_embedding, check_fused_graph, check_graph, make_runner_class
from .quant import QuantReport
from .report import TokenReport, ValidationReport
from .tokens import end_to_end

BACKENDS = ("ort", "tensorrt")


def _check_sources(m: Manifest, target, draft) -> None:
    """The checkpoints must be the ones the artifact was exported from (same dimensions, same kind of head)."""
    if draft.variant != m.variant:
        raise ManifestError(f"the checkpoints are not the ones this artifact was exported from: the artifact has an "
                            f"{m.variant} head but the draft checkpoint is an {draft.variant} head")
    head, cfg = draft.head, draft.config
    c = target.config
    heads = c.num_attention_heads
    got = {"target.num_layers": c.num_hidden_layers, "target.hidden_size": c.hidden_size,
           "target.num_heads": heads, "target.kv_heads": c.num_key_value_heads or heads,
           "target.head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
           "target.vocab_size": c.vocab_size,
           "draft.hidden_size": cfg.hidden_size, "draft.kv_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
           "draft.head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
           "draft.fc_bias": head.fc.bias is not None,
           "draft.feature_dim": draft.feature_dim, "draft.vocab_size": draft.vocab_size}
    bad = []
    for key, value in got.items():
        part, attr = key.split(".")
        want = getattr(getattr(m, part), attr)
        if want != value:
            bad.append(f"{key} is {want} in the manifest but {value} in the checkpoint")
    if bad:
        raise ManifestError("the checkpoints are not the ones this artifact was exported from: " + "; ".join(bad))


def validate(artifact: str | Path, backend: str = "ort", prompts: int = 8, max_new_tokens: int = 32,
             target: str | Path | None = None, draft: str | Path | None = None, seed: int = 0,
             threads: int | None = None, log=None, prompt_specs=None, against_library: bool = False
             ) -> ValidationReport:
    """Run every check; user errors raise EagleExportError, a failed check is ``report.passed == False``.

    prompt_specs: the end-to-end checks' prompts (``eagle_export.prompts.PromptSpec``s, e.g. from a prompts
    file; text and messages through the artifact's tokenizer) instead of ``prompts`` random ones.

    threads: intra-op threads for PyTorch and the runtime's ONNX Runtime sessions (None: their
    defaults). Tiny models run fastest with 1: their forwards are too small to split.

    against_library: also compare the draft graph with the forward of the library that wrote the head
    (``against_library.py``; skipped with the reason when it is not installed).
    """
    if threads is not None and threads < 1:
        raise EagleExportError(f"--threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="eagle-validate-parity-") as scratch:
            return _validate(artifact, backend, prompts, max_new_tokens, target, draft, seed, threads, log,
                             prompt_specs, Path(scratch), against_library)
    finally:
        torch.set_num_threads(before)


def _validate(artifact, backend, prompts, max_new_tokens, target, draft, seed, threads, log,
              prompt_specs=None, scratch: Path | None = None, against_library: bool = False) -> ValidationReport:
    from eagle_export.errors import CheckpointError
    from eagle_export.export.checkpoint.loaders import (
        detect_variant,
        load_draft_head,
        load_target,
        read_draft_checkpoint,
    )
    from eagle_export.export.graphs.draft_tree import DraftTree
    from eagle_export.export.graphs.heads import DraftStep
    from eagle_export.export.graphs.target import TargetVerify
    from eagle_export.prompts import PromptFileError, prompt_ids
    from eagle_export.runtime import EagleRuntime
    from eagle_export.runtime.oracle import EagleOracle

    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    directory = Path(artifact)
    if backend not in BACKENDS:
        raise EagleExportError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if prompts < 0 or max_new_tokens < 1:
        raise EagleExportError(f"--prompts must be >= 0 and --max-new-tokens >= 1, got {prompts}, {max_new_tokens}")
    m = load_manifest(directory)
    if backend == "tensorrt":
        raise EagleExportError(
            f"{directory}: validate --backend tensorrt is not implemented yet (engines from `eagle-export build` "
            "need a CUDA GPU to run): validate the ONNX graphs with --backend ort")
    # Opening the runtime checks every graph file loads, before any long work.
    rt = EagleRuntime.open(directory, backend="ort", threads=threads)
    given = None if prompt_specs is None else [prompt_ids(rt, s) for s in prompt_specs]  # bad lines fail here
    for spec, ids in zip(prompt_specs or (), given or (), strict=True):
        if len(ids) >= m.max_seq_len:  # the end-to-end checks compare generated tokens: at least one must fit
            raise PromptFileError(f"{spec.source}: the prompt has {len(ids)} tokens, and validate needs room to "
                                  f"generate: at most {m.max_seq_len - 1} (the artifact's capacity, --max-seq-len, is "
                                  f"{m.max_seq_len})")
    sources = {}
    for part, override in (("target", target), ("draft", draft)):
        src = Path(override) if override is not None else Path(getattr(m, part).source)
        if not src.is_dir():
            how = f"--{part} {src}" if override is not None else f"the manifest's {part}.source ({src})"
            raise ManifestError(f"{how} is not a directory: validate needs the original {part} checkpoint "
                                f"(pass --{part} PATH if it moved)")
        sources[part] = src
    log("loading the PyTorch reference")
    tgt = load_target(sources["target"], dtype=torch.float32, progress=False)
    eagle3 = m.variant == "eagle3"
    try:
        d = load_draft_head(sources["draft"], tgt, m.target.feature_layers if eagle3 else None, m.draft.reading)
    except CheckpointError:
        # An EAGLE-1/2 checkpoint given for an EAGLE-3 artifact fails on feature_layers: say what is wrong.
        if eagle3 and detect_variant(read_draft_checkpoint(sources["draft"])) != "eagle3":
            raise ManifestError(f"the checkpoints are not the ones this artifact was exported from: the artifact has "
                                f"an eagle3 head but {sources['draft']} is an EAGLE-1/2 head") from None
        raise
    if m.draft_vocab is not None:  # export --draft-vocab: the reference head keeps the artifact's tokens
        from eagle_export.export.graphs.heads import prune_vocab

        if against_library:
            raise EagleExportError(f"{directory}: --against-library compares the head's whole vocabulary with its "
                                   "writer's; this artifact was exported with --draft-vocab")
        prune_vocab(d.head, torch.tensor(read_draft_vocab(directory, m)))
        d = dataclasses.replace(d, vocab_size=m.draft_vocab.size, d2t_identity=False)
    if against_library and m.quantization is not None and m.quantization.draft:
        raise EagleExportError(f"{directory}: --against-library compares the draft graph with its writer's float "
                               "forward; this artifact's draft is quantized (export --quantize without "
                               "--quantize-float-draft, or --quantize-draft-only): export a float draft to compare")
    _check_sources(m, tgt, d)
    head = d.head
    quant = own_rt = float_lm = None
    if m.quantization is not None:
        # Parity against the dequantized weights, on a copy of the artifact at float-compute accuracy
        # (tools/commands/validate/quant.py); the artifact as it is runs the lossless check and the drift report.
        import copy

        from .quant import dequantize_reference, parity_copy

        log(f"quantized artifact ({m.quantization.method}): comparing with the dequantized weights")
        quant = QuantReport(m.quantization.to_dict())
        float_lm = copy.deepcopy(tgt.model)
        dequantize_reference(tgt.model, head, m.quantization, m.dtype)
        own_rt, own_dir = rt, directory
        directory = parity_copy(directory, scratch / "parity")
        m = load_manifest(directory)
        rt = EagleRuntime.open(directory, backend="ort", threads=threads)
    runner_cls = make_runner_class()
    rng = np.random.default_rng(seed)
    graphs = {}
    log("comparing target_verify")
    tv = TargetVerify(tgt.model, d.feature_layers).eval()
    log("comparing the draft's embedding table")
    embedding = check_embedding(rt.generator.embedding, head.embed_tokens.weight)
    graphs[C.TARGET_GRAPH] = check_graph(directory, m, C.TARGET_GRAPH, tv, target_cases(m, rng), tv.layers,
                                         runner_cls, embed=tv.embed_tokens)
    if C.TARGET_FUSED_GRAPH in m.graphs:
        log("comparing target_verify_fused")
        # A call over an empty cache is a prefill for this graph (contract 4: GroupQueryAttention takes it as a first
        # prompt, causal, positions from 0), as it always is in the runtime: the other cache-0 cases do not apply.
        cases = [(c, f) for c, f in target_cases(m, rng) if f[C.past_key(0)].shape[1] or c.startswith("prefill")]
        graphs[C.TARGET_FUSED_GRAPH] = check_fused_graph(directory, m, tv, cases, threads)
    log("comparing draft_step")
    ds = DraftStep(head, m.tree_limits.max_top_k).eval()
    graphs[C.DRAFT_GRAPH] = check_graph(
        directory, m, C.DRAFT_GRAPH, ds, draft_cases(m, rng, rt.generator.embedding),
        None if eagle3 else head.layers, runner_cls, fc=head.fc,
        full_logprobs=lambda hidden: _target_logprobs(head, hidden, m), head3=head if eagle3 else None)
    for k, (name, most) in C.tree_graphs(m.graphs).items():
        # Each top_k's graph as the runtime runs it for the default tree's depth: cut to it (runtime/tree_graph.py).
        depth = max(1, min(m.tree_defaults.depth, most))
        log(f"comparing {name} cut to depth {depth}")
        dt = DraftTree(head, m.tree_limits.max_top_k, k, depth, plain=m.quantization is not None).eval()
        cut_model = None
        if depth < most:
            import onnx

            from eagle_export.runtime.tree_graph import cut

            proto = onnx.load(str(directory / m.graphs[name].file), load_external_data=False)
            cut_model = cut(proto, k, depth, most).SerializeToString()
        graphs[name] = check_graph(directory, m, name, dt,
                                   # its own random source: the prompts below stay the seed's
                                   tree_cases(m, np.random.default_rng(seed + 1), rt.generator.embedding, name),
                                   None, runner_cls, model=cut_model)
    library = None
    if against_library:
        from .against_library import check_against_library

        log("comparing draft_step with the forward of the library that wrote the head")
        dtt = getattr(head, "draft_to_target", None)
        library = check_against_library(directory, m, sources["draft"], rt.generator.embedding,
                                        None if dtt is None else dtt.numpy(), seed, target_dir=sources["target"])
    # Capped at the tolerance: a broken graph's large errors must not turn every difference into a tie.
    deciding = (graphs[C.TARGET_GRAPH].outputs[C.LOGITS], graphs[C.DRAFT_GRAPH].outputs[C.TOPK_LOGPROBS],
                *([graphs[C.TARGET_FUSED_GRAPH].outputs[C.LOGITS]] if C.TARGET_FUSED_GRAPH in graphs else []))
    tie_gap = max([TIE_FLOOR[m.dtype]] + [TIE_FACTOR * min(o.max_abs, o.tol.atol) for o in deciding])
    if prompts or given:
        vocab = m.target.vocab_size
        plist = given if given is not None else [
            rng.integers(0, vocab, int(rng.integers(1, max(2, min(24, m.max_seq_len - 1) + 1)))).tolist()
            for _ in range(prompts)]
        log(f"generating {len(plist)} prompts x {max_new_tokens} tokens (runtime, transformers, oracle)")
        # A pruned head carries its own map (prune_vocab); the checkpoint's d2t is its whole vocabulary's.
        d2t = None if m.draft_vocab is not None else d.ckpt.weights.get("d2t")
        oracle = EagleOracle(tgt.model, head, d.feature_layers, d2t)
        greedy, eagle = end_to_end(rt, oracle, tgt.model, m, plist, max_new_tokens, tie_gap, log)
        if quant is not None:
            from .quant import check_lossless, check_one_row, measure_drift

            log("quantized artifact: EAGLE vs --no-draft at its own settings, drift vs the unquantized model")
            if m.quantization.target:  # a float target's one-row call is the float graph's (no rounding to check)
                check_one_row(own_dir, load_manifest(own_dir), threads, quant)
            conts = check_lossless(own_rt, plist, max_new_tokens, quant)
            measure_drift(own_dir, load_manifest(own_dir), float_lm, [p + c for p, c in zip(plist, conts,
                                                                                           strict=True)],
                          threads, quant)
    else:
        greedy, eagle = TokenReport("greedy", skipped=True), TokenReport("eagle", skipped=True)
    return ValidationReport(str(Path(artifact)), backend, m.dtype, str(sources["target"]), str(sources["draft"]),
                            m.tree_defaults.to_dict(), graphs, greedy, eagle, tie_gap, embedding,
                            seconds=time.perf_counter() - t0, library=library, quantization=quant)


def _target_logprobs(head, hidden: torch.Tensor, m: Manifest) -> torch.Tensor:
    """The draft's full log-probs indexed by target id (as ``topk_ids`` are): -inf outside the draft vocabulary."""
    logp = torch.log_softmax(head.logits(hidden.float()), dim=-1)
    to_target = getattr(head, "draft_to_target", None)
    if to_target is None:
        return logp
    out = torch.full((*logp.shape[:-1], m.target.vocab_size), -math.inf)
    out[..., to_target] = logp
    return out

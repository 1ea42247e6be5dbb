"""`eagle-export export`: trace the target verify graph and the draft step graph (and, for ONNX Runtime, the fused
target graph and the draft tree graph) to ONNX, and write an artifact.

The decisions (capacity, specs, axis ranges, which graphs) are ``plan.py``'s; this module carries them out in
steps under the output folder's lock: load and check the checkpoints (``_load``), trace each graph
(``_trace_graphs``), quantize (``export/quantization``), write the tokenizer and the manifest (``_write_manifest``),
and publish the folder atomically (``export/data/out_dir.py``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from tqdm.auto import tqdm

from eagle_export import __version__
from eagle_export import contract as C
from eagle_export.dtypes import EXPORT_DTYPES, torch_dtype
from eagle_export.errors import CheckpointError, EagleExportError
from eagle_export.export.checkpoint import draft_vocab as vocab
from eagle_export.export.checkpoint.loaders import LoadedDraft, LoadedTarget, load_draft_head, load_target
from eagle_export.export.data.embedding_table import locate_target_embedding, write_own_table
from eagle_export.export.data.lean import (
    MemoryTensor,
    Source,
    WeightsAsInputs,
    checkpoint_bytes,
    checkpoint_index,
    checkpoint_sources,
    externalize,
)
from eagle_export.export.data.out_dir import (
    OutputLock,
    check_replaceable,
    make_partial,
    parent_folders,
    publish,
    remove_stale_partials,
)
from eagle_export.export.data.shared_data import share_weights
from eagle_export.export.graphs.draft_tree import DraftTree
from eagle_export.export.graphs.fused import FusedTargetVerify, pack_qkv, rope_cache
from eagle_export.export.graphs.heads import DraftStep, prune_vocab
from eagle_export.export.graphs.target import TargetVerify
from eagle_export.export.plan import (
    ExportPlan,
    check_head_window,
    default_max_seq_len,
    make_plan,
    target_capacity,
    tree_graph_top_k,
)
from eagle_export.export.quantization.artifact import (
    QuantizeOptions,
    exact_default_tree,
    quantize_artifact_graphs,
)
from eagle_export.manifest import MANIFEST_NAME, DraftVocabInfo, Manifest, QuantizationInfo, TableRef
from eagle_export.progress import progress_bar, terminal_bars
from eagle_export.tree_params import TreeLimits, TreeParams

log = logging.getLogger(__name__)

# bf16 graphs build and run on TensorRT; ONNX Runtime's CPU provider has no bf16 kernels (MatMul), so the
# ort backend refuses them.
OPSET = 17
# Targets whose weight files reach this size take the lean path (export/data/lean.py: traced on the meta device,
# the checkpoint streamed tensor by tensor into the data files). Smaller ones are loaded whole and traced with
# their weights, as before; both paths give the same graphs' values (tests/test_export_lean.py).
LEAN_THRESHOLD_BYTES = 256 << 20


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    # Cache capacity; None: min(DEFAULT_MAX_SEQ_LEN, the target's max_position_embeddings).
    max_seq_len: int | None = None
    limits: TreeLimits = field(default_factory=TreeLimits)
    tree: TreeParams = field(default_factory=TreeParams)
    max_batch: int = 1
    overwrite: bool = False
    # EAGLE-3: target decoder layers whose inputs form the draft's features (None: the reference's 2, L//2, L-3).
    feature_layers: list[int] | None = None
    # Weight files of at least this many bytes take the lean path (0: always, when the target is safetensors).
    lean_threshold_bytes: int = LEAN_THRESHOLD_BYTES
    # Also write the fused target graph ONNX Runtime runs (contract 4), where its operator supports the target.
    fused: bool = True
    # Also write the draft tree graphs (contract 6): a round's draft work in one call, one graph per top_k.
    draft_tree: bool = True
    # The top_k values to write a draft tree graph for (None: plan.DEFAULT_TREE_GRAPH_TOP_K and the default tree's;
    # values above --max-top-k are left out).
    draft_tree_top_k: tuple[int, ...] | None = None
    # How the head is read (export/checkpoint/readings.py): auto (the writer's reading where the files name it),
    # config, or a writer's reading forced.
    head_reading: str = "auto"
    # Weight-only int4/int8 quantization of the MatMul weights (export/quantization/artifact.py); None: float weights.
    quantize: QuantizeOptions | None = None
    # Keep this many of the head's tokens in the draft's lm_head (export/checkpoint/draft_vocab.py); None: all.
    draft_vocab: int | None = None
    # The text file whose token counts rank them (None: the tokenizer's BPE merge rank, else token id order).
    draft_vocab_corpus: Path | None = None


@dataclass
class ExportReport:
    """What an export did: where, how long, how much memory, and how the size compares with the checkpoints."""

    path: Path
    lean: bool
    wall_s: float
    peak_rss_bytes: int
    weights_bytes: int  # target + head weights at the output dtype
    artifact_bytes: int

    def summary(self) -> str:
        gib = 1 << 30
        return (f"wrote {self.path} in {self.wall_s:.1f} s ({'lean' if self.lean else 'in-memory'} path), peak memory "
                f"{self.peak_rss_bytes / gib:.2f} GiB = {self.peak_rss_bytes / max(self.weights_bytes, 1):.2f}x the "
                f"weights ({self.weights_bytes / gib:.2f} GiB at the output dtype), artifact "
                f"{self.artifact_bytes / gib:.2f} GiB")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _dummy_common(batch: int, new: int, past: int) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros(batch, new, dtype=torch.long)
    pos = torch.arange(past, past + new).repeat(batch, 1)
    mask = torch.ones(batch, new, past + new, dtype=torch.bool)
    return ids, pos, mask


def _export_graph(module: torch.nn.Module, args: tuple, spec: C.GraphSpec, path: Path,
                  lean: dict[int, Source] | None = None, bar=None) -> None:
    """Trace with the contract's names and axes, then store weights as external data next to the graph.

    lean: tensor id -> checkpoint tensor (export/data/lean.py). Then the module is traced on the meta device with
    its weights as graph inputs, and ``externalize`` writes them from their sources one by one: the graph file is
    written once, small, and only ``<graph>.onnx.data`` sits beside it.
    """
    names, axes = spec.input_names, spec.dynamic_axes()
    if lean is not None:
        wrapper = WeightsAsInputs(module)
        names = names + wrapper.names
        args = tuple(a.to("meta") for a in args) + tuple(wrapper.meta_weights())
        module = wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, args, str(path), dynamo=False, opset_version=OPSET,
            input_names=names, output_names=spec.output_names,
            dynamic_axes=axes, do_constant_folding=True,
        )
    model = onnx.load(str(path))
    _pin_io_shapes(model, spec)
    data_name = path.name + ".data"
    if lean is None:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
    else:
        externalize(model, wrapper.sources(lean), path.with_name(data_name),
                    progress=None if bar is None else bar.update)
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))


def _pin_io_shapes(model: onnx.ModelProto, spec: C.GraphSpec) -> None:
    """Write the contract's shapes onto the graph IO: fixed dims as values, dynamic ones by axis name.

    The tracer leaves some fixed dims symbolic (e.g. head_dim after rotary); engine builders read these.
    """
    by_name = {t.name: t for t in (*spec.inputs, *spec.outputs)}
    for vi in (*model.graph.input, *model.graph.output):
        t = by_name.get(vi.name)
        if t is None:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(t.shape):
            raise EagleExportError(f"traced {vi.name} has rank {len(dims)}, the contract says {len(t.shape)}")
        for d, want in zip(dims, t.shape, strict=True):
            if isinstance(want, str):
                d.dim_param = want
            else:
                d.dim_value = want


def export_artifact(target_dir: str | Path, draft_dir: str | Path, out_dir: str | Path,
                    options: ExportOptions | None = None, progress: bool = True) -> Path:
    """Load, check, trace both graphs and write one artifact directory, atomically (temp dir, then rename)."""
    return export_with_report(target_dir, draft_dir, out_dir, options, progress).path


def _unique_param_bytes(modules: list[torch.nn.Module], dtype: torch.dtype) -> int:
    """Bytes of the modules' distinct parameters at ``dtype`` (float ones; others at their own size)."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p
    return sum(p.numel() * (torch.empty((), dtype=dtype).element_size() if p.is_floating_point() else p.element_size())
               for p in seen.values())


def _lean_sources(target: LoadedTarget, dtype: torch.dtype) -> dict[int, Source]:
    """Where each weight of a meta-device target comes from: the checkpoint, by name, and the rotary tables
    computed here for real (cast to ``dtype`` as the in-memory path's ``model.to(dtype)`` casts them)."""
    sources = checkpoint_sources(target.model, checkpoint_index(target.path))
    rotary = target.model.model.rotary_emb
    real = type(rotary)(config=target.model.config).to(dtype)
    for name, buf in rotary.named_buffers():
        sources[id(buf)] = MemoryTensor(real.get_buffer(name))
    return sources


def export_with_report(target_dir: str | Path, draft_dir: str | Path, out_dir: str | Path,
                       options: ExportOptions | None = None, progress: bool = True) -> ExportReport:
    """``export_artifact``, returning what the export cost (wall time, peak memory, sizes)."""
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    options = options or ExportOptions()
    if options.dtype not in EXPORT_DTYPES:
        raise EagleExportError(f"dtype {options.dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    options.tree.validate(options.limits)
    tree = exact_default_tree(options.tree, options.quantize)
    if tree != options.tree:
        def show(t: TreeParams) -> str:
            return f"top_k {t.top_k}, depth {t.depth}, total_tokens {t.total_tokens}"

        log.warning("--quantize at accuracy level %d: the default tree is the chain (%s) instead of (%s): on a "
                    "chain EAGLE equals plain decoding token for token, on a branching tree it may differ at "
                    "near-ties (tools/lab/results.md, \"Why quantized EAGLE diverged\"); "
                    "--quantize-inexact-trees keeps the branching one", options.quantize.accuracy_level, show(tree),
                    show(options.tree))
        options = dataclasses.replace(options, tree=tree)
    if options.quantize is not None:
        options.quantize.check()
        if options.dtype == "bf16":
            raise EagleExportError("--quantize takes --dtype fp32 or fp16 (MatMulNBits' scales are float32/float16, "
                                   "and no runtime here runs bf16 with quantized weights)")
    if options.max_seq_len is not None and options.max_seq_len < 2:
        raise EagleExportError(f"--max-seq-len must be >= 2, got {options.max_seq_len}")
    if not isinstance(options.max_batch, int) or isinstance(options.max_batch, bool) or options.max_batch < 1:
        raise EagleExportError(f"--max-batch must be an integer >= 1, got {options.max_batch!r}")
    vocab.check_options(options.draft_vocab, options.draft_vocab_corpus)  # before any checkpoint is read
    # One export per --out at a time (a second one fails at once); what dead exports left beside it goes.
    with parent_folders(out_dir), OutputLock(out_dir):
        remove_stale_partials(out_dir)
        return _export_locked(target_dir, draft_dir, out_dir, options, progress, t_start)


def _export_locked(target_dir, draft_dir, out_dir: Path, options: ExportOptions, progress: bool,
                   t_start: float) -> ExportReport:
    """The export's steps, under the output lock: load and check, plan, trace each graph into a partial folder,
    quantize, write the tokenizer and the manifest, publish."""
    if os.path.lexists(out_dir):
        if not options.overwrite:
            raise EagleExportError(f"{out_dir} already exists (pass --overwrite to replace it)")
        check_replaceable(out_dir)
    dtype_name = EXPORT_DTYPES[options.dtype]
    dtype = torch_dtype(dtype_name)
    steps = progress_bar(7 + (options.quantize is not None), "export", "step", progress)
    loaded = _load(target_dir, draft_dir, options, dtype, progress, steps)
    tree_ks = tree_graph_top_k(options.limits, options.tree, options.draft_tree, options.draft_tree_top_k)
    plan = make_plan(loaded.target, loaded.draft, draft_dir, dtype_name=dtype_name, seq=loaded.seq,
                     limits=options.limits, max_batch=options.max_batch, fused=options.fused, tree_top_k=tree_ks)
    tmp = make_partial(out_dir)
    wbar = None
    try:
        if loaded.sources is not None:
            # Bytes written, redrawn on a terminal only (a line per tensor would flood a log).
            wbar = tqdm(total=loaded.weights_bytes, desc="weights", disable=not terminal_bars(progress), unit="B",
                        unit_scale=True, unit_divisor=1024, leave=False)
        _trace_graphs(plan, loaded, options, dtype, tmp, steps, wbar)
        quantization = None
        if options.quantize is not None:
            steps.set_postfix_str(f"quantizing weights to int{options.quantize.bits}")
            quantization = quantize_artifact_graphs(tmp, options.quantize, list(plan.graphs()))
            steps.update()
        steps.set_postfix_str("writing tokenizer and manifest")
        _write_manifest(tmp, plan, loaded, options, quantization, dtype)
        publish(tmp, out_dir, options.overwrite)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if wbar is not None:
            wbar.close()
        steps.close()
    assert (out_dir / MANIFEST_NAME).is_file()
    return ExportReport(out_dir, loaded.sources is not None, time.perf_counter() - t_start, peak_rss_bytes(),
                        loaded.weights_bytes, sum(f.stat().st_size for f in out_dir.iterdir()))


@dataclass
class _Loaded:
    """The checked checkpoints at the export dtype, the capacity, and (lean path) where each weight comes from."""

    target: LoadedTarget
    draft: LoadedDraft
    seq: int
    sources: dict[int, Source] | None
    weights_bytes: int
    # export --draft-vocab: the kept target ids (ascending: draft id order) and the manifest's record of them.
    draft_vocab: tuple[torch.Tensor, DraftVocabInfo] | None = None


def _load(target_dir, draft_dir, options: ExportOptions, dtype: torch.dtype, progress: bool, steps) -> _Loaded:
    """Steps 1-2: load the target (whole, or on the meta device for the lean path) and the head, and check them."""
    steps.set_postfix_str("loading target")
    tdir = Path(target_dir)
    lean = (tdir.is_dir() and any(tdir.glob("*.safetensors"))
            and checkpoint_bytes(tdir) >= options.lean_threshold_bytes)
    target = load_target(target_dir, dtype=dtype if lean else torch.float32, progress=terminal_bars(progress),
                         weights=not lean)
    seq = target_capacity(options.max_seq_len, target)
    if not target.tokenizer_files:
        log.warning("target %s has no tokenizer files: the artifact will take token ids only", target.path)
    steps.update()
    steps.set_postfix_str("loading draft")
    draft = load_draft_head(draft_dir, target, options.feature_layers, options.head_reading)
    check_head_window(draft, options.limits.max_depth)
    if options.max_seq_len is None:
        seq = default_max_seq_len(seq, draft.config.max_position_embeddings, options.limits.max_depth)
    if options.limits.max_top_k > draft.vocab_size:
        raise CheckpointError(
            f"--max-top-k {options.limits.max_top_k} exceeds the draft vocabulary of {draft.vocab_size} tokens"
        )
    target.model.to(dtype)
    draft.head.to(dtype)
    sources = _lean_sources(target, dtype) if lean else None  # after .to(dtype): it replaces cast buffers
    pruned = None
    if options.draft_vocab is not None:
        steps.set_postfix_str("choosing the draft vocabulary")
        draft, pruned = _prune_draft(target, draft, options, sources, dtype, progress)
    weights_bytes = _unique_param_bytes([target.model, draft.head], dtype)
    steps.update()
    return _Loaded(target, draft, seq, sources, weights_bytes, pruned)


def _prune_draft(target: LoadedTarget, draft: LoadedDraft, options: ExportOptions, sources: dict[int, Source] | None,
                 dtype: torch.dtype, progress: bool) -> tuple[LoadedDraft, tuple[torch.Tensor, DraftVocabInfo]]:
    """``--draft-vocab N``: rank the head's vocabulary, cut its lm_head to the N kept rows with the id map back to the
    target's ids (export/checkpoint/draft_vocab.py, export/graphs/heads.py ``prune_vocab``)."""
    n, head = options.draft_vocab, draft.head
    vocab.check_size(n, draft.vocab_size, options.limits.max_top_k, draft.variant)
    mapped = head.draft_to_target
    candidates = torch.arange(draft.vocab_size) if mapped is None else mapped
    tok_dir = target.path if target.tokenizer_files else None
    kept, info = vocab.choose(n, candidates, target.eos_token_ids, options.draft_vocab_corpus, tok_dir,
                              target.config.vocab_size, progress)
    weight = None
    if head.lm_head.weight.is_meta:  # lean path: the target's lm_head is read from the checkpoint
        weight = sources[id(head.lm_head.weight)].load().to(dtype)
    prune_vocab(head, kept, weight)
    log.info("draft vocabulary: %d of %d tokens kept (ranked by %s)", n, draft.vocab_size,
             info.corpus or info.ranking)
    return dataclasses.replace(draft, vocab_size=n, d2t_identity=False), (kept, info)


def _trace_graphs(plan: ExportPlan, loaded: _Loaded, options: ExportOptions, dtype: torch.dtype, tmp: Path, steps,
                  wbar) -> None:
    """Steps 3-6: trace each graph of the plan into ``tmp``, on small dummy inputs whose sizes no axis specialises."""
    target, draft, sources = loaded.target, loaded.draft, loaded.sources
    tinfo, dinfo, lim = plan.target_info, plan.draft_info, options.limits
    with torch.no_grad():
        steps.set_postfix_str("tracing target verify graph")
        b, t, p = 2, 3, 5
        ids, pos, mask = _dummy_common(b, t, p)
        rows = torch.tensor([[0, 2]] * b, dtype=torch.long)
        past = [torch.zeros(b, p, tinfo.kv_heads, tinfo.head_dim, dtype=dtype)
                for _ in range(2 * tinfo.num_layers)]
        _export_graph(TargetVerify(target.model, draft.feature_layers).eval(), (ids, pos, mask, rows, *past),
                      plan.target.spec, tmp / plan.target.file, sources, wbar)
        steps.update()
        if plan.fused is not None:
            steps.set_postfix_str("tracing fused target graph")
            _export_fused(target, draft.feature_layers, plan.kv_rows, dtype, (ids, pos, mask, rows), plan.fused.spec,
                          tmp, sources)
        else:
            steps.set_postfix_str("no fused target graph")
        steps.update()
        steps.set_postfix_str("tracing draft step graph")
        # Traced with feature rows and hidden rows both present (2 + 1 = t), so neither size is specialised.
        embeds = torch.zeros(b, t, dinfo.hidden_size, dtype=dtype)
        feats = torch.zeros(b, t - 1, dinfo.feature_dim, dtype=dtype)
        hidden_in = torch.zeros(b, 1, dinfo.hidden_size, dtype=dtype)
        dpast = [torch.zeros(b, p, dinfo.kv_heads, dinfo.head_dim, dtype=dtype)
                 for _ in range(2 * dinfo.num_layers)]
        _export_graph(DraftStep(draft.head, lim.max_top_k).eval(), (embeds, feats, hidden_in, pos, mask, *dpast),
                      plan.draft.spec, tmp / plan.draft.file, sources, wbar)
        steps.update()
        if plan.trees:
            ks = list(plan.trees)
            steps.set_postfix_str(f"tracing draft tree graphs (top_k {', '.join(map(str, ks))})")
            last_row = torch.tensor([t - 1, t - 2], dtype=torch.long)[:b]
            feats_all = torch.zeros(b, t, dinfo.feature_dim, dtype=dtype)
            for k, g in plan.trees.items():
                # Quantization rewrites MatMuls: a quantized artifact's tree graphs keep every weight in one.
                module = DraftTree(draft.head, lim.max_top_k, k, lim.max_depth, plain=options.quantize is not None)
                _export_draft_tree(module.eval(), (embeds, feats_all, pos, mask, last_row, *dpast), g.spec, tmp,
                                   sources, ks[0])
        else:
            steps.set_postfix_str("no draft tree graph")
        steps.update()


def _write_manifest(tmp: Path, plan: ExportPlan, loaded: _Loaded, options: ExportOptions,
                    quantization: QuantizationInfo | None, dtype: torch.dtype) -> None:
    """Step 7: the tokenizer files and the manifest, written last: a folder without one is never mistaken for a
    finished export."""
    target = loaded.target
    table = _draft_table(tmp, target, loaded.draft.head, loaded.sources, dtype)
    for f in target.tokenizer_files:
        shutil.copy2(f, tmp / f.name)
    gen_cfg = target.path / "generation_config.json"
    if gen_cfg.is_file():
        shutil.copy2(gen_cfg, tmp / gen_cfg.name)
    vocab_info = None
    if loaded.draft_vocab is not None:
        kept, vocab_info = loaded.draft_vocab
        (tmp / vocab_info.file).write_text(json.dumps({"target_ids": kept.tolist()}) + "\n")
    manifest = Manifest(
        variant=loaded.draft.variant, dtype=plan.dtype_name, max_seq_len=plan.seq, tree_limits=options.limits,
        tree_defaults=options.tree, target=plan.target_info, draft=plan.draft_info,
        graphs={name: g.entry() for name, g in plan.graphs().items()},
        has_tokenizer=any(f.name in ("tokenizer.json", "tokenizer.model") for f in target.tokenizer_files),
        draft_embedding=table,
        versions=_versions(),
        files={f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
        quantization=quantization,
        draft_vocab=vocab_info,
    )
    manifest.write(tmp)


def _export_fused(target: LoadedTarget, feature_layers: list[int] | None, kv_rows: int, dtype: torch.dtype,
                  args: tuple, spec: C.GraphSpec, directory: Path, sources: dict[int, Source] | None) -> None:
    """Trace the fused target graph beside the standard one; the weights both hold are stored once (in the
    standard graph's data file)."""
    cfg = target.model.config
    # The standard graph's rotary tables, as both export paths make them (a fresh module cast to the dtype).
    rotary = type(target.model.model.rotary_emb)(config=cfg).to(dtype)
    module = FusedTargetVerify(target.model, feature_layers, kv_rows, rope=rope_cache(rotary, kv_rows, dtype)).eval()
    b = args[0].shape[0]
    cache = [torch.zeros(b, module.kv_heads, kv_rows, module.head_dim, dtype=dtype)
             for _ in range(2 * len(module.layers))]
    path = directory / f"{C.TARGET_FUSED_GRAPH}.onnx"
    _export_graph(module, (*args, *cache), spec, path, sources)
    model = onnx.load(str(path), load_external_data=False)
    pack_qkv(model)
    onnx.save_model(model, str(path))
    share_weights(path, directory / f"{C.TARGET_GRAPH}.onnx")


def _export_draft_tree(module: DraftTree, args: tuple, spec: C.GraphSpec, directory: Path,
                       sources: dict[int, Source] | None, first_top_k: int) -> None:
    """Trace a draft tree graph; the weights it shares with the step graph (the head, lm_head), the target graph
    (the embedding table) and the first tree graph (what the tree graphs lay out their own way: q, k and v as one
    matrix) are stored once, in their data files."""
    path = directory / f"{spec.name}.onnx"
    _export_graph(module, args, spec, path, sources)
    others = [C.DRAFT_GRAPH, C.TARGET_GRAPH] + ([C.tree_graph(first_top_k)] if spec.name != C.tree_graph(first_top_k)
                                               else [])
    for other in others:
        if (directory / (path.name + ".data")).exists():
            share_weights(path, directory / f"{other}.onnx")


def _draft_table(directory: Path, target: LoadedTarget, head: torch.nn.Module, sources: dict[int, Source] | None,
                 dtype: torch.dtype) -> TableRef:
    """Where the runtime reads the draft's input_embeds from: the target's embedding in the target graph's data
    file, unless the head's own table differs from it (then written beside the graphs, once)."""
    shared = locate_target_embedding(directory / f"{C.TARGET_GRAPH}.onnx")
    own = head.embed_tokens.weight
    target_weight = target.model.model.embed_tokens.weight
    if own is target_weight:
        return shared
    # The head brought embed_tokens.weight: the same values as the target's (a frozen copy saved with the head)
    # share the target's table; different ones (a head trained with its own) are the head's.
    theirs = sources[id(target_weight)].load().to(dtype) if sources is not None else target_weight
    if own.shape == theirs.shape and torch.equal(own.detach().to(dtype), theirs.detach()):
        log.info("the head's embed_tokens equals the target's: the draft reads the target's table")
        return shared
    log.info("the head's embed_tokens differs from the target's: its own table is stored for the draft")
    return write_own_table(directory, own.detach().to(dtype))


def _versions() -> dict[str, str]:
    import onnxruntime
    import transformers

    return {"eagle_export": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "opset": str(OPSET),
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

"""`eagle-export export`: trace the target verify graph and the draft step graph to ONNX, write an artifact."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import torch
from tqdm.auto import tqdm

from eagle_export import __version__
from eagle_export import contract as C
from eagle_export.dtypes import EXPORT_DTYPES, torch_dtype
from eagle_export.errors import CheckpointError, EagleExportError
from eagle_export.manifest import MANIFEST_NAME, DraftInfo, GraphEntry, Manifest, TableRef, TargetInfo
from eagle_export.progress import progress_bar, terminal_bars
from eagle_export.tree_params import TreeLimits, TreeParams

from .draft_tree import DraftTree
from .embedding_table import locate_target_embedding, write_own_table
from .families import layer_plans, windowed
from .fused import FusedTargetVerify, pack_qkv, rope_cache
from .loaders import LoadedTarget, load_draft_head, load_target
from .modules import DraftStep, TargetVerify
from .out_dir import (
    OutputLock,
    check_replaceable,
    make_partial,
    parent_folders,
    publish,
    remove_stale_partials,
)
from .quantize_artifact import QuantizeOptions, exact_default_tree, quantize_artifact_graphs
from .shared_data import share_weights
from .weights import (
    MemoryTensor,
    Source,
    WeightsAsInputs,
    checkpoint_bytes,
    checkpoint_index,
    checkpoint_sources,
    externalize,
)

log = logging.getLogger(__name__)

# bf16 graphs build and run on TensorRT; ONNX Runtime's CPU provider has no bf16 kernels (MatMul), so the
# ort backend refuses them.
OPSET = 17
DEFAULT_MAX_SEQ_LEN = 2048
# Targets whose weight files reach this size take the lean path (export/weights.py: traced on the meta device,
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
    # Also write the draft tree graph (contract 5): a round's draft work in one call, for the default tree's shape.
    draft_tree: bool = True
    # How the head is read (export/readings.py): auto (the writer's reading where the files name it), config, or a
    # writer's reading forced.
    head_reading: str = "auto"
    # Weight-only int4/int8 quantization of the MatMul weights (export/quantize_artifact.py); None: float weights.
    quantize: QuantizeOptions | None = None


def fused_unsupported(head_dim: int, dtype_name: str, model: torch.nn.Module | None = None,
                      reach: int | None = None) -> str | None:
    """Why the fused target graph cannot serve this target (None: it can). ONNX Runtime's CPU GroupQueryAttention
    takes float32/float16 and head sizes that are multiples of 16, half-split rotary on every layer, no learned
    sinks, and no window or chunk narrower than the cache's ``reach`` (rows); other targets run the standard graph."""
    if dtype_name not in ("float32", "float16"):
        return f"{dtype_name} (ONNX Runtime runs float32 and float16 only)"
    if head_dim % C.FUSED_HEAD_DIM_MULTIPLE:
        return f"head_dim {head_dim} (GroupQueryAttention takes multiples of {C.FUSED_HEAD_DIM_MULTIPLE})"
    if model is None:
        return None
    plans = layer_plans(model.config)
    if any(p.rope != "half" or p.qk_l2_eps is not None or p.temperature is not None for p in plans):
        return "NoPE layers, interleaved rotary, QK L2 norm or attention temperature (Llama 4)"
    if any(getattr(layer.self_attn, "sinks", None) is not None for layer in model.model.layers):
        return "learned attention sinks"
    narrow = windowed(plans, reach or 0)
    if narrow:
        return f"sliding-window or chunked attention narrower than the cache on layers {narrow[:8]}"
    return None


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

    lean: tensor id -> checkpoint tensor (export/weights.py). Then the module is traced on the meta device with
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


def target_info(t: LoadedTarget, feature_dim: int, feature_layers: list[int] | None = None) -> TargetInfo:
    c = t.config
    heads = c.num_attention_heads
    return TargetInfo(
        model_type=c.model_type, architecture=type(t.model).__name__, num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size, num_heads=heads, kv_heads=c.num_key_value_heads or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
        feature_dim=feature_dim, feature_layers=feature_layers, max_position_embeddings=c.max_position_embeddings,
        eos_token_ids=t.eos_token_ids, bos_token_id=t.bos_token_id, source=str(t.path.resolve()),
    )


def check_head_window(draft, max_depth: int) -> None:
    """The draft graph masks keys by their cache column, which is the position of every context row and at or past the
    position of every tree row (the tree's own rows lie within max_depth - 1 positions of each other): the window is
    exact when it is at least --max-depth."""
    w = draft.options.sliding_window
    if w and w < max_depth:
        raise CheckpointError(
            f"draft: {draft.ckpt.path} has sliding_window {w} on layers {draft.options.sliding_layers}, smaller than "
            f"--max-depth {max_depth}: the draft graph implements windows of at least the tree depth; export with "
            f"--max-depth {w} or less")


def default_max_seq_len(target_default: int, head_positions: int | None, max_depth: int) -> int:
    """The capacity without --max-seq-len: ``target_default`` (min(2048, the target's max_position_embeddings)),
    lowered so that the draft's positions (up to capacity + max_depth) stay inside the head's trained range, as
    the draft position warning advises; kept when the head's range is unknown or too small to lower to."""
    if head_positions is None or head_positions - max_depth < 2:
        return target_default
    seq = min(target_default, head_positions - max_depth)
    if seq < target_default:
        log.info("capacity %d (the head's max_position_embeddings %d minus --max-depth %d): every draft position "
                 "stays in the head's trained range; pass --max-seq-len to choose another", seq, head_positions,
                 max_depth)
    return seq


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
                    "near-ties (docs/scale.md, \"Why quantized EAGLE diverged\"); --quantize-inexact-trees keeps "
                    "the branching one", options.quantize.accuracy_level, show(tree), show(options.tree))
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
    # One export per --out at a time (a second one fails at once); what dead exports left beside it goes.
    with parent_folders(out_dir), OutputLock(out_dir):
        remove_stale_partials(out_dir)
        return _export_locked(target_dir, draft_dir, out_dir, options, progress, t_start)


def _export_locked(target_dir, draft_dir, out_dir: Path, options: ExportOptions, progress: bool,
                   t_start: float) -> ExportReport:
    if os.path.lexists(out_dir):
        if not options.overwrite:
            raise EagleExportError(f"{out_dir} already exists (pass --overwrite to replace it)")
        check_replaceable(out_dir)
    dtype_name = EXPORT_DTYPES[options.dtype]
    dtype = torch_dtype(dtype_name)
    steps = progress_bar(7 + (options.quantize is not None), "export", "step", progress)

    steps.set_postfix_str("loading target")
    tdir = Path(target_dir)
    lean = (tdir.is_dir() and any(tdir.glob("*.safetensors"))
            and checkpoint_bytes(tdir) >= options.lean_threshold_bytes)
    target = load_target(target_dir, dtype=dtype if lean else torch.float32, progress=terminal_bars(progress),
                         weights=not lean)
    seq = options.max_seq_len
    if seq is None:
        seq = min(DEFAULT_MAX_SEQ_LEN, target.config.max_position_embeddings)
    if seq > target.config.max_position_embeddings:
        raise CheckpointError(
            f"--max-seq-len {seq} exceeds the target's max_position_embeddings "
            f"{target.config.max_position_embeddings}"
        )
    if not target.tokenizer_files:
        log.warning("target %s has no tokenizer files: the artifact will take token ids only", target.path)
    steps.update()
    steps.set_postfix_str("loading draft")
    draft = load_draft_head(draft_dir, target, options.feature_layers, options.head_reading)
    head, dcfg = draft.head, draft.config
    check_head_window(draft, options.limits.max_depth)
    if options.max_seq_len is None:
        seq = default_max_seq_len(seq, dcfg.max_position_embeddings, options.limits.max_depth)
    if options.limits.max_top_k > draft.vocab_size:
        raise CheckpointError(
            f"--max-top-k {options.limits.max_top_k} exceeds the draft vocabulary of {draft.vocab_size} tokens"
        )
    target.model.to(dtype)
    head.to(dtype)
    sources = _lean_sources(target, dtype) if lean else None  # after .to(dtype): it replaces cast buffers
    weights_bytes = _unique_param_bytes([target.model, head], dtype)
    steps.update()

    tinfo = target_info(target, feature_dim=draft.feature_dim, feature_layers=draft.feature_layers)
    dheads = dcfg.num_attention_heads
    dinfo = DraftInfo(
        hidden_size=dcfg.hidden_size, num_heads=dheads, kv_heads=dcfg.num_key_value_heads or dheads,
        head_dim=getattr(dcfg, "head_dim", None) or dcfg.hidden_size // dheads,
        feature_dim=draft.feature_dim, vocab_size=draft.vocab_size, d2t_identity=draft.d2t_identity,
        max_position_embeddings=dcfg.max_position_embeddings, fc_bias=draft.fc_bias,
        own_embedding=draft.own_embedding, source=str(Path(draft_dir).resolve()),
        format=draft.format, num_layers=draft.options.num_layers, options=asdict(draft.options),
        feature_layers_source=draft.feature_layers_source, reading=draft.reading,
    )
    tspec = C.target_verify_spec(num_layers=tinfo.num_layers, kv_heads=tinfo.kv_heads, head_dim=tinfo.head_dim,
                                 vocab_size=tinfo.vocab_size, feature_dim=tinfo.feature_dim, dtype=dtype_name)
    dspec = C.draft_step_spec(kv_heads=dinfo.kv_heads, head_dim=dinfo.head_dim, hidden_size=dinfo.hidden_size,
                              feature_dim=dinfo.feature_dim, top_k=options.limits.max_top_k, dtype=dtype_name,
                              num_layers=dinfo.num_layers)
    lim = options.limits
    verify_rows = lim.max_verify_tokens
    t_new = max(seq, verify_rows)
    d_new = max(seq, lim.max_top_k, lim.max_context_rows)
    d_past = seq + lim.max_draft_rows
    target_axes = {C.BATCH: [1, options.max_batch], C.NEW_TOKENS: [1, t_new], C.PAST_LEN: [0, seq - 1],
                   C.TOTAL_LEN: [1, seq - 1 + t_new], C.LOGIT_ROWS: [1, verify_rows]}
    draft_axes = {C.BATCH: [1, options.max_batch], C.NEW_TOKENS: [1, d_new], C.FEATURE_ROWS: [0, d_new],
                  C.HIDDEN_ROWS: [0, lim.max_top_k], C.PAST_LEN: [0, d_past], C.TOTAL_LEN: [1, d_past + d_new]}
    # The fused graph's caches are whole buffers of a sequence's rows: the committed context plus a verify tree.
    kv_rows = seq + verify_rows
    fused_axes = {C.BATCH: [1, options.max_batch], C.NEW_TOKENS: [1, t_new], C.TOTAL_LEN: [1, kv_rows],
                  C.LOGIT_ROWS: [1, verify_rows], C.CAPACITY: [kv_rows, kv_rows]}
    why_not = (fused_unsupported(tinfo.head_dim, dtype_name, target.model, kv_rows) if options.fused
               else "not asked for (--no-fused)")
    if why_not is not None and options.fused:
        log.info("no fused target graph for this target: %s; ONNX Runtime runs the standard graph", why_not)
    fspec = C.target_fused_spec(num_layers=tinfo.num_layers, kv_heads=tinfo.kv_heads, head_dim=tinfo.head_dim,
                                vocab_size=tinfo.vocab_size, feature_dim=tinfo.feature_dim, dtype=dtype_name)
    tree = options.tree
    xspec = C.draft_tree_spec(kv_heads=dinfo.kv_heads, head_dim=dinfo.head_dim, hidden_size=dinfo.hidden_size,
                              feature_dim=dinfo.feature_dim, max_top_k=lim.max_top_k, tree_top_k=tree.top_k,
                              tree_depth=tree.depth, dtype=dtype_name, num_layers=dinfo.num_layers)
    n_cand = tree.max_candidates
    tree_axes = {C.BATCH: [1, options.max_batch], C.NEW_TOKENS: [1, d_new], C.PAST_LEN: [0, d_past],
                 C.TOTAL_LEN: [1, d_past + d_new], C.TREE_TOP_K: [tree.top_k, tree.top_k],
                 C.TREE_DEPTH: [tree.depth, tree.depth], C.TREE_CANDIDATES: [n_cand, n_cand]}
    draft_positions = seq + lim.max_depth
    if draft_positions > dinfo.max_position_embeddings:
        log.warning(
            "the draft head's max_position_embeddings is %d but with --max-seq-len %d its positions reach %d: "
            "acceptance may drop past position %d (the head was not trained there); output stays lossless, and a "
            "generation that gets there reports it (stats.draft_beyond_position_limit)",
            dinfo.max_position_embeddings, seq, draft_positions, dinfo.max_position_embeddings,
        )

    tmp = make_partial(out_dir)
    wbar = None
    try:
        if lean:
            # Bytes written, redrawn on a terminal only (a line per tensor would flood a log).
            wbar = tqdm(total=weights_bytes, desc="weights", disable=not terminal_bars(progress), unit="B",
                        unit_scale=True, unit_divisor=1024, leave=False)
        with torch.no_grad():
            steps.set_postfix_str("tracing target verify graph")
            b, t, p = 2, 3, 5
            ids, pos, mask = _dummy_common(b, t, p)
            rows = torch.tensor([[0, 2]] * b, dtype=torch.long)
            past = [torch.zeros(b, p, tinfo.kv_heads, tinfo.head_dim, dtype=dtype)
                    for _ in range(2 * tinfo.num_layers)]
            _export_graph(TargetVerify(target.model, draft.feature_layers).eval(), (ids, pos, mask, rows, *past), tspec,
                          tmp / f"{C.TARGET_GRAPH}.onnx", sources, wbar)
            steps.update()
            if why_not is None:
                steps.set_postfix_str("tracing fused target graph")
                _export_fused(target, draft.feature_layers, kv_rows, dtype, (ids, pos, mask, rows), fspec, tmp,
                              sources)
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
            _export_graph(DraftStep(head, lim.max_top_k).eval(), (embeds, feats, hidden_in, pos, mask, *dpast),
                          dspec, tmp / f"{C.DRAFT_GRAPH}.onnx", sources, wbar)
            steps.update()
            if options.draft_tree:
                steps.set_postfix_str("tracing draft tree graph")
                last_row = torch.tensor([t - 1, t - 2], dtype=torch.long)[:b]
                feats_all = torch.zeros(b, t, dinfo.feature_dim, dtype=dtype)
                _export_draft_tree(DraftTree(head, lim.max_top_k, tree.top_k, tree.depth).eval(),
                                   (embeds, feats_all, pos, mask, last_row, *dpast), xspec, tmp, sources)
            else:
                steps.set_postfix_str("no draft tree graph")
            steps.update()
        quantization = None
        if options.quantize is not None:
            steps.set_postfix_str(f"quantizing weights to int{options.quantize.bits}")
            graphs = [C.TARGET_GRAPH, C.DRAFT_GRAPH] + ([C.TARGET_FUSED_GRAPH] if why_not is None else []) + (
                [C.DRAFT_TREE_GRAPH] if options.draft_tree else [])
            quantization = quantize_artifact_graphs(tmp, options.quantize, graphs)
            steps.update()
        table = _draft_table(tmp, target, head, sources, dtype)
        steps.set_postfix_str("writing tokenizer and manifest")
        for f in target.tokenizer_files:
            shutil.copy2(f, tmp / f.name)
        gen_cfg = target.path / "generation_config.json"
        if gen_cfg.is_file():
            shutil.copy2(gen_cfg, tmp / gen_cfg.name)
        manifest = Manifest(
            variant=draft.variant, dtype=dtype_name, max_seq_len=seq, tree_limits=lim, tree_defaults=options.tree,
            target=tinfo, draft=dinfo,
            graphs={
                C.TARGET_GRAPH: GraphEntry(f"{C.TARGET_GRAPH}.onnx", tspec, target_axes),
                C.DRAFT_GRAPH: GraphEntry(f"{C.DRAFT_GRAPH}.onnx", dspec, draft_axes),
                **({C.TARGET_FUSED_GRAPH: GraphEntry(f"{C.TARGET_FUSED_GRAPH}.onnx", fspec, fused_axes)}
                   if why_not is None else {}),
                **({C.DRAFT_TREE_GRAPH: GraphEntry(f"{C.DRAFT_TREE_GRAPH}.onnx", xspec, tree_axes)}
                   if options.draft_tree else {}),
            },
            has_tokenizer=any(f.name in ("tokenizer.json", "tokenizer.model") for f in target.tokenizer_files),
            draft_embedding=table,
            versions=_versions(),
            files={f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
            quantization=quantization,
        )
        # The manifest is written last: a directory without one is never mistaken for a finished export.
        manifest.write(tmp)
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
    return ExportReport(out_dir, lean, time.perf_counter() - t_start, peak_rss_bytes(), weights_bytes,
                        sum(f.stat().st_size for f in out_dir.iterdir()))


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
                       sources: dict[int, Source] | None) -> None:
    """Trace the draft tree graph; the weights it shares with the step graph (the head, lm_head) and the target
    graph (the embedding table) are stored once, in their data files."""
    path = directory / f"{C.DRAFT_TREE_GRAPH}.onnx"
    _export_graph(module, args, spec, path, sources)
    share_weights(path, directory / f"{C.DRAFT_GRAPH}.onnx")
    if (directory / (path.name + ".data")).exists():
        share_weights(path, directory / f"{C.TARGET_GRAPH}.onnx")


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

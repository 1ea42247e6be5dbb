"""What an export will write, decided before anything is traced: the capacity, the manifest's target and draft
records, and for each graph its IO spec (``eagle_export/contract.py``) and the dynamic-axis ranges its engines and
sessions must accept; whether the fused target graph can serve this target, and why not.

Pure decisions over the loaded checkpoints and the options; ``exporter.py`` carries them out step by step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_export import contract as C
from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.loaders import LoadedDraft, LoadedTarget
from eagle_export.export.graphs.families import layer_plans, windowed
from eagle_export.manifest import DraftInfo, GraphEntry, TargetInfo
from eagle_export.tree_params import TreeLimits, TreeParams

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048
# The top_k values the export writes a draft tree graph for (contract 6), besides the default tree's: the trees a CPU
# decodes fastest with (docs/tune.md). Each graph grows --max-depth levels; the runtime cuts it to a round's depth.
DEFAULT_TREE_GRAPH_TOP_K = (1, 2, 3, 4)


@dataclass
class GraphPlan:
    """One graph to write: its contract spec and the axis ranges the manifest records for it."""

    spec: C.GraphSpec
    axes: dict[str, list[int]]

    @property
    def file(self) -> str:
        return f"{self.spec.name}.onnx"

    def entry(self) -> GraphEntry:
        return GraphEntry(self.file, self.spec, self.axes)


@dataclass
class ExportPlan:
    """The decisions of one export. ``fused`` is None when that graph is not written (``why_not_fused`` says why);
    ``trees`` has one draft tree graph per top_k, in increasing top_k (empty: none)."""

    dtype_name: str
    seq: int  # the cache capacity (manifest max_seq_len)
    kv_rows: int  # rows of the fused graph's whole-buffer caches: the capacity plus a verify tree
    target_info: TargetInfo
    draft_info: DraftInfo
    target: GraphPlan
    draft: GraphPlan
    fused: GraphPlan | None
    trees: dict[int, GraphPlan]
    why_not_fused: str | None

    def graphs(self) -> dict[str, GraphPlan]:
        """Every graph written, by contract name, in the manifest's order (the order ``export --quantize`` passes
        them in, too)."""
        out = {C.TARGET_GRAPH: self.target, C.DRAFT_GRAPH: self.draft}
        if self.fused is not None:
            out[C.TARGET_FUSED_GRAPH] = self.fused
        for g in self.trees.values():
            out[g.spec.name] = g
        return out


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




def target_capacity(max_seq_len: int | None, target: LoadedTarget) -> int:
    """The cache capacity as the target allows it: ``--max-seq-len``, else min(2048, the target's
    max_position_embeddings); refused past the target's max_position_embeddings. (Without ``--max-seq-len``,
    ``default_max_seq_len`` then lowers it to the head's trained range.)"""
    limit = target.config.max_position_embeddings
    seq = max_seq_len if max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, limit)
    if seq > limit:
        raise CheckpointError(f"--max-seq-len {seq} exceeds the target's max_position_embeddings {limit}")
    return seq


def draft_info(draft: LoadedDraft, draft_dir: str | Path) -> DraftInfo:
    dcfg = draft.config
    dheads = dcfg.num_attention_heads
    return DraftInfo(
        hidden_size=dcfg.hidden_size, num_heads=dheads, kv_heads=dcfg.num_key_value_heads or dheads,
        head_dim=getattr(dcfg, "head_dim", None) or dcfg.hidden_size // dheads,
        feature_dim=draft.feature_dim, vocab_size=draft.vocab_size, d2t_identity=draft.d2t_identity,
        max_position_embeddings=dcfg.max_position_embeddings, fc_bias=draft.fc_bias,
        own_embedding=draft.own_embedding, source=str(Path(draft_dir).resolve()),
        format=draft.format, num_layers=draft.options.num_layers, options=asdict(draft.options),
        feature_layers_source=draft.feature_layers_source, reading=draft.reading,
    )


def tree_graph_top_k(limits: TreeLimits, tree: TreeParams, draft_tree: bool = True,
                     chosen: tuple[int, ...] | None = None) -> list[int]:
    """The top_k values the export writes a draft tree graph for: ``chosen`` (default ``DEFAULT_TREE_GRAPH_TOP_K``)
    and the default tree's, those up to --max-top-k; none without --draft-tree or with --max-depth 0."""
    if not draft_tree or limits.max_depth < 1:
        return []
    ks = DEFAULT_TREE_GRAPH_TOP_K if chosen is None else chosen
    return sorted({k for k in (*ks, tree.top_k) if 1 <= k <= limits.max_top_k})


def make_plan(target: LoadedTarget, draft: LoadedDraft, draft_dir: str | Path, *, dtype_name: str, seq: int,
              limits: TreeLimits, max_batch: int, fused: bool, tree_top_k: list[int]) -> ExportPlan:
    """Every graph's spec and axis ranges for this target, head and capacity (see the module docstring)."""
    tinfo = target_info(target, feature_dim=draft.feature_dim, feature_layers=draft.feature_layers)
    dinfo = draft_info(draft, draft_dir)
    lim = limits
    batch = [1, max_batch]
    verify_rows = lim.max_verify_tokens
    t_new = max(seq, verify_rows)  # a prefill chunk or a verify
    d_new = max(seq, lim.max_top_k, lim.max_context_rows)
    d_past = seq + lim.max_draft_rows
    tspec = C.target_verify_spec(num_layers=tinfo.num_layers, kv_heads=tinfo.kv_heads, head_dim=tinfo.head_dim,
                                 vocab_size=tinfo.vocab_size, feature_dim=tinfo.feature_dim, dtype=dtype_name)
    target_plan = GraphPlan(tspec, {C.BATCH: batch, C.NEW_TOKENS: [1, t_new], C.PAST_LEN: [0, seq - 1],
                                    C.TOTAL_LEN: [1, seq - 1 + t_new], C.LOGIT_ROWS: [1, verify_rows]})
    dspec = C.draft_step_spec(kv_heads=dinfo.kv_heads, head_dim=dinfo.head_dim, hidden_size=dinfo.hidden_size,
                              feature_dim=dinfo.feature_dim, top_k=lim.max_top_k, dtype=dtype_name,
                              num_layers=dinfo.num_layers)
    draft_plan = GraphPlan(dspec, {C.BATCH: batch, C.NEW_TOKENS: [1, d_new], C.FEATURE_ROWS: [0, d_new],
                                   C.HIDDEN_ROWS: [0, lim.max_top_k], C.PAST_LEN: [0, d_past],
                                   C.TOTAL_LEN: [1, d_past + d_new]})
    # The fused graph's caches are whole buffers of a sequence's rows: the committed context plus a verify tree.
    kv_rows = seq + verify_rows
    why_not = (fused_unsupported(tinfo.head_dim, dtype_name, target.model, kv_rows) if fused
               else "not asked for (--no-fused)")
    if why_not is not None and fused:
        log.info("no fused target graph for this target: %s; ONNX Runtime runs the standard graph", why_not)
    fused_plan = None
    if why_not is None:
        fspec = C.target_fused_spec(num_layers=tinfo.num_layers, kv_heads=tinfo.kv_heads, head_dim=tinfo.head_dim,
                                    vocab_size=tinfo.vocab_size, feature_dim=tinfo.feature_dim, dtype=dtype_name)
        fused_plan = GraphPlan(fspec, {C.BATCH: batch, C.NEW_TOKENS: [1, t_new], C.TOTAL_LEN: [1, kv_rows],
                                       C.LOGIT_ROWS: [1, verify_rows], C.CAPACITY: [kv_rows, kv_rows]})
    # One draft tree graph per top_k, each grown --max-depth levels (cut to a round's depth when it runs).
    depth = lim.max_depth
    trees = {}
    for k in tree_top_k:
        xspec = C.draft_tree_spec(kv_heads=dinfo.kv_heads, head_dim=dinfo.head_dim, hidden_size=dinfo.hidden_size,
                                  feature_dim=dinfo.feature_dim, max_top_k=lim.max_top_k, tree_top_k=k,
                                  dtype=dtype_name, num_layers=dinfo.num_layers)
        trees[k] = GraphPlan(xspec, {C.BATCH: batch, C.NEW_TOKENS: [1, d_new], C.PAST_LEN: [0, d_past],
                                     C.TOTAL_LEN: [1, d_past + d_new], C.TREE_TOP_K: [k, k], C.TREE_DEPTH: [1, depth],
                                     C.TREE_CANDIDATES: [k + k * k, k + depth * k * k]})
    draft_positions = seq + lim.max_depth
    if draft_positions > dinfo.max_position_embeddings:
        log.warning(
            "the draft head's max_position_embeddings is %d but with --max-seq-len %d its positions reach %d: "
            "acceptance may drop past position %d (the head was not trained there); output stays lossless, and a "
            "generation that gets there reports it (stats.draft_beyond_position_limit)",
            dinfo.max_position_embeddings, seq, draft_positions, dinfo.max_position_embeddings,
        )
    return ExportPlan(dtype_name, seq, kv_rows, tinfo, dinfo, target_plan, draft_plan, fused_plan, trees,
                      why_not)

"""The graph IO contract: names, dtypes, shapes and axes shared by exporter, engine builder and runtime.

Everything that crosses a graph boundary is named here once. The exporter traces
with these names, the runtime binds by these names, the manifest records the
specs built here, and ``docs/graph-contract.md`` describes them for people.

Conventions (both graphs):
- ``attention_mask`` [batch, new_tokens, past_len + new_tokens] bool, True = may
  attend. Columns [0, past_len) address the bound cache rows, the rest the new
  tokens. One mask over all keys serves prefill (causal), tree verification
  (committed context visible + ancestor-or-self over the tree), batches with
  unequal valid lengths (padding columns False), and the draft tree whose
  earlier levels stay in the draft cache (ancestor columns only).
- K/V cache layout [batch, rows, kv_heads, head_dim] ("BSHD"): with batch 1 the
  valid prefix of a preallocated [1, capacity, kv_heads, head_dim] buffer is a
  contiguous view, so the runtime binds it in place (no copy) and attention
  cost follows the real length, not the capacity.
- ``present_*`` outputs hold only the K/V of the new tokens; the runtime binds
  them to a fixed scratch and copies the rows it keeps into the cache.

Draft step graph inputs (version 2): the draft's new rows come from two sources, the
target's features (``features`` [batch, feature_rows, feature_dim]: fc applied inside the
graph) and the draft's own fed-back output (``hidden_in`` [batch, hidden_rows, hidden_size]:
no fc for EAGLE-3; for EAGLE-1/2 it goes through fc with the token embedding exactly like a
feature row). The new rows are the feature rows followed by the hidden rows, so
``new_tokens = feature_rows + hidden_rows``; the runtime passes ``hidden_rows = 0`` for a
context pass and ``feature_rows = 0`` for a tree level (zero-size inputs). One graph serves
EAGLE-1/2 and EAGLE-3 with the same IO names; only ``feature_dim`` differs (hidden size vs
len(feature_layers) x hidden size).

Version 3: the draft step takes its tokens' embedding rows (``input_embeds`` [batch, new_tokens, hidden_size])
instead of their ids. The table they come from is stored once in the artifact (the target's embedding, in the
target graph's data file, unless the head brings a different one), and the runtime gathers the rows on the host
from a read-only mapping of it (``runtime/embedding.py``; where the table lies: the manifest's
``draft_embedding``). So the draft graph carries no copy of the target's embedding, and on TensorRT no engine
holds it twice.

Version 4 adds the fused target graph (``target_verify_fused``, ONNX Runtime only: ``GroupQueryAttention`` with
rotary inside, ``SkipSimplifiedLayerNormalization``; ``export/graphs/fused.py``). Its cache IO differs: each layer's K
and V are one whole buffer ``[batch, kv_heads, capacity, head_dim]`` (BNSH), bound as both ``past_*`` and ``present_*``
(the same memory); the call writes its ``new_tokens`` rows at rows ``[total_len - new_tokens, total_len)`` of every
sequence and reads rows ``[0, total_len)`` under the mask, so no call copies the cache. The other inputs and outputs
are the standard graph's, with one restriction ONNX Runtime's operator sets: a call over an empty cache (``total_len ==
new_tokens``) is a prefill (causal mask, positions 0 .. new_tokens - 1), and a call that writes more than one row
over a non-empty cache takes one sequence (batch 1). The runtime's calls are so. The standard graph stays for
TensorRT (and for targets the fused operator cannot run);
``graph_for`` says which graph a backend runs.

Version 5 adds the draft tree graph (``draft_tree``, ONNX Runtime; ``export/graphs/draft_tree.py``): a round's draft
work in one call. Its inputs are a context pass's (the step graph's, every new row a feature row, no ``hidden_in``) plus
``last_row`` [batch] (each sequence's last context row, its new root). It runs the context pass, then ``tree_depth``
tree levels of ``tree_top_k`` nodes, choosing each level's frontier inside the graph (the best ``tree_top_k`` of its
``tree_top_k``^2 children by cumulative log-prob, ties to the lower index), and returns every candidate of the tree:
``tree_scores``, ``tree_tokens`` (target ids), ``tree_parents`` (candidate index, -1 the root), each
[batch, tree_candidates] in generation order; the last context row's ``context_topk_logprobs``/``context_topk_ids``
[batch, max_top_k] and ``context_hidden`` [batch, hidden]; and the context rows' ``present_*``. The tree's top_k and
depth are fixed axes of the graph's manifest entry.

Version 6: one draft tree graph per top_k (``draft_tree_k{top_k}``, ``tree_graph``), each grown to the artifact's
``max_depth`` with every level's row count fixed (no shape arithmetic in the graph); a backend runs it cut to a round's
depth (``tree_call``: the first ``depth`` levels, ``runtime/tree_graph.py``), so a round of any depth and of a top_k
the export made a graph for drafts in one call. ``tree_candidates`` is a named axis, ``top_k + depth * top_k^2`` of
the call; the entry's axes give ``tree_top_k`` [k, k], ``tree_depth`` [1, max_depth] and ``tree_candidates``'s range.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CONTRACT_VERSION = 6

# Axis names.
BATCH = "batch"
NEW_TOKENS = "new_tokens"
PAST_LEN = "past_len"
TOTAL_LEN = "total_len"  # past_len + new_tokens
LOGIT_ROWS = "logit_rows"
FEATURE_ROWS = "feature_rows"  # draft: rows fed from target features
HIDDEN_ROWS = "hidden_rows"  # draft: rows fed from the draft's own output (tree levels)
CAPACITY = "capacity"  # fused target graph: rows of each sequence's whole cache buffer
TREE_TOP_K = "tree_top_k"  # draft tree graph: its tree's top_k (a fixed axis: [k, k])
TREE_DEPTH = "tree_depth"  # draft tree graph: the levels it grows, [1, max_depth] (cut to a round's depth)
TREE_CANDIDATES = "tree_candidates"  # draft tree graph: candidates per sequence of a call, top_k + depth * top_k^2

# Graph names (also the ONNX file stems).
TARGET_GRAPH = "target_verify"
DRAFT_GRAPH = "draft_step"
TARGET_FUSED_GRAPH = "target_verify_fused"  # ONNX Runtime's fused variant of the target graph (contract 4)
# ONNX Runtime: a round's context pass and tree levels in one call (contract 5); since contract 6 the prefix of one
# graph per top_k (``tree_graph``), each run cut to a round's depth (``tree_call``).
DRAFT_TREE_GRAPH = "draft_tree"
# The graphs TensorRT builds and runs (standard operators only).
ENGINE_GRAPHS = (TARGET_GRAPH, DRAFT_GRAPH)
# GroupQueryAttention's CPU kernel takes head sizes that are multiples of this (ONNX Runtime 1.31).
FUSED_HEAD_DIM_MULTIPLE = 16

# Inputs shared by both graphs.
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
# Target only.
LOGIT_INDICES = "logit_indices"
# Target outputs.
LOGITS = "logits"
FEATURES = "features"
# Draft only: inputs (its tokens' embedding rows; target features; the draft's own fed-back hidden) and outputs.
INPUT_EMBEDS = "input_embeds"
DRAFT_FEATURES = "features"
HIDDEN_IN = "hidden_in"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"
HIDDEN = "hidden"
# Draft tree graph only.
LAST_ROW = "last_row"
TREE_SCORES = "tree_scores"
TREE_TOKENS = "tree_tokens"
TREE_PARENTS = "tree_parents"
CONTEXT_TOPK_LOGPROBS = "context_topk_logprobs"
CONTEXT_TOPK_IDS = "context_topk_ids"
CONTEXT_HIDDEN = "context_hidden"
# Appended to the TensorRT engines' sources (engines/round_ops.py): the verify tree selected by the tree engine, the
# greedy acceptance computed by the verify engine.
SELECT_TOKENS = "select_tokens"
SELECT_DEPTHS = "select_depths"
SELECT_MASK = "select_mask"
NEXT_IDS = "next_ids"
ACCEPT_COUNT = "accept_count"
ACCEPT_ROWS = "accept_rows"


def past_key(layer: int) -> str:
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def present_key(layer: int) -> str:
    return f"present_key.{layer}"


def present_value(layer: int) -> str:
    return f"present_value.{layer}"


def past_names(num_layers: int) -> list[str]:
    """Flat [k0, v0, k1, v1, ...] order used by the traced modules' positional args."""
    return [n for i in range(num_layers) for n in (past_key(i), past_value(i))]


def present_names(num_layers: int) -> list[str]:
    return [n for i in range(num_layers) for n in (present_key(i), present_value(i))]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "bool", "float32", "float16" ("bfloat16" by name)
    shape: tuple  # ints (fixed) or axis names (dynamic)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """The torch.onnx.export ``dynamic_axes`` argument for this spec."""
        axes: dict[str, dict[int, str]] = {}
        for t in (*self.inputs, *self.outputs):
            dyn = {i: a for i, a in enumerate(t.shape) if isinstance(a, str)}
            if dyn:
                axes[t.name] = dyn
        return axes

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }


def _cache_specs(prefix_fn_k, prefix_fn_v, num_layers: int, kv_heads: int, head_dim: int, dtype: str,
                 rows_axis: str) -> list[TensorSpec]:
    specs = []
    for i in range(num_layers):
        specs.append(TensorSpec(prefix_fn_k(i), dtype, (BATCH, rows_axis, kv_heads, head_dim)))
        specs.append(TensorSpec(prefix_fn_v(i), dtype, (BATCH, rows_axis, kv_heads, head_dim)))
    return specs


def _mask_inputs() -> list[TensorSpec]:
    return [
        TensorSpec(INPUT_IDS, "int64", (BATCH, NEW_TOKENS)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, NEW_TOKENS)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, NEW_TOKENS, TOTAL_LEN)),
    ]


def target_verify_spec(*, num_layers: int, kv_heads: int, head_dim: int, vocab_size: int,
                       feature_dim: int, dtype: str) -> GraphSpec:
    """Target verify graph: prefill and tree verification in one graph."""
    inputs = [
        *_mask_inputs(),
        TensorSpec(LOGIT_INDICES, "int64", (BATCH, LOGIT_ROWS)),
        *_cache_specs(past_key, past_value, num_layers, kv_heads, head_dim, dtype, PAST_LEN),
    ]
    outputs = [
        TensorSpec(LOGITS, "float32", (BATCH, LOGIT_ROWS, vocab_size)),
        TensorSpec(FEATURES, dtype, (BATCH, NEW_TOKENS, feature_dim)),
        *_cache_specs(present_key, present_value, num_layers, kv_heads, head_dim, dtype, NEW_TOKENS),
    ]
    return GraphSpec(TARGET_GRAPH, tuple(inputs), tuple(outputs))


def target_fused_spec(*, num_layers: int, kv_heads: int, head_dim: int, vocab_size: int, feature_dim: int,
                      dtype: str) -> GraphSpec:
    """Fused target graph: the standard graph's IO, with each layer's cache as one whole BNSH buffer bound as both
    ``past_*`` and ``present_*`` (written in place)."""
    std = target_verify_spec(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                             feature_dim=feature_dim, dtype=dtype)
    cache = {n: TensorSpec(n, dtype, (BATCH, kv_heads, CAPACITY, head_dim))
             for n in (*past_names(num_layers), *present_names(num_layers))}
    return GraphSpec(TARGET_FUSED_GRAPH, tuple(cache.get(t.name, t) for t in std.inputs),
                     tuple(cache.get(t.name, t) for t in std.outputs))


def graph_for(backend: str, role: str, available: set[str] | dict) -> str:
    """The graph a backend runs for a role ("target" or "draft"): ONNX Runtime runs the fused target graph when the
    artifact has one; TensorRT (standard operators only) and everything else run the standard graphs."""
    if role == "draft":
        return DRAFT_GRAPH
    if backend == "ort" and TARGET_FUSED_GRAPH in available:
        return TARGET_FUSED_GRAPH
    return TARGET_GRAPH


def draft_step_spec(*, kv_heads: int, head_dim: int, hidden_size: int, feature_dim: int, top_k: int,
                    dtype: str, num_layers: int = 1) -> GraphSpec:
    """Draft step graph: the head over [batch, new_tokens] with top-k inside the graph.

    ``input_embeds`` are the rows of the head's embedding table for its input tokens (gathered by the runtime).

    new_tokens = feature_rows + hidden_rows: rows from target ``features`` first, then rows from the
    fed-back ``hidden_in``. ``topk_ids`` are target-vocabulary ids (EAGLE-3's d2t applied inside).
    A head with several decoder layers has one past/present K/V pair per layer (``num_layers``).
    """
    inputs = [
        TensorSpec(INPUT_EMBEDS, dtype, (BATCH, NEW_TOKENS, hidden_size)),
        TensorSpec(DRAFT_FEATURES, dtype, (BATCH, FEATURE_ROWS, feature_dim)),
        TensorSpec(HIDDEN_IN, dtype, (BATCH, HIDDEN_ROWS, hidden_size)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, NEW_TOKENS)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, NEW_TOKENS, TOTAL_LEN)),
        *_cache_specs(past_key, past_value, num_layers, kv_heads, head_dim, dtype, PAST_LEN),
    ]
    outputs = [
        TensorSpec(TOPK_LOGPROBS, "float32", (BATCH, NEW_TOKENS, top_k)),
        TensorSpec(TOPK_IDS, "int64", (BATCH, NEW_TOKENS, top_k)),
        TensorSpec(HIDDEN, dtype, (BATCH, NEW_TOKENS, hidden_size)),
        *_cache_specs(present_key, present_value, num_layers, kv_heads, head_dim, dtype, NEW_TOKENS),
    ]
    return GraphSpec(DRAFT_GRAPH, tuple(inputs), tuple(outputs))


def tree_graph(top_k: int) -> str:
    """The name (and file stem) of the draft tree graph for trees of ``top_k`` (contract 6)."""
    return f"{DRAFT_TREE_GRAPH}_k{top_k}"


def tree_call(top_k: int, depth: int) -> str:
    """The name a backend runs the draft tree graph of ``top_k`` under, cut to its first ``depth`` levels."""
    return f"{tree_graph(top_k)}_d{depth}"


def parse_tree_call(name: str) -> tuple[int, int] | None:
    """(top_k, depth) of a ``tree_call`` name, None for any other name."""
    prefix = f"{DRAFT_TREE_GRAPH}_k"
    if not name.startswith(prefix):
        return None
    k, sep, d = name[len(prefix):].partition("_d")
    return (int(k), int(d)) if sep and k.isdigit() and d.isdigit() else None


def tree_call_spec(spec: GraphSpec, top_k: int, depth: int) -> GraphSpec:
    """The spec of one ``tree_call``: the draft tree graph's ``spec`` with its candidates axis fixed at
    ``top_k + depth * top_k^2`` (what a TensorRT engine built from the graph cut to ``depth`` levels computes)."""
    n = top_k + depth * top_k * top_k

    def fix(t: TensorSpec) -> TensorSpec:
        return TensorSpec(t.name, t.dtype, tuple(n if d == TREE_CANDIDATES else d for d in t.shape))

    return GraphSpec(tree_call(top_k, depth), tuple(fix(t) for t in spec.inputs), tuple(fix(t) for t in spec.outputs))


def with_acceptance(spec: GraphSpec) -> GraphSpec:
    """The standard target graph's spec with the outputs ``engines/round_ops.append_acceptance`` adds (a verify engine
    built by `build`)."""
    return GraphSpec(spec.name, spec.inputs, (*spec.outputs, TensorSpec(NEXT_IDS, "int64", (BATCH, LOGIT_ROWS)),
                                              TensorSpec(ACCEPT_COUNT, "int64", (BATCH,)),
                                              TensorSpec(ACCEPT_ROWS, "int64", (BATCH, LOGIT_ROWS))))


def with_selection(spec: GraphSpec, select: int) -> GraphSpec:
    """A tree call's spec with the outputs ``engines/round_ops.append_selection`` adds for ``select`` candidates."""
    return GraphSpec(spec.name, spec.inputs, (*spec.outputs, TensorSpec(SELECT_TOKENS, "int64", (BATCH, select)),
                                              TensorSpec(SELECT_DEPTHS, "int64", (BATCH, select)),
                                              TensorSpec(SELECT_MASK, "bool", (BATCH, select, select))))


def is_tree_graph(name: str) -> bool:
    """A draft tree graph's name (``tree_graph``) or a call of one (``tree_call``)."""
    return name == DRAFT_TREE_GRAPH or name.startswith(f"{DRAFT_TREE_GRAPH}_k")


def tree_graphs(graphs) -> dict[int, tuple[str, int]]:
    """The draft tree graphs among a manifest's ``graphs`` (name -> entry with ``axes``): top_k -> (name, the most
    levels it grows)."""
    out = {}
    for name, entry in graphs.items():
        if name.startswith(f"{DRAFT_TREE_GRAPH}_k") and parse_tree_call(name) is None:
            out[entry.axes[TREE_TOP_K][0]] = (name, entry.axes[TREE_DEPTH][1])
    return dict(sorted(out.items()))


def draft_tree_spec(*, kv_heads: int, head_dim: int, hidden_size: int, feature_dim: int, max_top_k: int,
                    tree_top_k: int, dtype: str, num_layers: int = 1) -> GraphSpec:
    """Draft tree graph (contracts 5, 6): a context pass over ``new_tokens`` feature rows, then the tree grown inside
    the graph (``export/graphs/draft_tree.py``). Candidates per sequence (``tree_candidates``): top_k + depth * top_k^2
    of the depth the graph is run to."""
    inputs = [
        TensorSpec(INPUT_EMBEDS, dtype, (BATCH, NEW_TOKENS, hidden_size)),
        TensorSpec(DRAFT_FEATURES, dtype, (BATCH, NEW_TOKENS, feature_dim)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, NEW_TOKENS)),
        TensorSpec(ATTENTION_MASK, "bool", (BATCH, NEW_TOKENS, TOTAL_LEN)),
        TensorSpec(LAST_ROW, "int64", (BATCH,)),
        *_cache_specs(past_key, past_value, num_layers, kv_heads, head_dim, dtype, PAST_LEN),
    ]
    outputs = [
        TensorSpec(TREE_SCORES, "float32", (BATCH, TREE_CANDIDATES)),
        TensorSpec(TREE_TOKENS, "int64", (BATCH, TREE_CANDIDATES)),
        TensorSpec(TREE_PARENTS, "int64", (BATCH, TREE_CANDIDATES)),
        TensorSpec(CONTEXT_TOPK_LOGPROBS, "float32", (BATCH, max_top_k)),
        TensorSpec(CONTEXT_TOPK_IDS, "int64", (BATCH, max_top_k)),
        TensorSpec(CONTEXT_HIDDEN, dtype, (BATCH, hidden_size)),
        *_cache_specs(present_key, present_value, num_layers, kv_heads, head_dim, dtype, NEW_TOKENS),
    ]
    return GraphSpec(tree_graph(tree_top_k), tuple(inputs), tuple(outputs))


def spec_from_dict(d: dict) -> GraphSpec:
    def t(x: dict) -> TensorSpec:
        return TensorSpec(x["name"], x["dtype"], tuple(x["shape"]))

    return GraphSpec(d["name"], tuple(t(x) for x in d["inputs"]), tuple(t(x) for x in d["outputs"]))

"""Optimisation profiles: the manifest's axis ranges + build options -> per-input min/opt/max shapes.

Pure functions, no TensorRT import. Each graph gets two profiles; at run time the backend picks, per
call, the admitting profile with the smallest ``new_tokens`` maximum (``choose_profile``), and keeps
one execution context per profile, so switching costs nothing.

``target_verify``
  0 ``prefill``: prompt chunks. ``new_tokens`` [1, P], ``logit_rows`` 1 (the chunk's last row),
    ``past_len`` [0, S-1] (the first chunk has an empty cache).
  1 ``verify``: tree verification (``new_tokens`` = ``logit_rows`` = total_tokens + 1 <= V) and plain
    decoding (1 token, 1 logit row). ``past_len`` [1, S-1]: a verify always follows a prefill of >= 1 token.

``draft_step`` (rows come from ``features`` or from ``hidden_in``, never both in one call)
  0 ``context``: context passes: a prompt chunk, and the accepted rows after each round (<= Dmax + 2).
    ``new_tokens`` = ``feature_rows`` [1, max(P, Dmax + 2)], ``hidden_rows`` 0, ``past_len`` [0, max].
  1 ``tree``: one tree level, ``new_tokens`` = ``hidden_rows`` [1, K], ``feature_rows`` 0, ``past_len`` [1, max]:
    it follows the prefill.

``draft_tree_k{K}_d{D}`` (a draft tree graph cut to D levels, ``C.tree_call``; rows are all feature rows)
  0 ``prefill``: a prompt chunk's context pass (it grows the first round's tree), ``new_tokens`` [1, max(P, Dmax +
    2)] (also a lagging request's catch-up pass), ``past_len`` [0, max].
  1 ``round``: the context pass after a round (the accepted rows and the bonus, ``new_tokens`` [1, Dmax + 2]) that
    grows the next round's tree, ``past_len`` [1, max]; batch [1, B].
  Built for each top_k among the artifact's default trees (``tree_defaults`` and the per-batch table), at the deepest
  depth they use (``tree_engine_calls``): a shallower tree of that top_k reads the first levels' candidates.

Ranges: P = ``--max-prefill`` (default min(256, S), the runtime's prefill chunk), V = ``--max-tree-tokens``
(default ``max_total_tokens`` + 1), B = ``--max-batch`` (default: the artifact's, ``export --max-batch``),
S = ``max_seq_len``, K = ``max_top_k``, Dmax = ``max_depth``;
``past_len`` maxima are the manifest's (the exporter's contract), ``batch`` is [1, ``--max-batch``] = [1, B].
``total_len`` is always ``past_len + new_tokens``, at min, opt and max alike (the attention mask's last
dim is that sum inside the graph: a profile that broke it would violate the graph's shape constraints).

Opt (the shapes TensorRT tunes for), chosen deliberately:
- prefill: a full chunk (``new_tokens`` = P) on an empty cache (``past_len`` 0): the common case of a
  prompt that fits one chunk;
- verify: the artifact's default tree (``tree_defaults.total_tokens`` + 1 rows, all with logits) at half
  the capacity (``past_len`` = (S-1) // 2), the average position over a long generation;
- draft tree: one tree level of the default ``top_k`` at half the capacity.
- batch: B (a full batch) for verify and tree levels, the calls a batched runtime makes once per round for all
  its sequences; 1 for prefill and context, because a joining request's prompt is prefilled alone (its chunks
  and their draft context passes), which is what those profiles' opt (a full chunk) describes.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle_export import contract as C
from eagle_export.errors import EngineError
from eagle_export.manifest import GraphEntry, Manifest

DEFAULT_MAX_PREFILL = 256  # the runtime's default prefill chunk


@dataclass(frozen=True)
class ProfileOptions:
    """Build options that shape the profiles. None: the default described in the module docstring."""

    max_batch: int | None = None
    max_prefill: int | None = None
    max_tree_tokens: int | None = None


@dataclass(frozen=True)
class ResolvedOptions:
    max_batch: int
    max_prefill: int
    max_tree_tokens: int

    def to_dict(self) -> dict:
        return {"max_batch": self.max_batch, "max_prefill": self.max_prefill, "max_tree_tokens": self.max_tree_tokens}


@dataclass
class Profile:
    """One optimisation profile: axis points and the input shapes they give."""

    name: str
    axes: dict[str, tuple[int, int, int]]  # axis -> (min, opt, max)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)

    def admits(self, axis_values: dict[str, int]) -> bool:
        return all(lo <= axis_values[a] <= hi for a, (lo, _, hi) in self.axes.items() if a in axis_values)

    def range_text(self) -> str:
        return ", ".join(f"{a} {lo}/{opt}/{hi}" for a, (lo, opt, hi) in self.axes.items())

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "axes": {a: list(v) for a, v in self.axes.items()},
            "shapes": {n: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for n, s in self.shapes.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(
            name=d["name"],
            axes={a: tuple(int(x) for x in v) for a, v in d["axes"].items()},
            shapes={n: (tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])) for n, s in d["shapes"].items()},
        )


def _check_range(what: str, value: int, lo: int, hi: int, why: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise EngineError(f"{what} must be an integer in [{lo}, {hi}] ({why}), got {value!r}")
    return value


def resolve_options(manifest: Manifest, opts: ProfileOptions | None = None) -> ResolvedOptions:
    """Fill defaults and check the options against the artifact's limits (EngineError naming the flag)."""
    opts = opts or ProfileOptions()
    t_axes = manifest.graphs[C.TARGET_GRAPH].axes
    d_axes = manifest.graphs[C.DRAFT_GRAPH].axes
    batch_hi = min(t_axes[C.BATCH][1], d_axes[C.BATCH][1])
    max_batch = opts.max_batch if opts.max_batch is not None else batch_hi  # default: what `export --max-batch` set
    _check_range("--max-batch", max_batch, 1, batch_hi, "the artifact's batch range at export")
    seq = manifest.max_seq_len
    prefill_hi = min(t_axes[C.NEW_TOKENS][1], d_axes[C.NEW_TOKENS][1], seq)
    max_prefill = opts.max_prefill if opts.max_prefill is not None else min(DEFAULT_MAX_PREFILL, prefill_hi)
    _check_range("--max-prefill", max_prefill, 1, prefill_hi, "prompt tokens per prefill chunk, at most max_seq_len")
    verify_hi = t_axes[C.LOGIT_ROWS][1]  # max_total_tokens + 1
    max_tree = opts.max_tree_tokens if opts.max_tree_tokens is not None else verify_hi
    _check_range("--max-tree-tokens", max_tree, 2, verify_hi,
                 "tokens one verify checks: root + draft nodes, at most the artifact's --max-total-tokens + 1")
    return ResolvedOptions(max_batch, max_prefill, max_tree)


def input_shapes(entry: GraphEntry, point: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every input's shape at one axis point (fixed dims from the spec, named dims from ``point``)."""
    return {t.name: tuple(point[d] if isinstance(d, str) else d for d in t.shape) for t in entry.spec.inputs}


def make_profile(name: str, entry: GraphEntry, axes: dict[str, tuple[int, int, int]]) -> Profile:
    """Complete ``axes`` with total_len = past_len + new_tokens (at min, opt, max) and compute input shapes."""
    axes = dict(axes)
    axes[C.TOTAL_LEN] = tuple(p + n for p, n in zip(axes[C.PAST_LEN], axes[C.NEW_TOKENS], strict=True))
    for a, (lo, opt, hi) in axes.items():
        if not lo <= opt <= hi:
            raise EngineError(f"profile {name}: axis {a} needs min <= opt <= max, got {lo}/{opt}/{hi}")
    points = [{a: v[i] for a, v in axes.items()} for i in range(3)]
    per_point = [input_shapes(entry, p) for p in points]
    shapes = {n: (per_point[0][n], per_point[1][n], per_point[2][n]) for n in per_point[0]}
    return Profile(name, axes, shapes)


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def graph_profiles(manifest: Manifest, graph: str, opts: ResolvedOptions) -> list[Profile]:
    """The two profiles of ``graph`` (see the module docstring), in engine profile index order."""
    entry = manifest.graphs[graph]
    past_hi = entry.axes[C.PAST_LEN][1]
    seq = manifest.max_seq_len
    mid = _clamp((seq - 1) // 2, 1, past_hi)
    batch = (1, 1, opts.max_batch)  # prefill, context: one joining request's prompt chunks
    full = (1, opts.max_batch, opts.max_batch)  # verify, tree levels: every active sequence in one call
    p = opts.max_prefill
    if graph == C.TARGET_GRAPH:
        v = opts.max_tree_tokens
        t_opt = _clamp(manifest.tree_defaults.total_tokens + 1, 1, v)
        return [
            make_profile("prefill", entry, {C.BATCH: batch, C.NEW_TOKENS: (1, p, p), C.PAST_LEN: (0, 0, past_hi),
                                            C.LOGIT_ROWS: (1, 1, 1)}),
            make_profile("verify", entry, {C.BATCH: full, C.NEW_TOKENS: (1, t_opt, v), C.PAST_LEN: (1, mid, past_hi),
                                           C.LOGIT_ROWS: (1, t_opt, v)}),
        ]
    if graph == C.DRAFT_GRAPH:
        # Rows come either all from target features (context passes) or all from the draft's own hidden
        # (tree levels): feature_rows + hidden_rows = new_tokens must hold at every point, so one profile each.
        lim = manifest.tree_limits
        k_hi = lim.max_top_k
        k_opt = _clamp(manifest.tree_defaults.top_k, 1, k_hi)
        c_hi = max(p, lim.max_context_rows)  # a prompt chunk, or the accepted rows + bonus after a round
        return [
            make_profile("context", entry, {C.BATCH: batch, C.NEW_TOKENS: (1, p, c_hi), C.FEATURE_ROWS: (1, p, c_hi),
                                            C.HIDDEN_ROWS: (0, 0, 0), C.PAST_LEN: (0, 0, past_hi)}),
            make_profile("tree", entry, {C.BATCH: full, C.NEW_TOKENS: (1, k_opt, k_hi), C.FEATURE_ROWS: (0, 0, 0),
                                         C.HIDDEN_ROWS: (1, k_opt, k_hi), C.PAST_LEN: (1, mid, past_hi)}),
        ]
    raise EngineError(f"no profiles are defined for graph {graph!r}")


def default_trees(manifest: Manifest) -> list:
    """The trees an artifact drafts with by default: ``tree_defaults`` and the per-batch table's rows that draft, as
    the runtime drafts them (``TreeParams.trimmed``: no level that no verify tree reaches)."""
    trees = [manifest.tree_defaults]
    if manifest.batch_trees is not None:
        trees += [r.tree for r in manifest.batch_trees.rows if r.tree is not None]
    return [t.trimmed() for t in trees]


def tree_engine_calls(manifest: Manifest) -> list[tuple[int, int]]:
    """(top_k, depth) of the draft tree graph calls ``build`` makes engines of: per top_k among the artifact's
    default trees (``tree_defaults``, the per-batch table's rows) that has a tree graph, the deepest depth they use
    (within the graph's levels). A tree set later (another ``tune``) drafts level by level until the next build. None
    for a quantized draft: its tree graphs hold ONNX Runtime's ``MatMulNBits`` (its step graph the standard
    dequantizing operators TensorRT builds)."""
    q = manifest.quantization
    if q is not None and q.draft:
        return []
    graphs = C.tree_graphs(manifest.graphs)
    deepest: dict[int, int] = {}
    for t in default_trees(manifest):
        if t.top_k in graphs and 1 <= t.depth <= graphs[t.top_k][1]:
            deepest[t.top_k] = max(deepest.get(t.top_k, 0), t.depth)
    return sorted(deepest.items())


def select_count(manifest: Manifest, top_k: int, depth: int) -> int:
    """How many candidates a tree engine of ``(top_k, depth)`` selects as its verify tree (``round_ops``): the most
    draft tokens a default tree of that top_k and depth verifies (a tree of fewer takes the best of them), else the
    default trees' of that top_k; at most the candidates it grows."""
    trees = default_trees(manifest)
    same = [t.total_tokens for t in trees if t.top_k == top_k and t.depth == depth]
    most = max(same or [t.total_tokens for t in trees if t.top_k == top_k])
    return min(most, top_k + depth * top_k * top_k)


def tree_profiles(manifest: Manifest, top_k: int, depth: int, opts: ResolvedOptions) -> list[Profile]:
    """The two profiles of the draft tree graph call ``C.tree_call(top_k, depth)`` (module docstring)."""
    entry = manifest.graphs[C.tree_graph(top_k)]
    past_hi = entry.axes[C.PAST_LEN][1]
    mid = _clamp((manifest.max_seq_len - 1) // 2, 1, past_hi)
    p, b = opts.max_prefill, opts.max_batch
    ctx_hi = manifest.tree_limits.max_context_rows
    c_hi = max(p, ctx_hi)
    ctx_opt = _clamp(manifest.tree_defaults.depth + 1, 1, ctx_hi)  # a round that accepted about its depth
    return [
        make_profile("prefill", entry, {C.BATCH: (1, 1, b), C.NEW_TOKENS: (1, p, c_hi), C.PAST_LEN: (0, 0, past_hi)}),
        make_profile("round", entry, {C.BATCH: (1, b, b), C.NEW_TOKENS: (1, ctx_opt, ctx_hi),
                                      C.PAST_LEN: (1, mid, past_hi)}),
    ]


def choose_profile(profiles: list[Profile], axis_values: dict[str, int]) -> int | None:
    """Index of the admitting profile with the smallest new_tokens maximum (ties: lower index), or None."""
    fits = [i for i, p in enumerate(profiles) if p.admits(axis_values)]
    if not fits:
        return None
    return min(fits, key=lambda i: (profiles[i].axes[C.NEW_TOKENS][2], i))

"""Tree parameters of the EAGLE-2 dynamic tree: one definition, validated once.

Naming follows the EAGLE-2 reference (SafeAILab EAGLE's ``top_k``, ``depth``, ``total_token``) and
docs/runtime.md: ``total_tokens`` counts draft nodes only; the target
verifies ``total_tokens + 1`` tokens (the root too). ``depth`` is the number of
draft forwards after the context pass, so the deepest node sits at level
``depth + 1``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import GenerationError


def candidate_count(top_k: int, depth: int) -> int:
    """Draft nodes of a tree grown ``depth`` levels below the root's ``top_k`` children, before selection: the root's
    top_k children, then top_k children of each of a level's top_k frontier nodes."""
    return top_k + depth * top_k * top_k


TREE_KEYS = ("top_k", "depth", "total_tokens")  # every tree's keys in the manifest and the APIs
THRESHOLD_KEY = "threshold"  # optional: written only when not 0, so untuned manifests keep their three keys


@dataclass(frozen=True)
class TreeParams:
    top_k: int = 4
    depth: int = 3
    total_tokens: int = 12
    # Verify width from the draft's confidence: a draft node joins the verify tree only if its path's cumulative draft
    # probability (exp of its score) is at least this; the tree is then the best total_tokens of those (0 nodes: the
    # round verifies the root alone). 0 (the default) selects total_tokens nodes every round.
    threshold: float = 0.0

    @property
    def max_candidates(self) -> int:
        """Number of draft nodes one round generates before selection."""
        return candidate_count(self.top_k, self.depth)

    def trimmed(self) -> TreeParams:
        """The same tree without the draft levels no verify tree can reach. Selection keeps a node only with its
        ancestors (a child's cumulative score is at most its parent's, and ties go to the parent), so a node at level
        L (the root's children are level 1) is verified only if total_tokens >= L: levels below total_tokens are grown
        and never verified. ``depth`` is cut to ``total_tokens - 1``: the same verify trees, bit for bit, for fewer
        draft passes (a chain 1/8/8 is 1/7/8: one draft pass of nine saved every round). Not below 1: a tree of depth
        1 or more keeps the draft tree graph, which has no depth 0 (a depth-0 tree's context pass runs the step
        graph, a session of its own)."""
        depth = min(self.depth, max(self.total_tokens - 1, 1))
        return self if depth == self.depth else replace(self, depth=depth)

    @property
    def verify_tokens(self) -> int:
        """Tokens the target verifies per round (root included)."""
        return self.total_tokens + 1

    def validate(self, limits: TreeLimits | None = None) -> TreeParams:
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise GenerationError(f"tree parameter {name} must be an integer, got {value!r}")
        if self.top_k < 1:
            raise GenerationError(f"top_k must be >= 1, got {self.top_k}")
        if self.depth < 0:
            raise GenerationError(f"depth must be >= 0, got {self.depth}")
        if self.total_tokens < 1:
            raise GenerationError(f"total_tokens must be >= 1, got {self.total_tokens}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:  # NaN fails too
            raise GenerationError(f"tree threshold must be a probability in [0, 1], got {t!r}")
        if self.total_tokens > self.max_candidates:
            raise GenerationError(
                f"total_tokens={self.total_tokens} exceeds the {self.max_candidates} draft nodes a tree with "
                f"top_k={self.top_k}, depth={self.depth} generates (top_k + depth*top_k^2)"
            )
        if limits is not None:
            limits.check(self)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.threshold:
            del d[THRESHOLD_KEY]
        return d

    @property
    def label(self) -> str:
        """'top_k 2, depth 4, total_tokens 8' (and ', threshold 0.05' when set), for reports and messages."""
        text = f"top_k {self.top_k}, depth {self.depth}, total_tokens {self.total_tokens}"
        return text + (f", threshold {self.threshold:g}" if self.threshold else "")

    @classmethod
    def from_dict(cls, d: dict) -> TreeParams:
        """From a manifest's or a request's object: keys top_k, depth, total_tokens and optionally threshold (a
        GenerationError naming the keys otherwise); validate() checks the values."""
        if not isinstance(d, dict) or not set(TREE_KEYS) <= set(d) or set(d) - {*TREE_KEYS, THRESHOLD_KEY}:
            raise GenerationError(f"a tree must be an object with keys top_k, depth, total_tokens (and optionally "
                                  f"threshold), got {d!r}")
        return cls(**d)


def tree_over_defaults(d: TreeParams, top_k: int | None, depth: int | None, total_tokens: int | None,
                       threshold: float | None = None) -> TreeParams:
    """The tree whose given fields replace those of ``d`` (a manifest's tree_defaults)."""
    return TreeParams(top_k if top_k is not None else d.top_k, depth if depth is not None else d.depth,
                      total_tokens if total_tokens is not None else d.total_tokens,
                      threshold if threshold is not None else d.threshold)


@dataclass(frozen=True)
class TreeLimits:
    """Upper bounds fixed at export time (graph top-k width, scratch rows in the caches)."""

    max_top_k: int = 10
    max_depth: int = 8
    max_total_tokens: int = 63

    def check(self, params: TreeParams) -> None:
        for name, limit in (("top_k", self.max_top_k), ("depth", self.max_depth),
                            ("total_tokens", self.max_total_tokens)):
            value = getattr(params, name)
            if value > limit:
                flag = "--max-" + name.replace("_", "-")
                raise GenerationError(
                    f"{name}={value} exceeds the artifact's limit {limit} (set at export with {flag})"
                )

    # The sizes every part derives from the limits (exporter axes, generator buffers, engine profiles): here once.
    @property
    def max_verify_tokens(self) -> int:
        """Tokens one verify checks at most: the root and every draft node (the target's logit rows)."""
        return self.max_total_tokens + 1

    @property
    def max_context_rows(self) -> int:
        """Rows of the draft's context pass after a round, at most: the root and up to max_depth + 1 accepted nodes
        (the deepest level is depth + 1), each fed with the token after it (the last with the bonus token)."""
        return self.max_depth + 2

    @property
    def max_draft_rows(self) -> int:
        """Draft-cache rows one round's tree can occupy beyond the committed context."""
        return self.max_depth * self.max_top_k

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BatchTree:
    """One row of a per-batch table: from ``active`` sequences in a round on (up to the next row), rounds use
    ``tree``; None: no draft (plain one-token rounds, where batched plain decoding was measured faster)."""

    active: int
    tree: TreeParams | None
    speedup: float | None = None  # what `tune` measured for it against batched plain decoding (informational)

    def to_dict(self) -> dict:
        d: dict = {"active": self.active, "tree": None if self.tree is None else self.tree.to_dict()}
        if self.speedup is not None:
            d["speedup"] = self.speedup
        return d


@dataclass(frozen=True)
class BatchTrees:
    """The tree per number of active sequences (`eagle-export tune --batch-sizes`, manifest key ``batch_trees``):
    rows sorted by ``active``, the first for 1 sequence. A round of A sequences uses the row with the largest
    ``active`` <= A (counts between measured ones take the smaller one's tree; above the last, the last's)."""

    rows: tuple[BatchTree, ...]

    def pick(self, active: int) -> TreeParams | None:
        """The tree of a round with ``active`` sequences (None: no draft)."""
        chosen = self.rows[0]
        for row in self.rows:
            if row.active > active:
                break
            chosen = row
        return chosen.tree

    def trees(self) -> list[TreeParams]:
        """The table's distinct trees (no-draft rows left out)."""
        return list(dict.fromkeys(r.tree for r in self.rows if r.tree is not None))

    def to_list(self) -> list[dict]:
        return [r.to_dict() for r in self.rows]

    @classmethod
    def from_list(cls, raw, limits: TreeLimits | None = None) -> BatchTrees:
        """Parse and check the manifest's list; any problem is a GenerationError naming the row and the fix."""
        if not isinstance(raw, list) or not raw:
            raise GenerationError(f"batch_trees must be a non-empty list of {{active, tree}} rows, got {raw!r}")
        rows: list[BatchTree] = []
        for i, r in enumerate(raw):
            where = f"batch_trees[{i}]"
            if not isinstance(r, dict) or not {"active", "tree"} <= set(r) or set(r) - {"active", "tree", "speedup"}:
                raise GenerationError(f"{where} must be an object with keys active, tree (and optionally speedup), "
                                      f"got {r!r}")
            active = r["active"]
            if not isinstance(active, int) or isinstance(active, bool) or active < 1:
                raise GenerationError(f"{where}.active must be an integer >= 1, got {active!r}")
            if rows and active <= rows[-1].active:
                raise GenerationError(f"{where}.active {active} must be larger than the row before's "
                                      f"({rows[-1].active}): rows are sorted by active sequences")
            t = r["tree"]
            if t is None:
                tree = None
            elif isinstance(t, dict) and set(TREE_KEYS) <= set(t) <= {*TREE_KEYS, THRESHOLD_KEY}:
                try:
                    tree = TreeParams(**t).validate(limits)
                except GenerationError as e:
                    raise GenerationError(f"{where}.tree: {e}") from None
            else:
                raise GenerationError(f"{where}.tree must be null (no draft) or {{top_k, depth, total_tokens}} "
                                      f"(and optionally threshold), got {t!r}")
            speedup = r.get("speedup")
            if speedup is not None and (isinstance(speedup, bool) or not isinstance(speedup, (int, float))):
                raise GenerationError(f"{where}.speedup must be a number, got {speedup!r}")
            rows.append(BatchTree(active, tree, None if speedup is None else float(speedup)))
        if rows[0].active != 1:
            raise GenerationError(f"batch_trees must start at active 1 (one sequence), got {rows[0].active}")
        return cls(tuple(rows))

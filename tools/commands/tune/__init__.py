"""`eagle-export tune`: measure EAGLE over a grid of tree settings on this backend and machine, pick the best.

    from eagle_export.tools.commands.tune import tune, write_winner
    report = tune("artifacts/tiny", max_new_tokens=32, threads=1)
    print(report.format())            # or json.dumps(report.to_dict())
    write_winner("artifacts/tiny", report)   # tree_defaults <- the winner, plus a `tuned` record

It runs on bench's measuring core (tools/commands/bench/ ``PairedSession``): one runtime, opened once, with the timing
proxy; for every tree setting and every prompt one greedy EAGLE generation and one greedy no-draft generation run
one right after the other (alternating which goes first), EOS ignored. So each setting's speedup is a median of
side-by-side ratios, comparable across settings measured minutes apart on a drifting machine, while absolute
tokens/s are not. Settings are ranked by that speedup (ties: EAGLE tokens/s).

Every setting runs on the path the runtime will run it on: a round drafts in one call with the artifact's draft tree
graph for its top_k, cut to its depth (contract 6), where the export made one, level by level with the step graph
otherwise; each row says which (``path``), and each setting drafts once, untimed, before it is measured
(``PairedSession.prepare``), so opening its graph is not in its time. Settings are measured grouped by (top_k, depth):
each cut graph opens once.

The search has two stages (see docs/tune.md):

1. the grid: every (top_k, depth, total_tokens) of the given lists that is a valid tree (``TreeParams.validate``:
   total_tokens at most top_k + depth * top_k^2), within the artifact's tree limits and, on TensorRT, within
   the engines' verify profile; the others are skipped and counted. With more than one prompt (and ``screen``, the
   default) every setting is first measured on the first half of the prompts; only the best third (at least
   ``SCREEN_KEEP_MIN``), and any within ``SCREEN_MARGIN`` of the best, are measured on the rest, the others are
   reported as dropped and ranked after them;
2. refinement (unless ``refine=False``): around the stage-1 winner, one dimension at a time, the integer
   midpoints to its neighbouring grid values (and half the smallest value when the winner sits on it) that are
   valid and not measured yet: at most 2 per dimension (none for a dimension given one value).

3. thresholds (``thresholds``, default ``DEFAULT_THRESHOLDS``): the best tree so far again with each verify-width
   threshold (``TreeParams.threshold``: draft nodes whose cumulative draft probability is below it are not verified).

Then the best ``confirm`` settings (default 3) are measured ``CONFIRM_PASSES`` more times, interleaved, and ranked
over all their runs, so that one lucky pass does not decide the winner. Every setting runs with the speculation guard
off (runtime/guard.py), so that it is ranked by what it does when it drafts; the winner is then measured once more
with the guard on (its default), as the runtime will run it, and that speedup is the one reported for the default
(``TuneReport.as_run``, the ``tuned`` record's ``speedup_as_run``). The winner becomes ``tree_defaults``;
if it does not beat plain decoding by ``min_speedup`` (default ``MIN_SPEEDUP``), the default is no draft: the
manifest's ``batch_trees`` row for one sequence says so (``null``), and requests given no tree decode plainly.

Before them, on ONNX Runtime, a spin stage (``spin="auto"``, the default) picks the intra-op threads' spin policy
(``SPIN_CANDIDATES``; docs/runtime.md, Threading): the artifact's current default tree with each policy, one runtime
per policy opened in turn (a session's policy is fixed when it is made), the order reversed on every other repeat,
ranked by EAGLE tokens/s. Which policy wins depends on the CPU (measured in docs/runtime.md), so it is measured, used
for the stages after it, and written into the ``tuned`` record, where the runtime reads its default. Where the verdict
is no draft at every batch size measured, the record keeps instead the policy with the most no-draft tokens/s in that
stage (``TuneReport.recorded_spin``): the artifact then decodes plainly by default.

With ``batch_sizes`` (the command's ``--batch-sizes``, default 1, 2, 4, ... up to the artifact's --max-batch), a
third stage measures, at each number of concurrent sequences N >= 2, a ladder of the best tree of each size against
batched plain decoding (tools/commands/tune/batch.py), and ``write_winner`` also writes the per-batch table
``batch_trees`` (N = 1: the single-sequence winner, or no draft if it is not ``min_speedup`` faster than plain
decoding; N >= 2 the same against batched plain decoding).

Every setting must be lossless (EAGLE's tokens equal no-draft's on every prompt and repeat); a lossy one is
reported and never chosen, and ``write_winner`` refuses a report holding one.
"""

from __future__ import annotations

import datetime as _dt
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle_export.errors import EagleExportError
from eagle_export.tools.commands.bench import (
    Divergence,
    PairedSession,
    PromptRow,
    PromptSpec,
    check_run_settings,
    require_matplotlib,
    save_figure,
    tau_of,
)
from eagle_export.tree_params import BatchTree, BatchTrees, TreeParams

from .batch import SizeRow, default_sizes, format_rows, ladder, tune_batch

if TYPE_CHECKING:
    from eagle_export.manifest import Manifest

# Default grid: from chains (top_k 1) to the wide trees used on GPUs (top_k 8, 60 nodes). Depth 3, 5-7 and
# total_tokens between the listed values are reached by the refinement around the winner.
DEFAULT_TOP_K = (1, 2, 4, 8)
DEFAULT_DEPTH = (2, 4, 8)
DEFAULT_TOTAL_TOKENS = (4, 8, 16, 32, 60)
# The default grid on an artifact whose verify cost grows fast with its rows and where only chains are token-exact
# (ONNX Runtime with MatMulNBits rounding the activations, e.g. int4 at accuracy level 4: a 13-token verify costs
# several 1-token steps on a CPU core): chains and 2-wide trees of 3-6 verify tokens (top_k 2 with --inexact-trees).
NARROW_TOP_K = (1, 2)
NARROW_DEPTH = (1, 2, 3, 4, 5)
NARROW_TOTAL_TOKENS = (2, 3, 4, 5)
RANKED_BY = "speedup"
ValuesArg = str | Sequence[int]  # "1,2,4", "2-8", or ints


# The spin stage's candidates: the runtime's per-phase default, spin while every call runs, never spin, and the
# target's threads spinning on after its calls. That last one loses EAGLE rounds (the draft's threads compete with the
# target's spinning ones) but can win plain decoding, whose target calls follow each other with only the host's work
# between them: where the verdict is no draft at every batch size, the record keeps the policy fastest for plain
# decoding (``TuneReport.recorded_spin``).
SPIN_CANDIDATES = ("target=run,draft=off", "run", "off", "target=on,draft=off")


# Extra passes over the prompts for each of the best settings (``confirm``), after the grid and the refinement.
CONFIRM_PASSES = 2

# The grid's screen: the settings measured on the rest of the prompts after the first half, the best third by
# speedup, at least this many, and any within this fraction of the best's speedup.
SCREEN_KEEP_MIN = 5
SCREEN_MARGIN = 0.15

TREE_PATH, STEP_PATH = "tree graph", "step graph"

# A tree becomes the default only if it beats plain decoding by this much (median of side-by-side ratios); else the
# artifact's default is no draft. A tree at 1.02x on a tuning run can be at 0.95x in the next one on a noisy machine.
MIN_SPEEDUP = 1.05

# The threshold stage: the best tree again with these verify-width thresholds (TreeParams.threshold).
DEFAULT_THRESHOLDS = (0.01, 0.05)


class TuneError(EagleExportError):
    """A bad tune request: a malformed list, an empty grid, a report that cannot be written."""


def parse_list(text: ValuesArg, option: str, minimum: int) -> tuple[int, ...]:
    """'1,2,4' or '2-5' or '1,3-4' (or a sequence of ints) -> sorted distinct values, each >= minimum."""
    if isinstance(text, str):
        values: list = []
        for part in text.replace(" ", "").split(","):
            m = re.fullmatch(r"(\d+)-(\d+)", part)
            if m:
                lo, hi = int(m[1]), int(m[2])
                if lo > hi:
                    raise TuneError(f"{option}: the range {part!r} is empty (write LOW-HIGH)")
                values += range(lo, hi + 1)
                continue
            try:
                values.append(int(part))
            except ValueError:
                raise TuneError(f"{option} must be comma-separated integers or ranges like 2-5, got {text!r}") from None
    else:
        values = list(text)
    if not values:
        raise TuneError(f"{option} is empty: give at least one value")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise TuneError(f"{option} values must be integers >= {minimum}, got {v!r}")
    return tuple(sorted(set(values)))


def parse_thresholds(text: str | Sequence[float] | None) -> tuple[float, ...]:
    """'0.01,0.05' (or floats) -> sorted distinct thresholds in (0, 1]; None: DEFAULT_THRESHOLDS; '0' or '': none."""
    if text is None:
        return DEFAULT_THRESHOLDS
    if isinstance(text, str):
        parts = [p for p in text.replace(" ", "").split(",") if p]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise TuneError(f"--thresholds must be comma-separated numbers in [0, 1], got {text!r}") from None
    else:
        values = list(text)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise TuneError(f"--thresholds values must be numbers in [0, 1], got {v!r}")
    return tuple(sorted({float(v) for v in values if v > 0}))


@dataclass(frozen=True)
class Grid:
    top_k: tuple[int, ...] = DEFAULT_TOP_K
    depth: tuple[int, ...] = DEFAULT_DEPTH
    total_tokens: tuple[int, ...] = DEFAULT_TOTAL_TOKENS

    @classmethod
    def parse(cls, top_k: ValuesArg | None = None, depth: ValuesArg | None = None,
              total_tokens: ValuesArg | None = None, narrow: bool = False) -> Grid:
        """Lists as given on the command line (None: the default list; ``narrow``: the NARROW_* lists)."""
        dk, dd, dt = ((NARROW_TOP_K, NARROW_DEPTH, NARROW_TOTAL_TOKENS) if narrow
                      else (DEFAULT_TOP_K, DEFAULT_DEPTH, DEFAULT_TOTAL_TOKENS))
        return cls(dk if top_k is None else parse_list(top_k, "--top-k", 1),
                   dd if depth is None else parse_list(depth, "--depth", 0),
                   dt if total_tokens is None else parse_list(total_tokens, "--total-tokens", 1))

    def settings(self) -> list[TreeParams]:
        return [TreeParams(k, d, n) for k in self.top_k for d in self.depth for n in self.total_tokens]

    def to_dict(self) -> dict:
        return {"top_k": list(self.top_k), "depth": list(self.depth), "total_tokens": list(self.total_tokens)}


SAME_TREES = "the verify trees of a shallower setting: levels below total_tokens are never verified"
INEXACT = "branching: not token-exact at this artifact's accuracy level (--inexact-trees)"


def admissible(tree: TreeParams, session: PairedSession, inexact_trees: bool = False) -> str | None:
    """None when the tree can run on the session's artifact and backend, else why not (a short reason).

    On ONNX Runtime, an artifact whose MatMulNBits round the activations (``QuantizationInfo.rounds_activations``)
    runs EAGLE token-exact on chains only: branching trees are tried with ``inexact_trees`` alone, and a divergence
    they cause is reported (tools/lab/results.md, "Why quantized EAGLE diverged")."""
    if tree.total_tokens > tree.max_candidates:
        return "total_tokens > top_k + depth*top_k^2"
    q = session.manifest.quantization
    if tree.top_k > 1 and not inexact_trees and session.backend == "ort" and q is not None and q.rounds_activations:
        return INEXACT
    limits = session.manifest.tree_limits
    if (tree.top_k > limits.max_top_k or tree.depth > limits.max_depth
            or tree.total_tokens > limits.max_total_tokens):
        return "above the artifact's tree limits"
    try:
        session.check_tree(tree)
    except EagleExportError:
        return "does not fit the engines"
    return None


def refinements(best: TreeParams, grid: Grid, done: set[TreeParams], session: PairedSession,
                inexact_trees: bool = False) -> list[TreeParams]:
    """Stage 2: around BEST, one dimension at a time, the midpoints to its neighbours in the grid's list (and half
    the smallest value when BEST is at or below it), valid and not measured yet (as trimmed: ``TreeParams.trimmed``;
    BEST's depth may be a trimmed one, between the list's)."""
    out: list[TreeParams] = []
    for name, values, low in (("top_k", grid.top_k, 1), ("depth", grid.depth, 0),
                              ("total_tokens", grid.total_tokens, 1)):
        v = getattr(best, name)
        below, above = [x for x in values if x < v], [x for x in values if x > v]
        cands = []
        if below:
            cands.append((max(below) + v) // 2)
        elif len(values) > 1 and v // 2 >= low:
            cands.append(v // 2)
        if above:
            cands.append((v + min(above)) // 2)
        for c in cands:
            if c == v:
                continue
            t = TreeParams(**{**best.to_dict(), name: c}).trimmed()  # a tree too small stays so (admissible says)
            if t not in done and t not in out and admissible(t, session, inexact_trees) is None:
                out.append(t)
    return out


@dataclass
class SettingRow:
    tree: TreeParams
    stage: str  # "grid", "refine" or "thresh"
    tau: float
    eagle_tok_s: float  # median over prompts x repeats
    no_draft_tok_s: float
    speedup: float  # median of the side-by-side ratios
    lossless: bool
    runs: int  # EAGLE/no-draft pairs measured
    lossy_prompts: list[str] = field(default_factory=list)
    confirmed: bool = False  # measured again among the best (``confirm``); ranked ahead of the others
    path: str = TREE_PATH  # how the runtime drafts this tree: TREE_PATH (one call a round) or STEP_PATH
    dropped: bool = False  # screened out on the first prompts (the grid's screen): ranked after the others
    # Per lossy prompt: where EAGLE first differs from no-draft and no-draft's top-2 margin there (bench.Divergence).
    divergences: dict[str, Divergence] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tree": self.tree.to_dict(), "stage": self.stage, "tau": self.tau, "eagle_tok_s": self.eagle_tok_s,
                "no_draft_tok_s": self.no_draft_tok_s, "speedup": self.speedup, "lossless": self.lossless,
                "runs": self.runs, "lossy_prompts": list(self.lossy_prompts), "confirmed": self.confirmed,
                "path": self.path, "dropped": self.dropped,
                "divergences": {k: v.to_dict() for k, v in self.divergences.items()}}

    def label(self) -> str:
        return self.tree.label


def _summarise(tree: TreeParams, stage: str, rows: list[PromptRow], path: str = TREE_PATH) -> SettingRow:
    return SettingRow(tree, stage, tau_of(rows), statistics.median(r.eagle_tok_s for r in rows),
                      statistics.median(r.no_draft_tok_s for r in rows), statistics.median(r.speedup for r in rows),
                      all(r.lossless for r in rows), len(rows),
                      sorted({r.source for r in rows if not r.lossless}), path=path,
                      divergences={r.source: r.divergence for r in rows if r.divergence is not None})


def draft_path(session: PairedSession, tree: TreeParams) -> str:
    """How the session's runtime drafts rounds of ``tree``: with a draft tree graph (one call) or the step graph."""
    return TREE_PATH if session.rt.generator.tree_graph_fits(tree.top_k, tree.depth) else STEP_PATH


def screened(rows: list[SettingRow], keep_min: int = SCREEN_KEEP_MIN,
             margin: float = SCREEN_MARGIN) -> tuple[list[SettingRow], list[SettingRow]]:
    """The grid's screen: (kept, dropped) of rows measured on the first prompts. Kept: the best third by rank (at
    least ``keep_min``) and any within ``margin`` of the best's speedup; lossy rows are kept (to be reported)."""
    ok = sorted((r for r in rows if r.lossless), key=_rank_key)
    if not ok:
        return rows, []
    n = max(keep_min, -(-len(ok) // 3))
    floor = ok[0].speedup * (1 - margin)
    keep = {id(r) for i, r in enumerate(ok) if i < n or r.speedup >= floor}
    return ([r for r in rows if not r.lossless or id(r) in keep],
            [r for r in rows if r.lossless and id(r) not in keep])


def _rank_key(r: SettingRow):
    return (-r.speedup, -r.eagle_tok_s)


@dataclass
class SpinRow:
    """One spin policy of the spin stage: the artifact's default tree measured with it."""

    spin: str
    eagle_tok_s: float  # median over prompts x repeats
    no_draft_tok_s: float
    lossless: bool
    runs: int

    def to_dict(self) -> dict:
        return {"spin": self.spin, "eagle_tok_s": self.eagle_tok_s, "no_draft_tok_s": self.no_draft_tok_s,
                "lossless": self.lossless, "runs": self.runs}


def spin_candidates(spin: str | None, backend: str) -> list[str]:
    """The spin stage's policies: ``SPIN_CANDIDATES`` for "auto", the one given, none on TensorRT or for None."""
    if backend != "ort" or spin is None:
        return []
    if spin == "auto":
        return list(SPIN_CANDIDATES)
    from eagle_export.runtime.ort_backend import parse_spin

    try:
        parse_spin(spin)
    except ValueError as e:
        raise TuneError(f"--spin: {e} (or auto)") from None
    return [spin]


def spin_stage(artifact, candidates: list[str], *, prompts, tree: TreeParams, max_new_tokens: int, backend: str,
               threads: int | None, repeats: int, say: Callable[[str], None]) -> tuple[list[SpinRow], list]:
    """Each candidate's EAGLE and no-draft tokens/s on ``tree``, one runtime per policy in turn (the order reversed
    on every other repeat); rows best first (lossy last). Returns (rows, the resolved prompt specs)."""
    measured: dict[str, list[PromptRow]] = {c: [] for c in candidates}
    specs = prompts
    for rep in range(repeats):
        for c in candidates if rep % 2 == 0 else candidates[::-1]:
            with PairedSession(artifact, prompts=specs, backend=backend, threads=threads, spin=c, guard=False) as s:
                specs = s.specs
                s.warm_up(tree, max_new_tokens)
                measured[c] += s.measure(tree, max_new_tokens)
            rows = measured[c][-len(specs):]
            say(f"spin {c} (pass {rep + 1}/{repeats}): EAGLE {statistics.median(r.eagle_tok_s for r in rows):.1f} "
                f"tok/s, no-draft {statistics.median(r.no_draft_tok_s for r in rows):.1f} tok/s")
    out = [SpinRow(c, statistics.median(r.eagle_tok_s for r in rs), statistics.median(r.no_draft_tok_s for r in rs),
                   all(r.lossless for r in rs), len(rs)) for c, rs in measured.items()]
    out.sort(key=lambda r: (not r.lossless, -r.eagle_tok_s))
    return out, specs


@dataclass
class TuneReport:
    artifact: str
    backend: str
    device: str
    threads: int | None
    max_new_tokens: int
    repeats: int
    prompts: int
    grid: Grid
    refine: bool
    rows: list[SettingRow]  # in rank order: best first (lossy rows last)
    skipped: dict[str, int]  # reason -> grid combinations skipped
    previous: TreeParams  # tree_defaults before the run
    engines_max_tree_tokens: int | None = None  # the artifact's TensorRT engines' verify limit, if built
    batch: list[SizeRow] = field(default_factory=list)  # stage 3: per number of active sequences N >= 2
    spin_rows: list[SpinRow] = field(default_factory=list)  # the spin stage, best first (empty: not run)
    spin: str | None = None  # the policy every later stage ran with and the record keeps (None: runtime default)
    min_speedup: float = MIN_SPEEDUP  # a tree must beat plain decoding by this much to be the default
    thresholds: tuple[float, ...] = ()  # the threshold stage's values (empty: not run)
    as_run: SettingRow | None = None  # the winner measured again with the speculation guard on (None: not measured)

    @property
    def no_draft(self) -> bool:
        """No tree beat plain decoding by ``min_speedup``: the default (for one sequence) is no draft."""
        w = self.winner
        return w is None or w.speedup < self.min_speedup

    @property
    def plain_everywhere(self) -> bool:
        """No draft is the default for one sequence and at every N the per-batch stage measured."""
        return self.no_draft and all(row.choice.tree is None for row in self.batch)

    @property
    def recorded_spin(self) -> str | None:
        """The policy the ``tuned`` record keeps, which the runtime opens with: the one the stages ran with, or, where
        the artifact decodes plainly at every batch size measured, the spin stage's fastest for plain decoding (no
        draft runs by default there: its target calls are all there is)."""
        ok = [r for r in self.spin_rows if r.lossless]
        if ok and self.plain_everywhere:
            return max(ok, key=lambda r: r.no_draft_tok_s).spin
        return self.spin

    @property
    def batch_lossless(self) -> bool:
        return all(c.lossless for row in self.batch for c in row.candidates)

    @property
    def spin_lossless(self) -> bool:
        return all(r.lossless for r in self.spin_rows)

    @property
    def batch_table(self) -> BatchTrees | None:
        """The per-batch table to write: N = 1 from the single-sequence winner (no draft below ``min_speedup``), then
        stage 3's rows; without stage 3, the one row for N = 1 when it says no draft, else None (tree_defaults is
        the default)."""
        w = self.winner
        if w is None:
            return None
        one = BatchTree(1, None if self.no_draft else w.tree, round(w.speedup, 3))
        if not self.batch:
            return BatchTrees((one,)) if self.no_draft else None
        return BatchTrees((one, *(row.choice for row in self.batch)))

    def verdict(self) -> str | None:
        """The one line saying the default is no draft, or None when a tree pays."""
        w = self.winner
        if w is None or not self.no_draft:
            return None
        return (f"no draft: no tree beat plain decoding by {self.min_speedup:.2f}x (the best, {w.label()}, measured "
                f"{w.speedup:.2f}x), so the artifact decodes plainly by default; an explicit tree still drafts")

    @property
    def lossy(self) -> list[SettingRow]:
        return [r for r in self.rows if not r.lossless]

    @property
    def winner(self) -> SettingRow | None:
        ok = [r for r in self.rows if r.lossless]
        return ok[0] if ok else None

    def to_dict(self) -> dict:
        w = self.winner
        return {"artifact": self.artifact, "backend": self.backend, "device": self.device, "threads": self.threads,
                "max_new_tokens": self.max_new_tokens, "repeats": self.repeats, "prompts": self.prompts,
                "greedy": True, "stop_on_eos": False, "ranked_by": RANKED_BY, "grid": self.grid.to_dict(),
                "refine": self.refine, "skipped": dict(self.skipped), "settings": [r.to_dict() for r in self.rows],
                "lossless": not self.lossy, "previous": self.previous.to_dict(),
                "winner": None if w is None else w.to_dict(), "batch": [row.to_dict() for row in self.batch],
                "spin": self.spin, "recorded_spin": self.recorded_spin,
                "spin_stage": [r.to_dict() for r in self.spin_rows],
                "min_speedup": self.min_speedup, "no_draft": self.no_draft, "thresholds": list(self.thresholds),
                "batch_trees": None if self.batch_table is None else self.batch_table.to_list(),
                "as_run": None if self.as_run is None else self.as_run.to_dict()}

    def format(self) -> str:
        head = f"{'#':>3}  {'top_k':>5}  {'depth':>5}  {'total':>5}  {'stage':>6}  {'tau':>5}  " \
               f"{'eagle tok/s':>11}  {'no-draft tok/s':>14}  {'speedup':>7}  lossless"
        lines = [f"tune {self.artifact} (backend {self.backend} on {self.device}, threads {self.threads or 'default'}; "
                 f"{self.prompts} prompts x {self.repeats} repeat(s), {self.max_new_tokens} new tokens, greedy, "
                 "EOS ignored)", "ranked by speedup: median of per-prompt EAGLE / no-draft ratios, each pair "
                 "measured side by side; draft: how the runtime drafts the tree (tree: one call a round, step: one "
                 "call a level)", "", head + "  draft", "-" * (len(head) + 7)]
        for i, r in enumerate(self.rows, 1):
            t = r.tree
            thr = f"  threshold {t.threshold:g}" if t.threshold else ""
            lines.append(f"{i:>3}  {t.top_k:>5}  {t.depth:>5}  {t.total_tokens:>5}  {r.stage:>6}  {r.tau:>5.2f}  "
                         f"{r.eagle_tok_s:>11.1f}  {r.no_draft_tok_s:>14.1f}  {r.speedup:>6.2f}x  "
                         f"{'yes' if r.lossless else 'NO':<8}  {r.path.split()[0]}"
                         + ("  (dropped at the screen)" if r.dropped else "") + thr)
        lines.append("")
        if self.spin_rows:
            lines.append("spin policy (the default tree, EAGLE tokens/s; docs/runtime.md, Threading): " + "; ".join(
                f"{r.spin} {r.eagle_tok_s:.1f}" + ("" if r.lossless else " LOSSY") for r in self.spin_rows)
                + f" -> {self.spin}")
            if self.recorded_spin != self.spin:
                lines.append("no draft at every batch size: the record keeps the spin policy fastest for plain "
                             "decoding (no-draft tokens/s: " + "; ".join(
                                 f"{r.spin} {r.no_draft_tok_s:.1f}" for r in self.spin_rows if r.lossless)
                             + f") -> {self.recorded_spin}")
        if self.skipped:
            lines.append("skipped grid combinations: " + "; ".join(f"{n} ({why})" for why, n in self.skipped.items()))
        w = self.winner
        if w is not None:
            lines.append(f"winner: {w.label()}: speedup {w.speedup:.2f}x, tau {w.tau:.2f}, EAGLE {w.eagle_tok_s:.1f} "
                         f"tok/s, no-draft {w.no_draft_tok_s:.1f} tok/s (previous default: {self.previous.label})")
            a = self.as_run
            if a is not None and a.tree == w.tree:
                lines.append(f"as the runtime runs it (the speculation guard on): speedup {a.speedup:.2f}x, EAGLE "
                             f"{a.eagle_tok_s:.1f} tok/s, no-draft {a.no_draft_tok_s:.1f} tok/s (as `bench` and the "
                             "runtime run the default)" + ("" if a.lossless else "  LOSSY"))
            if self.no_draft:
                lines.append(self.verdict())
            lim = self.engines_max_tree_tokens
            if self.backend != "tensorrt" and lim is not None and w.tree.verify_tokens > lim:
                lines.append(f"note: the winner verifies {w.tree.verify_tokens} tokens per round, more than this "
                             f"artifact's TensorRT engines take ({lim}): with it as the default, `--backend tensorrt` "
                             "needs explicit tree settings (or tune there, or rebuild with a larger --max-tree-tokens)")
        for r in self.lossy + ([self.as_run] if self.as_run is not None and not self.as_run.lossless else []):
            lines.append(f"LOSSY: {r.label()}: EAGLE tokens differ from no-draft on {', '.join(r.lossy_prompts)}")
            lines += [f"  {src}: {d.describe()}" for src, d in r.divergences.items()]
        table = self.batch_table
        if table is not None:
            lines += format_rows(self.batch, table.rows[0])
            if not self.batch_lossless:
                lines.append("LOSSY: a batched pass's EAGLE tokens differ from batched no-draft's")
        return "\n".join(lines)


def _describe_device(rt) -> str:
    import os
    import platform

    dev = str(rt.backend.device)
    if dev.startswith("cuda"):
        try:
            import torch

            return f"{dev} ({torch.cuda.get_device_name(dev)})"
        except Exception:  # the name is informational only
            return dev
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def tune(artifact: str | Path, *, prompts: str | Path | list[PromptSpec] | None = None, max_new_tokens: int = 64,
         top_k: ValuesArg | None = None, depth: ValuesArg | None = None, total_tokens: ValuesArg | None = None,
         backend: str = "ort", threads: int | None = None, repeats: int = 1, refine: bool = True,
         warmup: bool = True, log: Callable[[str], None] | None = None, batch_sizes: ValuesArg | None = None,
         batch_candidates: int = 6, batch_requests: int | None = None, batch_repeats: int | None = None,
         spin: str | None = "auto", confirm: int = 3, screen: bool = True, inexact_trees: bool = False,
         min_speedup: float = MIN_SPEEDUP, thresholds: str | Sequence[float] | None = None) -> TuneReport:
    """Measure every admissible setting of the grid (then the refinements) on ARTIFACT; see the module docstring.

    top_k / depth / total_tokens: lists ('1,2,4', '2-8', or sequences of ints; None: the defaults).
    batch_sizes: numbers of concurrent sequences for the per-batch stage ('1,2,4', ints, or 'auto': 1, 2, 4, ...
    up to the artifact's --max-batch; None: no such stage); batch_candidates: tree sizes measured there, at most;
    batch_requests: requests per batched pass (default 2 N, at least the prompts); batch_repeats: pass pairs per
    candidate and N (default: repeats). spin: "auto" (measure ``SPIN_CANDIDATES`` first), one policy (used and
    recorded), or None (the runtime's default, nothing recorded); ONNX Runtime only. confirm: how many of the best
    settings are measured ``CONFIRM_PASSES`` more times before the ranking is final (0 or 1: none). screen: the
    grid's screen (first half of the prompts, then the rest for the best; module docstring).
    inexact_trees: also measure branching trees on an artifact where only chains are token-exact (``admissible``).
    min_speedup: the winner must beat plain decoding by this much to be the default, else the default is no draft
    (``batch_trees``' row for 1 sequence). thresholds: the threshold stage's values (None: ``DEFAULT_THRESHOLDS``;
    empty or "0": no stage). Trees are measured with the speculation guard off: what they do when they draft.
    log: optional callable for progress lines."""
    check_run_settings(max_new_tokens, threads)
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0:
        raise TuneError(f"--min-speedup must be a positive number, got {min_speedup!r}")
    thresh = parse_thresholds(thresholds)
    if not isinstance(repeats, int) or repeats < 1:
        raise TuneError(f"--repeats must be >= 1, got {repeats!r}")
    from eagle_export.manifest import load_manifest

    q = load_manifest(artifact).quantization
    grid = Grid.parse(top_k, depth, total_tokens, narrow=backend == "ort" and q is not None and q.rounds_activations)
    sizes = _batch_sizes(artifact, batch_sizes)
    spins = spin_candidates(spin, backend)
    say = log or (lambda msg: None)
    spin_rows: list[SpinRow] = []
    chosen = spins[0] if len(spins) == 1 else None
    if len(spins) > 1:
        default_tree = load_manifest(artifact).tree_defaults
        say(f"spin stage: {len(spins)} policies with the default tree (top_k {default_tree.top_k}, depth "
            f"{default_tree.depth}, total_tokens {default_tree.total_tokens})")
        spin_rows, prompts = spin_stage(artifact, spins, prompts=prompts, tree=default_tree,
                                        max_new_tokens=max_new_tokens, backend=backend, threads=threads,
                                        repeats=max(repeats, 2), say=say)
        chosen = spin_rows[0].spin
        say(f"spin policy: {chosen}")
    with PairedSession(artifact, prompts=prompts, backend=backend, threads=threads, spin=chosen, guard=False) as s:
        skipped: Counter[str] = Counter()
        todo = []
        # Grouped by (top_k, depth): the runtime opens each top_k's tree graph cut to a depth once.
        for t in sorted(grid.settings(), key=lambda t: (t.top_k, t.depth, t.total_tokens)):
            why = admissible(t, s, inexact_trees)
            if why is None and t.trimmed() in todo:
                why = SAME_TREES
            if why is None:
                todo.append(t.trimmed())  # measured, and written, as the runtime drafts it
            else:
                skipped[why] += 1
        if not todo:
            lim = s.manifest.tree_limits
            raise TuneError(
                f"no setting of the grid can run (top_k {list(grid.top_k)}, depth {list(grid.depth)}, total_tokens "
                f"{list(grid.total_tokens)}): " + "; ".join(f"{n} {why}" for why, n in skipped.items())
                + f" (artifact limits: top_k <= {lim.max_top_k}, depth <= {lim.max_depth}, total_tokens <= "
                f"{lim.max_total_tokens})")
        first = list(range((len(s.specs) + 1) // 2)) if screen and len(s.specs) > 1 else None
        say(f"{len(todo)} settings to measure ({sum(skipped.values())} of the grid's {len(grid.settings())} skipped)"
            + (", then up to 6 around the best" if refine else "")
            + f"; each: {len(s.specs)} prompts x {repeats} repeat(s), EAGLE and no-draft side by side"
            + (f" ({len(first)} first: the best go on to the rest)" if first is not None else ""))
        if warmup:
            say("warm-up")
            s.warm_up(todo[0], max_new_tokens)
        rows: list[SettingRow] = []
        by_tree: dict[TreeParams, list[PromptRow]] = {}
        parity = 0

        def measure(t: TreeParams, only: list[int] | None = None) -> list[PromptRow]:
            nonlocal parity
            measured: list[PromptRow] = []
            for _ in range(repeats):
                measured += s.measure(t, max_new_tokens, parity=parity, only=only)
                parity += len(s.specs if only is None else only)
            return measured

        def run(stage: str, trees: list[TreeParams], start: int, total: int | None,
                only: list[int] | None = None) -> None:
            for j, t in enumerate(trees, start):
                s.prepare(t)
                by_tree[t] = measure(t, only)
                rows.append(_summarise(t, stage, by_tree[t], draft_path(s, t)))
                r = rows[-1]
                say(f"[{j}/{total or len(trees)}] {stage} {r.label()} ({r.path}): tau {r.tau:.2f}, speedup "
                    f"{r.speedup:.2f}x, EAGLE {r.eagle_tok_s:.1f} tok/s" + ("" if r.lossless else "  LOSSY")
                    + (f" on the first {len(only)} prompts" if only is not None else ""))

        run("grid", todo, 1, len(todo), first)
        if first is not None:
            # The screen: the best of the grid on the rest of the prompts; the others stay as measured, dropped.
            keep, drop = screened(rows)
            rest = [i for i in range(len(s.specs)) if i not in first]
            say(f"screen: {len(keep)} of {len(rows)} settings go on to the other {len(rest)} prompts")
            for r in drop:
                r.dropped = True
            for r in sorted(keep, key=lambda r: (r.tree.top_k, r.tree.depth, r.tree.total_tokens)):
                s.prepare(r.tree)
                by_tree[r.tree] += measure(r.tree, rest)
                rows[rows.index(r)] = _summarise(r.tree, r.stage, by_tree[r.tree], r.path)
        if refine:
            ok = sorted((r for r in rows if r.lossless and not r.dropped), key=_rank_key)
            if ok:
                extra = refinements(ok[0].tree, grid, {r.tree for r in rows}, s, inexact_trees)
                if extra:
                    say(f"refining around {ok[0].label()}: {len(extra)} more settings")
                    run("refine", extra, 1, len(extra))
        ok = sorted((r for r in rows if r.lossless), key=_rank_key)
        if thresh and ok:
            # The best tree with each threshold: fewer verify tokens on the rounds where its draft is unsure.
            top = ok[0].tree
            extra = [t for t in (TreeParams(top.top_k, top.depth, top.total_tokens, v) for v in thresh)
                     if t not in by_tree and admissible(t, s, inexact_trees) is None]
            say(f"thresholds for {top.label}: {', '.join(f'{v:g}' for v in thresh)}")
            run("thresh", extra, 1, len(extra))
        best = sorted((r for r in rows if r.lossless and not r.dropped), key=_rank_key)[:confirm]
        if len(best) > 1:
            # A setting measured once can win by the machine's noise: the best few again, interleaved, the order
            # reversed on the second pass, ranked over all their runs.
            say(f"confirming the best {len(best)}: {CONFIRM_PASSES} more passes each, interleaved")
            for rep in range(CONFIRM_PASSES):
                for r in best if rep % 2 == 0 else best[::-1]:
                    s.prepare(r.tree)
                    by_tree[r.tree] += s.measure(r.tree, max_new_tokens, parity=parity)
                    parity += len(s.specs)
            for r in best:
                rows[rows.index(r)] = again = _summarise(r.tree, r.stage, by_tree[r.tree], r.path)
                again.confirmed = True
                say(f"confirmed {again.label()}: speedup {again.speedup:.2f}x over {again.runs} runs"
                    + ("" if again.lossless else "  LOSSY"))
        # The winner as the runtime will run it: the speculation guard on. Its speedup is what tune reports for the
        # default it writes (a later `bench` of the artifact runs the same way); the ranking stays guard-off.
        as_run = None
        top = min(rows, key=lambda r: (not r.lossless, not r.confirmed, r.dropped, *_rank_key(r)), default=None)
        if top is not None and top.lossless and top.speedup >= min_speedup:
            say(f"measuring {top.label()} as the runtime runs it (the speculation guard on)")
            with s.guarded():
                again = s.measure(top.tree, max_new_tokens, parity=parity, repeats=repeats)
            as_run = _summarise(top.tree, "as run", again, top.path)
            say(f"as run: speedup {as_run.speedup:.2f}x" + ("" if as_run.lossless else "  LOSSY"))
        device = _describe_device(s.rt)
        previous = s.manifest.tree_defaults
        n_prompts = len(s.specs)
        specs = s.specs
        eng = s.manifest.engines
        engines_max = int(eng.options["max_tree_tokens"]) if eng is not None else None
    # Lossy last; the confirmed (best few, measured again) first: a setting measured once does not overtake them; the
    # screen's dropped after every setting measured on all the prompts.
    rows.sort(key=lambda r: (not r.lossless, not r.confirmed, r.dropped, *_rank_key(r)))
    report = TuneReport(str(artifact), backend, device, threads, max_new_tokens, repeats, n_prompts, grid, refine,
                        rows, dict(skipped), previous, engines_max, spin_rows=spin_rows, spin=chosen,
                        min_speedup=float(min_speedup), thresholds=thresh, as_run=as_run)
    cands = ladder(rows, batch_candidates)
    if sizes and cands:
        say(f"per-batch stage: N = {', '.join(map(str, sizes))}; {len(cands)} tree sizes and no draft at each")
        report.batch = tune_batch(artifact, sizes=sizes, candidates=cands, prompts=specs,
                                  max_new_tokens=max_new_tokens, backend=backend, threads=threads,
                                  repeats=batch_repeats or repeats,
                                  requests=batch_requests, log=say, spin=chosen, min_speedup=float(min_speedup))
    return report


def _batch_sizes(artifact, text: ValuesArg | None) -> list[int]:
    """The per-batch stage's N >= 2 (checked against the artifact's --max-batch); [] for none."""
    if text is None:
        return []
    from eagle_export.manifest import load_manifest

    max_batch = load_manifest(artifact).max_batch
    if text == "auto":
        return [n for n in default_sizes(max_batch) if n >= 2]
    sizes = parse_list(text, "--batch-sizes", 1)
    if sizes[-1] > max_batch:
        raise TuneError(f"--batch-sizes {sizes[-1]} is above the artifact's --max-batch {max_batch} (re-export with "
                        f"a larger --max-batch, or give smaller sizes)")
    return [n for n in sizes if n >= 2]


def write_winner(artifact: str | Path, report: TuneReport) -> Manifest:
    """Write the report's winner into ARTIFACT's manifest as tree_defaults, with a `tuned` record (atomically).
    Refuses a report with a lossy setting or without a winner. Returns the new Manifest."""
    from eagle_export import __version__
    from eagle_export.manifest import TunedInfo, set_tree_defaults

    if report.lossy:
        raise TuneError(f"not writing tree_defaults: {len(report.lossy)} setting(s) were lossy ("
                        + "; ".join(r.label() for r in report.lossy) + "): EAGLE must equal no-draft decoding")
    if report.as_run is not None and not report.as_run.lossless:
        raise TuneError(f"not writing tree_defaults: the winner measured with the speculation guard on was lossy ("
                        f"{report.as_run.label()}): EAGLE must equal no-draft decoding")
    if not report.batch_lossless:
        raise TuneError("not writing tree_defaults: a batched pass was lossy: EAGLE must equal no-draft decoding")
    if not report.spin_lossless:
        raise TuneError("not writing tree_defaults: a pass of the spin stage was lossy: EAGLE must equal no-draft "
                        "decoding")
    w = report.winner
    if w is None:
        raise TuneError("not writing tree_defaults: no setting was measured")
    tuned = TunedInfo(
        backend=report.backend, threads=report.threads, device=report.device, tree=w.tree.to_dict(),
        ranked_by=RANKED_BY, tau=w.tau, eagle_tok_s=w.eagle_tok_s, no_draft_tok_s=w.no_draft_tok_s,
        speedup=w.speedup, settings=len(report.rows), prompts=report.prompts, max_new_tokens=report.max_new_tokens,
        repeats=report.repeats, tuned_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        eagle_export=__version__, spin=report.recorded_spin,
        speedup_as_run=None if report.as_run is None or report.as_run.tree != w.tree else report.as_run.speedup)
    # No table: the winner is the default at every batch size, so an older table (whose row for 1 was the old
    # winner, or no draft) goes.
    table = report.batch_table
    return set_tree_defaults(artifact, w.tree, tuned, batch_trees=table, clear_batch_trees=table is None)


def plot_speedup(report: TuneReport, path: str | Path) -> Path:
    """Speedup versus tree size (draft nodes per round), one series per top_k (the best depth at each size)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({r.tree.top_k for r in report.rows}):
        best: dict[int, SettingRow] = {}
        for r in report.rows:
            if r.tree.top_k == k and r.lossless and (r.tree.total_tokens not in best
                                                      or r.speedup > best[r.tree.total_tokens].speedup):
                best[r.tree.total_tokens] = r
        xs = sorted(best)
        if xs:
            ax.plot(xs, [best[x].speedup for x in xs], marker="o", label=f"top_k {k}")
    w = report.winner
    if w is not None:
        ax.scatter([w.tree.total_tokens], [w.speedup], s=160, facecolors="none", edgecolors="black",
                   label=f"winner (depth {w.tree.depth})", zorder=3)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    sizes = sorted({r.tree.total_tokens for r in report.rows})
    ax.set_xticks(sizes, [str(x) for x in sizes])
    ax.minorticks_off()
    ax.set_xlabel("total_tokens (draft nodes per round)")
    ax.set_ylabel("speedup vs no-draft (best depth)")
    ax.set_title(f"tune: {report.backend} on {report.device}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, ax, path)

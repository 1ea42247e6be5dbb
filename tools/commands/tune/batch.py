"""`eagle-export tune --batch-sizes`: the best tree per number of active sequences, or no draft where batched plain
decoding wins (the manifest's ``batch_trees``, applied each round by runtime/scheduler.py).

    from eagle_export.tools.commands.tune.batch import tune_batch
    rows = tune_batch("artifacts/tiny", sizes=[2, 4], candidates=[TreeParams(1, 4, 4), TreeParams(2, 4, 8)])

Batching amortises a graph call's fixed cost over the sequences, so plain decoding gains more from it than EAGLE,
whose verify already holds several tokens per sequence: past some batch size a smaller tree, or none, is faster.
For each N, one runtime opened with ``max_batch=N`` serves M greedy requests (EOS ignored) from N client threads
(``bench --concurrency``'s passes, tools/commands/bench/concurrency.py), once per candidate tree and once with no
draft, alternating, ``repeats`` times. A candidate's speedup is the median over repeats of its pass's throughput /
the no-draft pass's next to it. The best lossless candidate is N's row; none (no draft) when even it is below
``min_speedup`` (tune's --min-speedup: a clear margin over plain decoding).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export.prompts import PromptSpec, prompt_ids
from eagle_export.runtime.timing import TimingBackend
from eagle_export.tools.commands.bench import builtin_prompts
from eagle_export.tree_params import BatchTree, TreeParams


@dataclass
class Candidate:
    tree: TreeParams
    speedup: float  # median over repeats of tree pass / no-draft pass throughput
    eagle_tok_s: float
    no_draft_tok_s: float
    tau: float
    lossless: bool

    def to_dict(self) -> dict:
        return {"tree": self.tree.to_dict(), "speedup": self.speedup, "eagle_tok_s": self.eagle_tok_s,
                "no_draft_tok_s": self.no_draft_tok_s, "tau": self.tau, "lossless": self.lossless}


@dataclass
class SizeRow:
    """One N: every candidate measured, and the choice (tree None: no draft)."""

    active: int
    requests: int
    candidates: list[Candidate] = field(default_factory=list)
    min_speedup: float = 1.0  # the best candidate must beat batched plain decoding by this much, else no draft

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.lossless]
        return max(ok, key=lambda c: (c.speedup, c.eagle_tok_s)) if ok else None

    @property
    def choice(self) -> BatchTree:
        b = self.best
        if b is None or b.speedup < self.min_speedup:
            return BatchTree(self.active, None, None if b is None else round(b.speedup, 3))
        return BatchTree(self.active, b.tree, round(b.speedup, 3))

    def to_dict(self) -> dict:
        return {"active": self.active, "requests": self.requests, "choice": self.choice.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates]}


def ladder(rows, limit: int = 6) -> list[TreeParams]:
    """Cost-aware candidates from a single-sequence ranking (tune's SettingRows, best first): for each tree size
    (total_tokens), its best-ranked lossless shape, the ``limit`` best sizes at most, smallest first."""
    best: dict[int, TreeParams] = {}
    for r in rows:
        if r.lossless and r.tree.total_tokens not in best:
            best[r.tree.total_tokens] = r.tree
        if len(best) == limit:
            break
    return [best[k] for k in sorted(best)]


def tune_batch(artifact: str | Path, *, sizes: list[int], candidates: list[TreeParams],
               prompts: list[PromptSpec] | None = None, max_new_tokens: int = 64, backend: str = "ort",
               threads: int | None = None, repeats: int = 1, requests: int | None = None,
               log: Callable[[str], None] | None = None, spin: str | None = None,
               min_speedup: float = 1.0) -> list[SizeRow]:
    """Measure every candidate against batched no-draft at each N of ``sizes``; see the module docstring. An N whose
    best candidate is below ``min_speedup`` gets no draft."""
    from eagle_export.runtime import EagleRuntime
    from eagle_export.tools.commands.bench.concurrency import _pass

    say = log or (lambda msg: None)
    out: list[SizeRow] = []
    for n in sizes:
        # the guard off: a candidate's figures are its tree's when it drafts (the guard acts on them at run time)
        rt = EagleRuntime.open(artifact, backend=backend, threads=threads, max_batch=n, spin=spin, guard=False)
        try:
            specs = prompts if prompts is not None else builtin_prompts(rt.tokenizer is not None,
                                                                         rt.manifest.target.vocab_size)
            ids = [prompt_ids(rt, s) for s in specs]
            m = requests or max(2 * n, len(ids))
            work = [ids[i % len(ids)] for i in range(m)]
            gen = rt.scheduler.gen
            proxy = TimingBackend(gen.backend)
            gen.backend = proxy
            _pass(rt, proxy, work[:n], n, max_new_tokens, None)  # warm-up
            row = SizeRow(n, m, min_speedup=min_speedup)
            for j, tree in enumerate(candidates, 1):
                _pass(rt, proxy, work[:n], n, max_new_tokens, tree)  # warm-up of this tree's shapes
                ratios, e_tps, nd_tps, accepts, lossless = [], [], [], [], True
                for r in range(repeats):
                    first_plain = (j + r) % 2 == 1  # alternate which mode goes first
                    order = (None, tree) if first_plain else (tree, None)
                    got = {}
                    for t in order:
                        got[t is None] = _pass(rt, proxy, work, n, max_new_tokens, t)
                    (nd, nd_tok), (e, e_tok) = got[True], got[False]
                    ratios.append(e.throughput / max(nd.throughput, 1e-12))
                    e_tps.append(e.throughput)
                    nd_tps.append(nd.throughput)
                    accepts += e.accept_lengths
                    lossless = lossless and e_tok == nd_tok
                c = Candidate(tree, statistics.median(ratios), statistics.median(e_tps), statistics.median(nd_tps),
                              (sum(accepts) + len(accepts)) / max(len(accepts), 1), lossless)
                row.candidates.append(c)
                say(f"N={n} [{j}/{len(candidates)}] {tree.label}: speedup {c.speedup:.2f}x vs batched no-draft, "
                    f"EAGLE {c.eagle_tok_s:.1f} tok/s" + ("" if lossless else "  LOSSY"))
            out.append(row)
        finally:
            rt.close()
    return out


def default_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the artifact's --max-batch (and it)."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch]


def format_rows(rows: list[SizeRow], single: BatchTree) -> list[str]:
    """The per-batch table: each N's candidates, then the choice."""
    lines = ["", "per number of active sequences (N >= 2: batched passes of M requests from N clients, "
             "speedup = tree pass / batched no-draft pass, median over repeats):", "",
             f"{'N':>3}  {'top_k':>5}  {'depth':>5}  {'total':>5}  {'tau':>5}  {'eagle tok/s':>11}  "
             f"{'no-draft tok/s':>14}  {'speedup':>7}  lossless"]
    for row in rows:
        for c in sorted(row.candidates, key=lambda c: -c.speedup):
            t = c.tree
            lines.append(f"{row.active:>3}  {t.top_k:>5}  {t.depth:>5}  {t.total_tokens:>5}  {c.tau:>5.2f}  "
                         f"{c.eagle_tok_s:>11.1f}  {c.no_draft_tok_s:>14.1f}  {c.speedup:>6.2f}x  "
                         f"{'yes' if c.lossless else 'NO'}")
    lines.append("")
    lines.append("batch_trees: " + "; ".join(_label(r) for r in [single, *(row.choice for row in rows)]))
    return lines


def _label(r: BatchTree) -> str:
    t = r.tree
    what = "no draft" if t is None else t.label
    return f"N>={r.active}: {what}" + ("" if r.speedup is None else f" ({r.speedup:.2f}x)")

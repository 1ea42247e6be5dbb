"""validate's report: per output, per graph, the token checks and the whole, as text and as JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle_export import contract as C

from .cases import EXACT, Tolerance
from .quant import QuantReport


@dataclass
class OutputReport:
    name: str
    tol: Tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_case: str = ""
    passed: bool = True
    note: str = ""

    def to_dict(self) -> dict:
        return {"tolerance": self.tol.to_dict(), "max_abs": self.max_abs, "max_rel": self.max_rel,
                "worst_case": self.worst_case, "passed": self.passed, "note": self.note}


@dataclass
class GraphReport:
    name: str
    cases: list[str]
    outputs: dict[str, OutputReport]
    failed_cases: list[str] = field(default_factory=list)
    divergence: dict | None = None  # first divergent layer, when a case failed

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs.values())

    def to_dict(self) -> dict:
        return {"passed": self.passed, "cases": self.cases, "failed_cases": self.failed_cases,
                "outputs": {k: v.to_dict() for k, v in self.outputs.items()}, "first_divergence": self.divergence}


@dataclass
class TokenReport:
    """Greedy vs transformers, or EAGLE rounds vs the oracle, over the random prompts."""

    what: str
    prompts: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    ties: int = 0
    failures: list[str] = field(default_factory=list)
    skipped: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        d = {"passed": self.passed, "skipped": self.skipped, "prompts": self.prompts, "tokens": self.tokens,
             "ties": self.ties, "failures": self.failures}
        if self.what == "eagle":
            d.update(rounds=self.rounds, accepted=self.accepted)
        return d


@dataclass
class EmbeddingReport:
    """The table the runtime gathers the draft's input_embeds from, against the reference head's embed_tokens."""

    where: str  # e.g. "target_verify.onnx.data at byte 1048576, the target's embedding"
    rows: int
    mismatched_rows: int
    max_abs: float

    @property
    def passed(self) -> bool:
        return self.rows > 0 and self.mismatched_rows == 0

    def to_dict(self) -> dict:
        return {"passed": self.passed, "where": self.where, "rows": self.rows,
                "mismatched_rows": self.mismatched_rows, "max_abs": self.max_abs}


@dataclass
class ValidationReport:
    artifact: str
    backend: str
    dtype: str
    target_source: str
    draft_source: str
    tree: dict
    graphs: dict[str, GraphReport]
    greedy: TokenReport
    eagle: TokenReport
    tie_gap: float  # logit / log-prob gap below which a first difference is a tie
    embedding: EmbeddingReport | None = None
    seconds: float = 0.0
    library: object | None = None  # against_library.LibraryCheck, with --against-library
    quantization: QuantReport | None = None  # a quantized artifact's lossless check and drift (validate_quant.py)

    @property
    def passed(self) -> bool:
        return (all(g.passed for g in self.graphs.values()) and self.greedy.passed and self.eagle.passed
                and (self.embedding is None or self.embedding.passed)
                and (self.library is None or self.library.passed)
                and (self.quantization is None or self.quantization.passed))

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "artifact": self.artifact, "backend": self.backend, "dtype": self.dtype,
            "reference": {"target": self.target_source, "draft": self.draft_source, "dtype": "float32",
                          "modules": {C.TARGET_GRAPH: "TargetVerify", C.TARGET_FUSED_GRAPH: "TargetVerify",
                                      C.DRAFT_GRAPH: "DraftStep", C.DRAFT_TREE_GRAPH + "_k*": "DraftTree"}},
            "graphs": {k: v.to_dict() for k, v in self.graphs.items()},
            "draft_embedding": None if self.embedding is None else self.embedding.to_dict(),
            "greedy_vs_transformers": self.greedy.to_dict(),
            "eagle_vs_oracle": {**self.eagle.to_dict(), "tree": self.tree},
            "tie_gap": self.tie_gap, "seconds": round(self.seconds, 2),
            "against_library": None if self.library is None else self.library.to_dict(),
            **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
        }

    def format(self) -> str:
        ok = {True: "PASS", False: "FAIL"}
        lines = [f"eagle-export validate {self.artifact}",
                 f"  backend {self.backend}, artifact dtype {self.dtype}; reference: PyTorch float32 modules from",
                 f"  target {self.target_source}",
                 f"  draft  {self.draft_source}", ""]
        for g in self.graphs.values():
            lines.append(f"graph {g.name}: {ok[g.passed]} ({len(g.cases)} inputs: {'; '.join(g.cases)})")
            lines.append(f"  {'output':<16} {'atol':>8} {'rtol':>8} {'worst abs':>10} {'worst rel':>10}  "
                         f"{'':4}  worst input")
            for o in g.outputs.values():
                if o.tol == EXACT:
                    tol, worst = f"{'exact':>17}", f"{int(o.max_abs):>10d} {'-':>10}"
                else:
                    tol, worst = f"{o.tol.atol:>8.0e} {o.tol.rtol:>8.0e}", f"{o.max_abs:>10.2e} {o.max_rel:>10.2e}"
                lines.append(f"  {o.name:<16} {tol} {worst}  {ok[o.passed]:4}  {o.worst_case}"
                             + (f" ({o.note})" if o.note else ""))
            if g.divergence:
                lines.append(f"  first divergent layer: {g.divergence['summary']}")
            lines.append("")
        if self.embedding is not None:
            e = self.embedding
            lines.append(f"draft embedding table ({e.where}): {ok[e.passed]} ({e.rows} rows compared with the "
                         f"reference's embed_tokens at {self.dtype}, exact: {e.mismatched_rows} differ, worst abs "
                         f"{e.max_abs:.2e})")
            lines.append("")
        if self.library is not None:
            lines += [self.library.format(), ""]
        for r, title in ((self.greedy, "greedy tokens vs transformers generate"),
                         (self.eagle, f"EAGLE rounds vs PyTorch oracle (tree {self.tree})")):
            if r.skipped:
                lines.append(f"{title}: skipped (--prompts 0)")
                continue
            extra = f", {r.rounds} rounds, {r.accepted} draft tokens accepted" if r.what == "eagle" else ""
            lines.append(f"{title}: {ok[r.passed]} ({r.prompts} prompts, {r.tokens} tokens{extra}, "
                         f"{r.ties} ties below gap {self.tie_gap:.2g})")
            lines += [f"  {f}" for f in r.failures[:5]]
        if self.quantization is not None:
            lines.append("")
            lines += self.quantization.format()
        lines.append("")
        lines.append(f"RESULT: {ok[self.passed]} ({self.seconds:.1f} s)")
        return "\n".join(lines)


def worst_errors(report: ValidationReport) -> dict[str, float]:
    """{graph.output: worst absolute error}: a compact summary for logs and tests."""
    return {f"{g}.{o}": r.max_abs for g, gr in report.graphs.items() for o, r in gr.outputs.items()
            if not math.isnan(r.max_abs)}

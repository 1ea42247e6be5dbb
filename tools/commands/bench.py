"""`eagle-export bench`: EAGLE against `--no-draft` on the same runtime, side by side in one run.

    from eagle_export.tools.commands.bench import bench
    report = bench("artifacts/tiny", max_new_tokens=64, threads=1)
    print(report.format())            # or json.dumps(report.to_dict())

For each prompt, one greedy EAGLE generation and one greedy `--no-draft` generation run on the same
runtime (the order alternates from prompt to prompt), after one warm-up generation of each mode.
Generations ignore EOS (``stop_on_eos=False``), so both runs of a prompt have the same length and
their tokens can be compared (``lossless``).

What is measured (see docs/bench.md):

- tau: committed tokens per target forward (bonus included) over every EAGLE round of every prompt;
- n-alpha: for d = 1 .. depth + 1, the fraction of rounds that accepted >= d draft tokens among the
  rounds that accepted >= d - 1 (None when no round got that far);
- tokens/s: generated tokens / (prefill_s + decode_s) per generation; the median over prompts;
- speedup: the median over prompts of eagle tokens/s / no-draft tokens/s;
- the split of EAGLE's decode time into draft graph calls, target graph calls and host work (the rest),
  timed by a proxy around the runtime's backend, installed for the bench only;
- peak memory: the process's peak resident set size (``resource.getrusage(...).ru_maxrss``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export import contract as C
from eagle_export.errors import EagleExportError, GenerationError
from eagle_export.prompts import PromptSpec, prompt_ids, read_prompts  # the shared prompt-file reader
from eagle_export.runtime.backend import Backend
from eagle_export.runtime.generator import tau
from eagle_export.tree_params import TreeParams

# Built-in prompts: text when the artifact has a tokenizer, else id prompts (taken modulo the vocabulary).
TEXT_PROMPTS = ["The quick brown fox", "def main():", "Once upon a time", "import numpy as np"]
ID_PROMPT_RULES = [(7, 3, 12), (5, 4, 20), (11, 1, 8), (3, 2, 16)]  # ids (a * i + b) % vocab, i < n


class BenchError(EagleExportError):
    """A bad bench request: bad settings, --plot without matplotlib (prompt files: eagle_export.prompts)."""


# ---- prompts -----------------------------------------------------------------------------------


def builtin_prompts(has_tokenizer: bool, vocab: int) -> list[PromptSpec]:
    if has_tokenizer:
        return [PromptSpec(f"builtin {i + 1}", text=t) for i, t in enumerate(TEXT_PROMPTS)]
    return [PromptSpec(f"builtin {i + 1}", ids=tuple((a * j + b) % vocab for j in range(n)))
            for i, (a, b, n) in enumerate(ID_PROMPT_RULES)]


# ---- timing proxy ------------------------------------------------------------------------------


class TimingBackend:
    """Wraps a backend (``runtime.backend.Backend``, which it implements too): forwards every member and times
    ``run`` per graph name.

    A backend that reports ``last_exec_s`` (ONNX Runtime: the time inside the session's run, binding excluded) is
    timed by that, so binding the call's buffers counts as host work. One that reports None (TensorRT: work queued
    on a stream) is synchronized after each call and timed around ``run`` + ``synchronize``, so the call's device
    work is inside its time.
    """

    def __init__(self, inner: Backend):
        self._inner = inner
        self.name = inner.name
        self.device = inner.device
        self.host_memory = inner.host_memory
        self.max_prefill = inner.max_prefill
        self.target_graph = inner.target_graph
        self.last_exec_s = inner.last_exec_s
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @property
    def target_seconds(self) -> float:
        """Time in the target graph, whichever variant ran (standard or fused)."""
        return self.seconds.get(C.TARGET_GRAPH, 0.0) + self.seconds.get(C.TARGET_FUSED_GRAPH, 0.0)

    def run(self, graph: str, inputs: dict, outputs: dict) -> None:
        inner = self._inner
        t0 = time.perf_counter()
        inner.run(graph, inputs, outputs)
        exec_s = inner.last_exec_s
        if exec_s is None:
            inner.synchronize()
            exec_s = time.perf_counter() - t0
        self.last_exec_s = exec_s
        self.seconds[graph] += exec_s
        self.calls[graph] += 1

    def zeros(self, shape: tuple[int, ...], dtype):
        return self._inner.zeros(shape, dtype)

    def check_tree(self, tree: TreeParams) -> None:
        self._inner.check_tree(tree)

    def to_host(self, x):
        return self._inner.to_host(x)

    def synchronize(self) -> None:
        self._inner.synchronize()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class _Installed:
    """Puts a TimingBackend in place of the runtime's backend for the bench, and restores it after."""

    def __init__(self, rt):
        self.rt = rt
        self.inner = rt.generator.backend
        self.proxy = TimingBackend(self.inner)

    def __enter__(self) -> TimingBackend:
        self.rt.generator.backend = self.proxy
        self.rt.backend = self.proxy
        return self.proxy

    def __exit__(self, *exc):
        self.rt.generator.backend = self.inner
        self.rt.backend = self.inner


# ---- report ------------------------------------------------------------------------------------


@dataclass
class _Run:
    tokens: list[int]
    rounds: int
    accept_lengths: list[int]
    prefill_s: float
    decode_s: float
    draft_s: float  # draft graph calls during decode
    target_s: float  # target graph calls during decode

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / max(self.prefill_s + self.decode_s, 1e-12)


@dataclass
class PromptRow:
    source: str
    prompt_tokens: int
    new_tokens: int
    tau: float
    rounds: int
    eagle_tok_s: float
    no_draft_tok_s: float
    speedup: float
    lossless: bool
    decode_s: float
    draft_s: float
    target_s: float
    host_s: float
    accept_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"source": self.source, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "tau": self.tau, "rounds": self.rounds, "eagle_tok_s": self.eagle_tok_s,
                "no_draft_tok_s": self.no_draft_tok_s, "speedup": self.speedup, "lossless": self.lossless,
                "eagle_decode_s": self.decode_s, "draft_s": self.draft_s, "target_s": self.target_s,
                "host_s": self.host_s, "accept_lengths": list(self.accept_lengths)}


def n_alpha(accept_lengths: list[int], max_depth: int) -> list[float | None]:
    """For d = 1..max_depth: P(accepted >= d | accepted >= d - 1) over the rounds; None where no round reached d - 1."""
    out: list[float | None] = []
    for d in range(1, max_depth + 1):
        reached = sum(1 for a in accept_lengths if a >= d - 1)
        out.append(sum(1 for a in accept_lengths if a >= d) / reached if reached else None)
    return out


def peak_rss_mb() -> float:
    """The process's peak resident set size in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


@dataclass
class BenchReport:
    artifact: str
    backend: str
    threads: int | None
    max_new_tokens: int
    tree: TreeParams
    rows: list[PromptRow]
    tau: float
    n_alpha: list[float | None]
    eagle_tok_s: float  # median over prompts
    no_draft_tok_s: float
    speedup: float  # median over prompts of the per-prompt ratio
    time_split: dict[str, float]  # fractions of EAGLE's decode time: draft, target, host
    peak_rss_mb: float
    lossless: bool
    warmup: bool = True

    def to_dict(self) -> dict:
        agg = {"tau": self.tau, "speedup": self.speedup,
               "tokens_per_s": {"eagle": self.eagle_tok_s, "no_draft": self.no_draft_tok_s},
               "n_alpha": list(self.n_alpha), "time_split": dict(self.time_split),
               "peak_rss_mb": self.peak_rss_mb, "lossless": self.lossless, "prompts": len(self.rows),
               "max_new_tokens": self.max_new_tokens, "tree": self.tree.to_dict(),
               "backend": self.backend, "threads": self.threads, "greedy": True, "stop_on_eos": False,
               "artifact": self.artifact}
        return {"aggregate": agg, "prompts": [r.to_dict() for r in self.rows]}

    def format(self) -> str:
        t = self.tree
        head = (f"{'#':>2}  {'prompt':>6}  {'new':>4}  {'tau':>5}  {'eagle tok/s':>11}  {'no-draft tok/s':>14}  "
                f"{'speedup':>7}  {'draft':>6}  {'target':>6}  {'host':>6}  lossless")
        lines = [f"bench {self.artifact} (backend {self.backend}, threads {self.threads or 'default'}; tree top_k "
                 f"{t.top_k} depth {t.depth} total_tokens {t.total_tokens}; {self.max_new_tokens} new tokens, greedy, "
                 "EOS ignored)", "", head, "-" * len(head)]
        for i, r in enumerate(self.rows, 1):
            d = max(r.decode_s, 1e-12)
            lines.append(f"{i:>2}  {r.prompt_tokens:>6}  {r.new_tokens:>4}  {r.tau:>5.2f}  {r.eagle_tok_s:>11.1f}  "
                         f"{r.no_draft_tok_s:>14.1f}  {r.speedup:>6.2f}x  {r.draft_s / d:>6.1%}  "
                         f"{r.target_s / d:>6.1%}  {r.host_s / d:>6.1%}  {'yes' if r.lossless else 'NO'}")
        s = self.time_split
        na = ", ".join(f"{i}: {'-' if a is None else f'{a:.2f}'}" for i, a in enumerate(self.n_alpha, 1))
        lines += [
            "",
            f"tau (committed tokens per target forward, bonus included): {self.tau:.2f}",
            f"acceptance per depth (n-alpha): {na}",
            f"tokens/s (median over {len(self.rows)} prompts): EAGLE {self.eagle_tok_s:.1f}, "
            f"no-draft {self.no_draft_tok_s:.1f}",
            f"speedup (median of per-prompt ratios, measured side by side): {self.speedup:.2f}x",
            f"EAGLE decode time: draft graph {s['draft']:.1%}, target graph {s['target']:.1%}, host {s['host']:.1%}",
            f"peak memory: {self.peak_rss_mb:.0f} MiB (the process's peak resident set size, ru_maxrss)",
            f"lossless (EAGLE tokens == no-draft tokens on every prompt): {self.lossless}",
        ]
        return "\n".join(lines)


# ---- the bench ---------------------------------------------------------------------------------


def _generate(rt, proxy: TimingBackend, ids: list[int], max_new: int, tree: TreeParams, use_draft: bool) -> _Run:
    stream = rt.stream(prompt_ids=ids, max_new_tokens=max_new, tree=tree, use_draft=use_draft, stop_on_eos=False)
    first = True
    for _ in stream:
        if first:  # the first chunk is the prefill's token: every graph call from here on is decode
            proxy.reset()
            first = False
    res = stream.result
    s = res.stats
    return _Run(list(res.tokens), s.rounds, list(s.accept_lengths), s.prefill_s, s.decode_s,
                proxy.seconds.get(C.DRAFT_GRAPH, 0.0), proxy.target_seconds)


def check_run_settings(max_new_tokens, threads) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be >= 1, got {max_new_tokens!r}")
    if threads is not None and threads < 1:
        raise BenchError(f"--threads must be >= 1, got {threads}")


class PairedSession:
    """One opened runtime with the timing proxy installed and the prompts resolved to ids: the measuring core
    shared by ``bench`` and ``tune`` (tools/commands/tune.py).

        with PairedSession(artifact, prompts=None, backend="ort", threads=1) as s:
            s.warm_up(tree, max_new_tokens)
            rows = s.measure(tree, max_new_tokens)    # one PromptRow per prompt: EAGLE and no-draft side by side

    ``--threads`` also sets PyTorch's intra-op threads while the session is open (restored on exit).
    """

    def __init__(self, artifact: str | Path, *, prompts: str | Path | list[PromptSpec] | None = None,
                 backend: str = "ort", threads: int | None = None):
        self.artifact = artifact
        self._prompts = prompts
        self.backend = backend
        self.threads = threads

    def __enter__(self) -> PairedSession:
        import torch

        from eagle_export.runtime import EagleRuntime

        specs = read_prompts(self._prompts) if isinstance(self._prompts, (str, Path)) else self._prompts
        self._threads_before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            self.rt = EagleRuntime.open(self.artifact, backend=self.backend, threads=self.threads)
            if specs is None:
                specs = builtin_prompts(self.rt.tokenizer is not None, self.rt.manifest.target.vocab_size)
            self.specs: list[PromptSpec] = specs
            self.prompt_ids = [prompt_ids(self.rt, s) for s in specs]
            self._installed = _Installed(self.rt)
            self.proxy = self._installed.__enter__()
        except BaseException:
            torch.set_num_threads(self._threads_before)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self._installed.__exit__(*exc)
        torch.set_num_threads(self._threads_before)

    @property
    def manifest(self):
        return self.rt.manifest

    def check_tree(self, tree: TreeParams) -> TreeParams:
        """The tree against the artifact's limits and the backend's own check (TensorRT: its engines' sizes)."""
        tree.validate(self.rt.manifest.tree_limits)
        self.rt.backend.check_tree(tree)
        return tree

    def warm_up(self, tree: TreeParams, max_new_tokens: int) -> None:
        """One EAGLE and one no-draft generation of the first prompt, not counted."""
        for use_draft in (True, False):
            _run_checked(self.rt, self.proxy, self.specs[0], self.prompt_ids[0], max_new_tokens, tree, use_draft)

    def measure(self, tree: TreeParams, max_new_tokens: int, *, parity: int = 0, log=None) -> list[PromptRow]:
        """For each prompt, one EAGLE and one no-draft generation one right after the other; the order alternates
        from prompt to prompt (EAGLE first on even ``i + parity``)."""
        rows = []
        for i, (spec, ids) in enumerate(zip(self.specs, self.prompt_ids, strict=True)):
            order = (True, False) if (i + parity) % 2 == 0 else (False, True)  # alternate which mode goes first
            runs = {u: _run_checked(self.rt, self.proxy, spec, ids, max_new_tokens, tree, u) for u in order}
            e, n = runs[True], runs[False]
            host = max(e.decode_s - e.draft_s - e.target_s, 0.0)
            rows.append(PromptRow(
                spec.source, len(ids), len(e.tokens),
                tau(e.accept_lengths), e.rounds,
                e.tok_s, n.tok_s, e.tok_s / max(n.tok_s, 1e-12), e.tokens == n.tokens,
                e.decode_s, e.draft_s, e.target_s, host, e.accept_lengths))
            if log is not None:
                log(f"prompt {i + 1}/{len(self.specs)}: tau {rows[-1].tau:.2f}, EAGLE {e.tok_s:.1f} tok/s, "
                    f"no-draft {n.tok_s:.1f} tok/s")
        return rows


def tau_of(rows: list[PromptRow]) -> float:
    """Committed tokens per target forward (bonus included) over every EAGLE round of the rows."""
    return tau([a for r in rows for a in r.accept_lengths])


def bench(artifact: str | Path, *, prompts: str | Path | list[PromptSpec] | None = None, max_new_tokens: int = 64,
          tree: TreeParams | None = None, top_k: int | None = None, depth: int | None = None,
          total_tokens: int | None = None, backend: str = "ort", threads: int | None = None,
          warmup: bool = True, log=None) -> BenchReport:
    """Run the bench on ARTIFACT; see the module docstring. tree: full tree settings, or top_k/depth/total_tokens
    overriding the artifact's defaults one by one. log: optional callable for progress lines."""
    check_run_settings(max_new_tokens, threads)
    say = log or (lambda msg: None)
    with PairedSession(artifact, prompts=prompts, backend=backend, threads=threads) as s:
        if tree is None:
            d = s.manifest.tree_defaults
            tree = TreeParams(top_k if top_k is not None else d.top_k, depth if depth is not None else d.depth,
                              total_tokens if total_tokens is not None else d.total_tokens)
        tree.validate(s.manifest.tree_limits)
        if warmup:
            say("warm-up")
            s.warm_up(tree, max_new_tokens)
        rows = s.measure(tree, max_new_tokens, log=say)
    all_accepts = [a for r in rows for a in r.accept_lengths]
    decode = sum(r.decode_s for r in rows)
    parts = {"draft": sum(r.draft_s for r in rows), "target": sum(r.target_s for r in rows),
             "host": sum(r.host_s for r in rows)}
    split = {k: (v / decode if decode > 0 else 0.0) for k, v in parts.items()}
    return BenchReport(
        artifact=str(artifact), backend=backend, threads=threads, max_new_tokens=max_new_tokens, tree=tree, rows=rows,
        tau=tau_of(rows),
        n_alpha=n_alpha(all_accepts, tree.depth + 1),
        eagle_tok_s=statistics.median(r.eagle_tok_s for r in rows),
        no_draft_tok_s=statistics.median(r.no_draft_tok_s for r in rows),
        speedup=statistics.median(r.speedup for r in rows),
        time_split=split, peak_rss_mb=peak_rss_mb(), lossless=all(r.lossless for r in rows), warmup=warmup)


def _run_checked(rt, proxy, spec: PromptSpec, ids, max_new, tree, use_draft) -> _Run:
    try:
        return _generate(rt, proxy, ids, max_new, tree, use_draft)
    except GenerationError as e:
        raise BenchError(f"{spec.source}: {e}") from None


# ---- plot --------------------------------------------------------------------------------------


def require_matplotlib():
    """matplotlib.pyplot with the Agg backend, or a BenchError saying how to install it (it is optional)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install 'eagle-export[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_n_alpha(report: BenchReport, path: str | Path) -> Path:
    """Draw the n-alpha curve (acceptance rate per depth) to PATH (a PNG)."""
    plt = require_matplotlib()
    pts = [(d, a) for d, a in enumerate(report.n_alpha, 1) if a is not None]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([d for d, _ in pts], [a for _, a in pts], marker="o")
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accept >= d | accept >= d-1)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, len(report.n_alpha) + 1))
    t = report.tree
    ax.set_title(f"n-alpha (tau {report.tau:.2f}; top_k {t.top_k}, depth {t.depth}, total {t.total_tokens})",
                 fontsize=9)
    return save_figure(plt, fig, ax, path)


def save_figure(plt, fig, ax, path: str | Path) -> Path:
    """Finish a bench/tune plot (grid, tight layout), write it to PATH and close it; an unwritable PATH is a
    BenchError."""
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path)
    except OSError as e:
        raise BenchError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)
    return path

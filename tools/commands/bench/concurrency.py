"""`eagle-export bench --concurrency N`: many requests on one batched runtime, EAGLE against batched `--no-draft`.

    from eagle_export.tools.commands.bench.concurrency import bench_concurrency
    report = bench_concurrency("artifacts/tiny", concurrency=[1, 2, 4], requests=8, threads=2)
    print(report.format())            # or json.dumps(report.to_dict())

For each N, one runtime opened with ``max_batch=N`` serves ``requests`` (M) greedy requests (EOS ignored) from N
client threads: each client submits a request, waits for its end, and submits the next, so N requests are in
flight. The same M requests then run with ``use_draft=False`` on the same runtime (batched plain decoding), and, when
the artifact has a per-batch table (manifest ``batch_trees``, ``eagle-export tune``), once more with no tree given:
EAGLE as tuned, each round's tree (or no draft) picked by the scheduler from the active count. One warm-up pass of
each mode (N requests) comes first and is not counted. With ``repeats`` R, the passes alternate R times and each
mode reports its pass of median throughput.

Measured per mode (docs/bench.md, "Concurrency"):

- throughput: generated tokens of all M requests / the pass's wall time (first submit to last result);
- latency: per request, submit to result, p50 and p95 (nearest rank) over the M requests;
- tau: committed tokens per target forward of every EAGLE round of every request;
- host work per generated token: (wall time - time inside graph calls) / generated tokens, graph time taken by a
  timing proxy around the runtime's backend (as ``bench``): with one scheduler thread doing all the work,
  that is the host side of prefill, tree, acceptance, commit and binding, shared across the batch;
- padding: the share of bound past rows the common stride adds (runtime/slots.py);
- lossless: every request's EAGLE tokens (fixed tree and as tuned) equal its batched no-draft tokens.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export.prompts import PromptSpec, prompt_ids, read_prompts
from eagle_export.runtime.results import tau
from eagle_export.runtime.timing import TimingBackend
from eagle_export.tree_params import TreeParams

from . import BenchError, builtin_prompts, peak_rss_mb

TUNED = "tuned"  # _pass mode: no tree given, the artifact's per-batch table decides each round


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def run_clients(client, clients: int) -> float:
    """Run ``client`` in that many threads at once; the wall time until the last one ends."""
    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


@dataclass
class ModeFigures:
    """One mode's figures over a pass. Figures only the in-process bench can see (the draft/target/host split,
    padding; rounds and sequences per round when a server's /metrics is missing) are None over HTTP."""

    tokens: int
    wall_s: float
    latencies: list[float]
    accept_lengths: list[int]
    draft_s: float | None
    target_s: float | None
    rounds: int | None  # batched rounds the scheduler ran (each: one verify for all active sequences)
    mean_active: float | None  # sequences per round, on average
    padding: float | None  # share of bound past rows that were padding

    @property
    def throughput(self) -> float:
        return self.tokens / max(self.wall_s, 1e-12)

    @property
    def host_s(self) -> float | None:
        if self.draft_s is None or self.target_s is None:
            return None
        return max(self.wall_s - self.draft_s - self.target_s, 0.0)

    @property
    def host_ms_per_token(self) -> float | None:
        host = self.host_s
        return None if host is None else 1e3 * host / max(self.tokens, 1)

    @property
    def tau(self) -> float:
        return tau(self.accept_lengths)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "wall_s": self.wall_s, "throughput_tokens_per_s": self.throughput,
                "latency_s": {"p50": percentile(self.latencies, 50), "p95": percentile(self.latencies, 95)},
                "tau": self.tau, "draft_s": self.draft_s, "target_s": self.target_s, "host_s": self.host_s,
                "host_ms_per_token": self.host_ms_per_token, "rounds": self.rounds,
                "mean_active": self.mean_active, "padding": self.padding}


@dataclass
class Level:
    concurrency: int
    requests: int
    eagle: ModeFigures
    no_draft: ModeFigures
    lossless: bool
    tuned: ModeFigures | None = None  # EAGLE as tuned (per-batch table); None when the artifact has none

    def aggregate(self) -> dict:
        e, n, t = self.eagle, self.no_draft, self.tuned
        return {"concurrency": self.concurrency, "requests": self.requests,
                "throughput_tokens_per_s": {"eagle": e.throughput, "no_draft": n.throughput,
                                            "tuned": None if t is None else t.throughput},
                "latency_s": {"p50": percentile(e.latencies, 50), "p95": percentile(e.latencies, 95)},
                "no_draft_latency_s": {"p50": percentile(n.latencies, 50), "p95": percentile(n.latencies, 95)},
                "tau": e.tau, "host_ms_per_token": {"eagle": e.host_ms_per_token, "no_draft": n.host_ms_per_token},
                "lossless": self.lossless, "eagle": e.to_dict(), "no_draft": n.to_dict(),
                "tuned": None if t is None else t.to_dict()}


@dataclass
class ConcurrencyReport:
    artifact: str
    backend: str
    threads: int | None
    max_new_tokens: int
    tree: TreeParams
    levels: list[Level] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    table: list[dict] | None = None  # the artifact's batch_trees, when it has one (the tuned mode's trees)

    def to_dict(self) -> dict:
        last = self.levels[-1].aggregate()
        last.update({"max_new_tokens": self.max_new_tokens, "tree": self.tree.to_dict(), "backend": self.backend,
                     "threads": self.threads, "greedy": True, "stop_on_eos": False, "artifact": self.artifact,
                     "peak_rss_mb": self.peak_rss_mb, "batch_trees": self.table})
        return {"aggregate": last, "levels": [lv.aggregate() for lv in self.levels]}

    def format(self) -> str:
        t = self.tree
        head = (f"{'N':>3}  {'req':>4}  {'eagle tok/s':>11}  {'no-draft tok/s':>14}  {'vs N=1':>6}  {'p50 s':>6}  "
                f"{'p95 s':>6}  {'tau':>5}  {'host ms/tok':>11}  {'nd host ms/tok':>14}  {'seq/round':>9}  "
                f"{'padding':>7}  lossless")
        lines = [f"bench --concurrency {self.artifact} (backend {self.backend}, threads {self.threads or 'default'}; "
                 f"tree top_k {t.top_k} depth {t.depth} total_tokens {t.total_tokens}; {self.max_new_tokens} new "
                 "tokens per request, greedy, EOS ignored)", "", head, "-" * len(head)]
        base = self.levels[0].eagle.throughput if self.levels and self.levels[0].concurrency == 1 else None
        tuned = [lv for lv in self.levels if lv.tuned is not None]
        if tuned:
            lines[1:1] = ["", "EAGLE as tuned (the artifact's batch_trees picks each round's tree from the active "
                          "count) beside batched plain decoding:", "",
                          f"{'N':>3}  {'tuned tok/s':>11}  {'no-draft tok/s':>14}  {'tuned/no-draft':>14}  "
                          f"{'fixed-tree tok/s':>16}  {'tau':>5}  {'seq/round':>9}"]
            for k, lv in enumerate(tuned):
                t, n = lv.tuned, lv.no_draft
                lines.insert(5 + k, f"{lv.concurrency:>3}  {t.throughput:>11.1f}  {n.throughput:>14.1f}  "
                             f"{t.throughput / max(n.throughput, 1e-12):>13.2f}x  {lv.eagle.throughput:>16.1f}  "
                             f"{t.tau:>5.2f}  {t.mean_active:>9.2f}")
        for lv in self.levels:
            e, n = lv.eagle, lv.no_draft
            rel = f"{e.throughput / base:>5.2f}x" if base else f"{'-':>6}"
            lines.append(
                f"{lv.concurrency:>3}  {lv.requests:>4}  {e.throughput:>11.1f}  {n.throughput:>14.1f}  {rel}  "
                f"{percentile(e.latencies, 50):>6.2f}  {percentile(e.latencies, 95):>6.2f}  {e.tau:>5.2f}  "
                f"{e.host_ms_per_token:>11.2f}  {n.host_ms_per_token:>14.2f}  "
                f"{e.mean_active:>9.2f}  {e.padding:>7.1%}  {'yes' if lv.lossless else 'NO'}")
        lines += ["", "throughput: generated tokens / wall time of the pass; latency: submit to result per request; "
                  "host: wall time outside graph calls per generated token",
                  f"peak memory: {self.peak_rss_mb:.0f} MiB (the process's peak resident set size, ru_maxrss)"]
        return "\n".join(lines)


def _pass(rt, proxy: TimingBackend, prompts: list[list[int]], clients: int, max_new: int,
          tree: TreeParams | str | None) -> tuple[ModeFigures, list[list[int]]]:
    """All prompts through ``clients`` closed-loop client threads; figures and each request's tokens. tree: a
    TreeParams, None (no draft) or TUNED (no tree given: the per-batch table)."""
    sched = rt.scheduler
    gen = sched.gen
    tokens: list[list[int] | None] = [None] * len(prompts)
    latencies = [0.0] * len(prompts)
    accepts: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(len(prompts)))
    kw = {} if tree == TUNED else dict(tree=tree) if tree is not None else dict(use_draft=False)

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                res = rt.submit(prompt_ids=prompts[i], max_new_tokens=max_new, stop_on_eos=False, **kw).wait()
            except BaseException as e:  # noqa: BLE001 - reported after the pass
                errors.append(e)
                return
            latencies[i] = time.perf_counter() - t0
            tokens[i] = list(res.tokens)
            with lock:
                accepts.extend(res.stats.accept_lengths)

    proxy.reset()
    rounds0, active0 = sched.rounds, len(sched.active_per_round)
    gen.padding.bound = gen.padding.used = 0
    wall = run_clients(client, clients)
    if errors:
        raise BenchError(f"a request failed: {errors[0]}")
    per_round = sched.active_per_round[active0:]
    fig = ModeFigures(sum(len(t) for t in tokens), wall, latencies, accepts,
                      proxy.draft_seconds, proxy.target_seconds,
                      sched.rounds - rounds0, sum(per_round) / len(per_round) if per_round else 0.0,
                      gen.padding.fraction)
    return fig, tokens


def bench_concurrency(artifact: str | Path, *, concurrency: list[int], requests: int | None = None,
                      prompts: str | Path | list[PromptSpec] | None = None, max_new_tokens: int = 64,
                      tree: TreeParams | None = None, backend: str = "ort", threads: int | None = None,
                      repeats: int = 1, guard: bool = True, log=None) -> ConcurrencyReport:
    """See the module docstring. requests: M (default: 2 x the largest N, at least the prompt count); the prompts
    are used round-robin. repeats: passes per mode and N, EAGLE and no-draft alternating; each mode reports its
    pass of median throughput (a shared machine's load comes and goes). guard: the speculation guard (on: the
    runtime's default)."""
    import torch

    from eagle_export.runtime import EagleRuntime

    if not concurrency or any(not isinstance(n, int) or n < 1 for n in concurrency):
        raise BenchError(f"--concurrency must be integers >= 1, got {concurrency!r}")
    if requests is not None and requests < 1:
        raise BenchError(f"--requests must be >= 1, got {requests}")
    if repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {repeats}")
    limit = _max_batch(artifact)
    if max(concurrency) > limit:
        raise BenchError(f"--concurrency {max(concurrency)} needs an artifact exported with --max-batch "
                         f"{max(concurrency)} or more; {artifact} has --max-batch {limit}: re-export it with "
                         f"`eagle-export export ... --max-batch {max(concurrency)}`")
    say = log or (lambda msg: None)
    specs = read_prompts(prompts) if isinstance(prompts, (str, Path)) else prompts
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    report = None
    try:
        for n in concurrency:
            rt = EagleRuntime.open(artifact, backend=backend, threads=threads, max_batch=n, guard=guard)
            try:
                if specs is None:
                    specs = builtin_prompts(rt.tokenizer is not None, rt.manifest.target.vocab_size)
                ids = [prompt_ids(rt, s) for s in specs]
                m = requests or max(2 * max(concurrency), len(ids))
                work = [ids[i % len(ids)] for i in range(m)]
                use_tree = tree or rt.manifest.tree_defaults
                use_tree.validate(rt.manifest.tree_limits)
                table = rt.manifest.batch_trees
                modes = [use_tree, None] + ([TUNED] if table is not None else [])
                if report is None:
                    report = ConcurrencyReport(str(artifact), backend, threads, max_new_tokens, use_tree,
                                               table=None if table is None else table.to_list())
                gen = rt.scheduler.gen
                proxy = TimingBackend(gen.backend)
                gen.backend = proxy
                say(f"N={n}: warm-up")
                for t in modes:
                    _pass(rt, proxy, work[:n], n, max_new_tokens, t)
                passes: list[list[ModeFigures]] = [[] for _ in modes]
                lossless = True
                for r in range(repeats):
                    say(f"N={n}: {m} requests from {n} clients per mode: EAGLE, no-draft"
                        + (", EAGLE as tuned" if table is not None else "") + f" (pass {r + 1}/{repeats})")
                    got = [_pass(rt, proxy, work, n, max_new_tokens, t) for t in modes]
                    for i, (fig, _) in enumerate(got):
                        passes[i].append(fig)
                    lossless = lossless and all(toks == got[1][1] for _, toks in got)
                e, nd, *tuned = (sorted(p, key=lambda f: f.throughput)[len(p) // 2] for p in passes)
                report.levels.append(Level(n, m, e, nd, lossless, tuned[0] if tuned else None))
                say(f"N={n}: EAGLE {e.throughput:.1f} tok/s, no-draft {nd.throughput:.1f} tok/s, tau {e.tau:.2f}"
                    + (f", as tuned {tuned[0].throughput:.1f} tok/s" if tuned else ""))
            finally:
                rt.close()
    finally:
        torch.set_num_threads(before)
    report.peak_rss_mb = peak_rss_mb()
    return report


def _max_batch(artifact) -> int:
    from eagle_export.manifest import load_manifest

    return load_manifest(artifact).max_batch


def plot_throughput(report: ConcurrencyReport, path: str | Path) -> Path:
    """Aggregate tokens/s against N, EAGLE and batched no-draft, to PATH (a PNG)."""
    from . import require_matplotlib, save_figure

    plt = require_matplotlib()
    ns = [lv.concurrency for lv in report.levels]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ns, [lv.eagle.throughput for lv in report.levels], marker="o", label="EAGLE")
    ax.plot(ns, [lv.no_draft.throughput for lv in report.levels], marker="s", label="no-draft (batched)")
    if all(lv.tuned is not None for lv in report.levels):
        ax.plot(ns, [lv.tuned.throughput for lv in report.levels], marker="^", label="EAGLE as tuned")
    ax.set_xlabel("concurrent requests N (max_batch)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(ns)
    ax.legend(fontsize=8)
    t = report.tree
    ax.set_title(f"throughput vs concurrency (top_k {t.top_k}, depth {t.depth}, total {t.total_tokens})", fontsize=9)
    return save_figure(plt, fig, ax, path)

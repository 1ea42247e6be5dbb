"""Measure the two KV-cache designs (docs/runtime.md, "Why BSHD plus prefix views") on one artifact's target
verify graph.

    python tools/lab/kv_layout_bench.py ARTIFACT [--tokens 8] [--past 32,128,512] [--repeats 40]

The runtime binds the valid prefix of each cache buffer (``past_len`` = committed rows): attention
follows the real length, but every call rebinds 2 x layers ``past_*`` views, because their length
moved. The other design binds the whole capacity once and marks the rows past the committed length
False in the attention mask: no rebinding, but every call attends over (and ONNX Runtime transposes)
the whole capacity. The same graph serves both (its mask covers every key), so this program runs one
verify-sized call both ways on the same buffers, side by side:

- graph execution (``last_exec_s``, median) of each;
- binding per call (the time around the run minus execution, median), with the calls bound as the runtime
  binds them: the prefix design alternates between two lengths so every call rebinds its ``past_*`` views
  and mask, as in a generation; the capacity design keeps every binding;
- the largest logits difference between the two (they compute the same thing; only summation order
  may differ).

Timings are for reading, not for pass/fail (the machine may be shared): run it where you deploy.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import click
import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.errors import EagleExportError
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.views import HostScratch, view_of


@dataclass(frozen=True)
class LayoutRow:
    past: int  # committed rows
    prefix_exec_ms: float
    capacity_exec_ms: float
    prefix_bind_us: float
    capacity_bind_us: float
    max_logit_diff: float

    @property
    def exec_ratio(self) -> float:
        return self.capacity_exec_ms / self.prefix_exec_ms


class _Calls:
    """Verify-sized calls bound the way the runtime binds them (BufferViews of reused host arrays, a read-only
    outputs mapping), over the first ``bound`` cache rows (None: exactly the visible ones, the prefix design)."""

    def __init__(self, gen, tokens: int, capacity: int, bound: int | None, ids: np.ndarray):
        self.gen, self.t, self.bound = gen, tokens, bound
        t = tokens
        self.ids, self.pos, self.lidx = (HostScratch(t, np.int64) for _ in range(3))
        self.mask = HostScratch(t * (capacity + t), np.bool_)
        self.ids.take((t,))[:] = ids
        self.lidx.take((t,))[:] = np.arange(t)
        layers = gen.m.target.num_layers
        self.past_names = C.past_names(layers)
        outs = {C.LOGITS: view_of(gen.logits[:, :t]), C.FEATURES: view_of(gen.tfeats[:, :t])}
        outs.update(zip(C.present_names(layers), gen.tcache.new_views(t), strict=True))
        self.outputs = MappingProxyType(outs)

    def __call__(self, valid: int) -> tuple[dict, MappingProxyType]:
        t = self.t
        rows = valid if self.bound is None else self.bound
        mask = self.mask.take((t, rows + t))
        mask[:, :valid] = True
        mask[:, valid:rows] = False
        mask[:, rows:] = np.tri(t, dtype=np.bool_)
        self.pos.take((t,))[:] = np.arange(valid, valid + t)
        inputs = {C.INPUT_IDS: self.ids.view((1, t)), C.POSITION_IDS: self.pos.view((1, t)),
                  C.ATTENTION_MASK: self.mask.view((1, t, rows + t)), C.LOGIT_INDICES: self.lidx.view((1, t))}
        inputs.update(zip(self.past_names, self.gen.tcache.views(0, rows), strict=True))
        return inputs, self.outputs


def _timed(graph, inputs: dict, outputs: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    graph.run(inputs, outputs)
    total = time.perf_counter() - t0
    return graph.last_exec_s, total - graph.last_exec_s


def measure(artifact: str | Path, tokens: int = 8, pasts: tuple[int, ...] = (32, 128, 512), repeats: int = 40,
            threads: int | None = None, seed: int = 0) -> tuple[int, list[LayoutRow]]:
    """(capacity, one LayoutRow per past length) on ONNX Runtime."""
    rt = EagleRuntime.open(artifact, threads=threads, fused=False)  # the standard graph's two designs
    gen, capacity = rt.generator, rt.manifest.max_seq_len
    if not 1 <= tokens <= rt.manifest.tree_limits.max_verify_tokens:
        raise EagleExportError(f"--tokens must be in 1..{rt.manifest.tree_limits.max_verify_tokens}, got {tokens}")
    bad = [p for p in pasts if not 1 <= p < capacity]
    if bad:
        raise EagleExportError(f"--past values must be in 1..{capacity - 1} (the artifact's capacity), got {bad}")
    if repeats < 2:
        raise EagleExportError(f"--repeats must be >= 2, got {repeats}")
    g = torch.Generator().manual_seed(seed)
    for b in gen.tcache.buffers:  # plausible K/V in every row, so the masked rows hold real numbers
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    ids = np.random.default_rng(seed).integers(0, rt.manifest.target.vocab_size, tokens)
    graph = rt.backend.graphs[C.TARGET_GRAPH]
    rows = []
    prefix, full = _Calls(gen, tokens, capacity, None, ids), _Calls(gen, tokens, capacity, capacity, ids)
    for past in pasts:
        graph.run(*prefix(past))
        want = gen.logits[0, :tokens].clone()
        graph.run(*full(past))
        diff = float((gen.logits[0, :tokens] - want).abs().max())
        # The prefix design alternates between past and past - 1 visible rows, so every call rebinds as in a
        # generation; the capacity design keeps its shapes (only the mask's values change).
        lengths = (past, max(past - 1, 1))
        got = {"prefix": ([], []), "full": ([], [])}
        for block in range(4):  # blocks alternate which design goes first
            for name in (("prefix", "full") if block % 2 == 0 else ("full", "prefix")):
                calls = prefix if name == "prefix" else full
                for i in range(repeats // 4 + 1):
                    ex, bind = _timed(graph, *calls(lengths[i % 2]))
                    got[name][0].append(ex)
                    got[name][1].append(bind)
        med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in got.items()}
        rows.append(LayoutRow(past, med["prefix"][0] * 1e3, med["full"][0] * 1e3, med["prefix"][1] * 1e6,
                              med["full"][1] * 1e6, diff))
    return capacity, rows


def format_rows(capacity: int, tokens: int, rows: list[LayoutRow]) -> str:
    lines = [f"target verify, {tokens} new tokens, capacity {capacity}: prefix views (the runtime) vs the whole "
             "capacity bound once with a mask",
             "",
             f"{'past':>6}  {'prefix exec':>11}  {'capacity exec':>13}  {'ratio':>5}  {'prefix bind':>11}  "
             f"{'capacity bind':>13}  {'max |dlogits|':>13}",
             "-" * 86]
    for r in rows:
        lines.append(f"{r.past:>6}  {r.prefix_exec_ms:>8.3f} ms  {r.capacity_exec_ms:>10.3f} ms  "
                     f"{r.exec_ratio:>4.2f}x  {r.prefix_bind_us:>8.1f} us  {r.capacity_bind_us:>10.1f} us  "
                     f"{r.max_logit_diff:>13.2e}")
    return "\n".join(lines)


def measure_commit(artifact: str | Path, repeats: int = 200, threads: int | None = None) -> list[tuple]:
    """The commit of a round's accepted path, per cache design: (path, standard us, fused us), medians of
    ``repeats``. Standard: the path's rows copied from the verify's new-rows scratch into the cache
    (``KVCache.write_rows``); fused (contract 4): the rows the verify wrote in place after the committed ones moved
    down to follow them (``FusedKVCache.commit``; for one sequence nothing moves but the rows after a branch)."""
    std = EagleRuntime.open(artifact, threads=threads, fused=False).generator
    fused = EagleRuntime.open(artifact, threads=threads).generator
    if not fused.fused:
        raise EagleExportError(f"{artifact} has no fused target graph: no fused commit to measure")
    L = min(300, std.capacity // 2)
    paths = {"chain of 4 (rows 0-3)": [0, 1, 2, 3], "chain of 7 (rows 0-6)": list(range(7)),
             "branch (rows 0, 2, 5, 9)": [0, 2, 5, 9], "root only": [0]}
    out = []
    for name, rows in paths.items():
        rows = np.asarray(rows, dtype=np.int64)
        times = {"std": [], "fused": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            std.tcache.write_rows(L, rows, src=0)
            t1 = time.perf_counter()
            fused.tcache.commit(0, L, rows + L)  # one sequence: its verify wrote right after its committed rows
            t2 = time.perf_counter()
            times["std"].append(t1 - t0)
            times["fused"].append(t2 - t1)
        out.append((name, statistics.median(times["std"]) * 1e6, statistics.median(times["fused"]) * 1e6))
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from e


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--tokens", default=8, show_default=True, help="New tokens per call (a verify of that tree size).")
@click.option("--past", "pasts", default="32,128,512", show_default=True, callback=lambda c, p, v: _ints(v),
              help="Committed lengths to measure at.")
@click.option("--repeats", default=40, show_default=True, help="Calls per design and length.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: its own).")
def main(artifact: Path, tokens: int, pasts: tuple[int, ...], repeats: int, threads: int | None) -> None:
    try:
        capacity, rows = measure(artifact, tokens, pasts, repeats, threads)
    except EagleExportError as e:
        raise click.ClickException(str(e)) from e
    click.echo(format_rows(capacity, tokens, rows))
    click.echo("\ncommit of a round's accepted path, every layer (median of 200)")
    click.echo(f"{'path':>26}  {'standard (scratch -> cache)':>28}  {'fused (in place, moved down)':>29}")
    for name, std_us, fused_us in measure_commit(artifact, threads=threads):
        click.echo(f"{name:>26}  {std_us:>25.1f} us  {fused_us:>26.1f} us")


if __name__ == "__main__":
    main()

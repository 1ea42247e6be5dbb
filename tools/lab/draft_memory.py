"""`python tools/lab/draft_memory.py`: what an opened runtime holds in memory against its artifact, and what the
draft calls cost, with the chain tree graphs' sessions on the shared draft weights (the runtime's way for float32
artifacts, runtime/shared_weights.py) or each draft session loading and pre-packing its own copy (as before).

``make DIR``: a random-weight float32 artifact big enough that the weights dominate (a Llama-shaped target and an
EAGLE-1/2 head; ``--hidden``, ``--vocab``, ``--layers``; ``--chain``: a depth-6 chain as the default tree), built
with the test helpers (tools/testing/tiny_models.py). ``open ARTIFACT``: in a fresh child process per mode, the
resident set after ``EagleRuntime.open`` and after a generation with each of ``--tree`` (by default: the default
tree, the same top_k one level shallower, which opens a second tree session, and top_k 5, which drafts with the step
graph), less the one before opening, against the artifact's bytes on disk. ``time ARTIFACT``: the same generations
on a runtime of each mode in one process, interleaved in alternating order, and the mean time of a draft tree graph
call, a step graph call and a target call (ONNX Runtime's run alone), medians over repeats. docs/runtime.md ("Draft
weights in memory") has the figures. A program that prints figures, not a test.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

import click

MODES = ("shared", "private")


def _status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process in bytes (/proc/self/status), and Pss (/proc/self/smaps_rollup)."""
    got: dict[str, int] = {}
    for path, keys in (("/proc/self/status", ("VmRSS", "RssAnon", "RssFile")), ("/proc/self/smaps_rollup", ("Pss",))):
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys:
                got[key] = int(rest.split()[0]) * 1024
    return got


def _set_mode(mode: str) -> None:
    """``private``: every draft session loads its own weights and pre-packs them (the runtime before sharing).
    Imports the backend (and so onnxruntime) in either mode, before the first figure is taken."""
    from eagle_export.runtime import ort_backend

    if mode == "private":
        ort_backend.shares_draft_weights = lambda manifest, device: False


def _trees(rt, spec: tuple[str, ...]):
    from eagle_export.tree_params import TreeParams

    if spec:
        return [TreeParams(*(int(x) for x in s.split(","))) for s in spec]
    t = rt.manifest.tree_defaults
    other = t.depth - 1 if t.depth > 1 else 2
    return [t, TreeParams(t.top_k, other, min(t.total_tokens, t.top_k + (other - 1) * t.top_k ** 2)),
            TreeParams(5, 2, 10)]


def _prompt(rt) -> list[int]:
    v = rt.manifest.target.vocab_size
    return [(7 * j + 3) % v for j in range(48)]


def artifact_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file())


@click.group()
def main() -> None:
    """Memory and draft-call time of an opened runtime, draft weights shared or private."""


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--hidden", default=1024, show_default=True)
@click.option("--vocab", default=32000, show_default=True)
@click.option("--layers", default=2, show_default=True, help="Target decoder layers.")
@click.option("--heads", default=16, show_default=True)
@click.option("--chain", is_flag=True, help="Default tree a depth-6 chain (the fixture's EAGLE-1/2 default).")
def make(out: Path, hidden: int, vocab: int, layers: int, heads: int, chain: bool) -> None:
    """A random-weight float32 artifact in OUT/artifact (target and EAGLE-1/2 head in OUT)."""
    from eagle_export.export.exporter import ExportOptions, export_artifact
    from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_target
    from eagle_export.tree_params import TreeParams

    target = make_tiny_target(out / "target", "mha", with_tokenizer=False, vocab_size=vocab, hidden_size=hidden,
                              num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=layers,
                              intermediate_size=hidden * 11 // 4, initializer_range=0.02)
    draft = make_tiny_draft(out / "draft", target, seed=1, init_scale=0.02)
    art = export_artifact(target, draft, out / "artifact", ExportOptions(
        dtype="fp32", max_seq_len=512, overwrite=True, tree=TreeParams(1, 6, 6) if chain else TreeParams()),
        progress=False)
    click.echo(f"{art}: {artifact_bytes(art) / 2**20:.1f} MiB")


@main.command("open")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--tree", "trees", multiple=True, help="top_k,depth,total_tokens (repeatable; default: see above).")
@click.option("--threads", default=2, show_default=True)
@click.option("--child", type=click.Choice(MODES), default=None, hidden=True)
def open_(artifact: Path, trees: tuple[str, ...], threads: int, child: str | None) -> None:
    """Resident memory after open and after generating, per mode, each in a fresh process."""
    if child is not None:
        _set_mode(child)
        from eagle_export.runtime import EagleRuntime

        gc.collect()
        before = _status()
        rt = EagleRuntime.open(artifact, threads=threads, guard=False)
        gc.collect()
        opened = _status()
        for tree in _trees(rt, trees):
            rt.generate(prompt_ids=_prompt(rt), max_new_tokens=16, tree=tree, stop_on_eos=False)
        gc.collect()
        ran = _status()
        print(json.dumps({"open": {k: opened[k] - before[k] for k in before},
                          "ran": {k: ran[k] - before[k] for k in before},
                          "open_s": rt.open_s, "graphs": sorted(rt.backend.graphs)}))
        return
    size = artifact_bytes(artifact)
    click.echo(f"{artifact}: {size / 2**20:.1f} MiB on disk; resident set less the one before opening "
               f"(VmRSS; RssAnon + RssFile; Pss), MiB and x the artifact")
    for mode in MODES:
        cmd = [sys.executable, __file__, "open", str(artifact), "--threads", str(threads), "--child", mode]
        for t in trees:
            cmd += ["--tree", t]
        got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        for when in ("open", "ran"):
            m = got[when]
            click.echo(f"  {mode:>8} after {when:<5} {m['VmRSS'] / 2**20:8.1f} ({m['VmRSS'] / size:.3f}x)  "
                       f"anon {m['RssAnon'] / 2**20:7.1f} file {m['RssFile'] / 2**20:7.1f}  "
                       f"pss {m['Pss'] / 2**20:7.1f} ({m['Pss'] / size:.3f}x)")
        click.echo(f"  {mode:>8} open {got['open_s']:.2f} s, sessions at the end: {', '.join(got['graphs'])}")


@main.command("time")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--tree", "trees", multiple=True, help="top_k,depth,total_tokens (repeatable).")
@click.option("--threads", default=2, show_default=True)
@click.option("--repeats", default=5, show_default=True)
@click.option("--max-new-tokens", default=32, show_default=True)
def time_(artifact: Path, trees: tuple[str, ...], threads: int, repeats: int, max_new_tokens: int) -> None:
    """Per-call time of the draft tree graph and the step graph, shared against private weights, interleaved."""
    from eagle_export import contract as C
    from eagle_export.runtime import EagleRuntime, ort_backend
    from eagle_export.runtime.timing import TimingBackend

    real = ort_backend.shares_draft_weights
    rts = {}
    for mode in MODES:
        ort_backend.shares_draft_weights = real if mode == "shared" else (lambda manifest, device: False)
        rt = EagleRuntime.open(artifact, threads=threads, guard=False)
        proxy = TimingBackend(rt.generator.backend)
        rt.generator.backend = rt.backend = proxy
        rts[mode] = (rt, proxy)
    ort_backend.shares_draft_weights = real
    first = rts["shared"][0]
    todo = _trees(first, trees)
    prompt = _prompt(first)
    per: dict[tuple[str, str], list[float]] = {}
    for rep in range(repeats + 1):  # the first pass warms up, not counted
        for mode, (rt, proxy) in (list(rts.items()) if rep % 2 else list(rts.items())[::-1]):  # order alternates
            proxy.reset()
            for tree in todo:
                rt.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, tree=tree, stop_on_eos=False)
            if rep == 0:
                continue
            tree_s = sum(t for g, t in proxy.seconds.items() if C.is_tree_graph(g))
            tree_n = sum(n for g, n in proxy.calls.items() if C.is_tree_graph(g))
            for what, s, n in (("tree", tree_s, tree_n), ("step", proxy.seconds[C.DRAFT_GRAPH],
                                                          proxy.calls[C.DRAFT_GRAPH]),
                               ("target", proxy.target_seconds, sum(proxy.calls[g] for g in (C.TARGET_GRAPH,
                                                                                          C.TARGET_FUSED_GRAPH)))):
                if n:
                    per.setdefault((mode, what), []).append(1e3 * s / n)
    click.echo(f"{artifact}: trees {[(t.top_k, t.depth, t.total_tokens) for t in todo]}, {threads} threads, "
               f"ms per call, median (min-max) of {repeats} interleaved passes")
    for what in ("tree", "step", "target"):
        cells = []
        for mode in MODES:
            xs = per.get((mode, what))
            if xs:
                cells.append(f"{mode} {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        click.echo(f"  {what:>6}: " + "   ".join(cells))


if __name__ == "__main__":
    main()

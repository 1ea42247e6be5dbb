"""`python tools/lab/round_bench.py ARTIFACT`: where an EAGLE round's time goes, per drafting mode.

Opens the artifact twice on ONNX Runtime: drafting with the draft tree graph (one draft call a round, the default
where the artifact has one) and with the step graph alone (one call per tree level plus the context pass). Runs the
same prompts through both, interleaved, ``--repeats`` times, and prints per round: the draft graph's time, the
target graph's time, the host's (everything else: Python, numpy, binding), the draft calls and all graph calls (the
prompts' prefill calls included), and tok/s (medians over repeats). The figures of docs/runtime.md ("Where a round's
time goes") come from it. A program that prints figures, not a test.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from eagle_export import contract as C
from eagle_export.prompts import prompt_ids, read_prompts
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.timing import TimingBackend
from eagle_export.tools.commands.bench import builtin_prompts


def _install(rt: EagleRuntime) -> TimingBackend:
    proxy = TimingBackend(rt.generator.backend)
    rt.generator.backend = rt.backend = proxy
    return proxy


def one_pass(rt: EagleRuntime, proxy: TimingBackend, ids: list[list[int]], max_new: int) -> dict:
    proxy.reset()
    rounds = tokens = 0
    t0 = time.perf_counter()
    for p in ids:
        r = rt.generate(prompt_ids=p, max_new_tokens=max_new, stop_on_eos=False)
        rounds += r.stats.rounds
        tokens += len(r.tokens)
    wall = time.perf_counter() - t0
    draft, target = proxy.draft_seconds, proxy.target_seconds
    calls = sum(n for g, n in proxy.calls.items() if g == C.DRAFT_GRAPH or C.is_tree_graph(g))
    every = sum(proxy.calls.values())  # the prompts' prefill calls included, spread over the rounds
    return {"tok/s": tokens / wall, "draft ms/round": 1e3 * draft / rounds, "target ms/round": 1e3 * target / rounds,
            "host ms/round": 1e3 * (wall - draft - target) / rounds, "host %": 100 * (wall - draft - target) / wall,
            "draft calls/round": calls / rounds, "graph calls/round": every / rounds, "tau": tokens / rounds}


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSON lines as `bench --prompts` takes them (default: bench's built-in set).")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--spin", type=click.Choice(["off", "run", "on"]), default="off", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Interleaved passes per mode.")
def main(artifact: Path, prompts: Path | None, max_new_tokens: int, threads: int, spin: str, repeats: int) -> None:
    modes = {"tree graph": True, "step graph": False}
    rts = {name: EagleRuntime.open(artifact, threads=threads, spin=spin, draft_tree=on) for name, on in modes.items()}
    first = next(iter(rts.values()))
    specs = read_prompts(prompts) if prompts else builtin_prompts(first.manifest.has_tokenizer,
                                                                   first.manifest.target.vocab_size)
    ids = [prompt_ids(first, s) for s in specs]
    proxies = {name: _install(rt) for name, rt in rts.items()}
    if rts["tree graph"].backend.tree_graph is None:
        raise click.ClickException(f"{artifact} has no draft tree graph (exported before contract 5?)")
    for name, rt in rts.items():  # warm-up, not counted
        one_pass(rt, proxies[name], ids[:1], 8)
    passes: dict[str, list[dict]] = {name: [] for name in rts}
    for _ in range(repeats):
        for name, rt in rts.items():
            passes[name].append(one_pass(rt, proxies[name], ids, max_new_tokens))
    keys = list(passes["tree graph"][0])
    click.echo(f"{artifact}: {len(ids)} prompts x {max_new_tokens} tokens, {threads} threads, spin {spin}, medians of "
               f"{repeats} interleaved passes")
    click.echo(f"{'':>20}" + "".join(f"{name:>14}" for name in rts))
    for k in keys:
        click.echo(f"{k:>20}" + "".join(f"{statistics.median(p[k] for p in passes[name]):>14.3f}" for name in rts))


if __name__ == "__main__":
    main()

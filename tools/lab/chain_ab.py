"""`python tools/lab/chain_ab.py ARTIFACT [--prompts FILE] ...`: a guarded chain with and without its short chain.

Opens three runtimes on ARTIFACT in one process: guarded with the short chain (``GuardPolicy()``, the default),
guarded without it (``chain_short=0``), and plain decoding (``guard=False``, ``use_draft=False``). For every pass and
every prompt it runs the three one after the other, the order rotating from prompt to prompt, EOS ignored; the first
pass warms up and is not counted. Every output must equal plain decoding's (it stops with an error otherwise). Prints,
over the per-prompt medians, each guarded runtime's speed against plain decoding (geomean of the per-prompt ratios,
and the worst prompt), the short rounds, drafting rounds and rounds it ran, and the two guarded runtimes against each
other. The figures of docs/runtime.md ("A chain's length per request") come from it. A program that prints figures,
not a test.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import click

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.guard import GuardPolicy

MODES = ("short", "base only", "plain")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def read_prompts(path: Path, n: int) -> list[str]:
    """The first ``n`` prompts of a JSON-lines file of ``{"prompt": TEXT}`` objects."""
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:n]


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=Path(__file__).resolve().parents[2] / "fixture" / "prompts.jsonl", show_default=True)
@click.option("--count", default=12, show_default=True, help="How many of the file's prompts.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--passes", default=4, show_default=True, help="Counted passes (after one warm-up pass).")
@click.option("--threads", default=2, show_default=True)
def main(artifact: Path, prompts_file: Path, count: int, max_new_tokens: int, passes: int, threads: int) -> None:
    rts = {"short": EagleRuntime.open(artifact, threads=threads, guard=GuardPolicy()),
           "base only": EagleRuntime.open(artifact, threads=threads, guard=GuardPolicy(chain_short=0.0)),
           "plain": EagleRuntime.open(artifact, threads=threads, guard=False)}
    ids = [rts["plain"].encode(p) for p in read_prompts(prompts_file, count)]
    times = {m: [[] for _ in ids] for m in MODES}
    rounds = {m: [0, 0, 0] for m in MODES}  # short, drafting, all
    want: dict[int, list[int]] = {}
    for turn in range(passes + 1):
        for i, x in enumerate(ids):
            k = (turn + i) % len(MODES)
            for m in MODES[k:] + MODES[:k]:
                t0 = time.perf_counter()
                r = rts[m].generate(prompt_ids=x, max_new_tokens=max_new_tokens, stop_on_eos=False,
                                    use_draft=m != "plain")
                took = time.perf_counter() - t0
                if want.setdefault(i, r.tokens) != r.tokens:
                    raise click.ClickException(f"prompt {i + 1}: {m} made other tokens than plain decoding")
                if turn:
                    times[m][i].append(took)
                    s = r.stats
                    for j, v in enumerate((s.short_rounds, s.spec_rounds, s.rounds)):
                        rounds[m][j] += v
    med = {m: [statistics.median(v) for v in times[m]] for m in MODES}
    click.echo(f"{artifact}: {len(ids)} prompts x {max_new_tokens} tokens, {passes} passes, {threads} threads")
    for m in ("short", "base only"):
        r = [p / e for p, e in zip(med["plain"], med[m], strict=True)]
        s, d, n = rounds[m]
        click.echo(f"  guarded, {m:9s}: {geomean(r):.3f}x plain decoding (worst prompt {min(r):.2f}x); "
                   f"{s} short rounds, {d} drafting, {n} in all")
    r = [b / a for a, b in zip(med["short"], med["base only"], strict=True)]
    click.echo(f"  with the short chain over without: {geomean(r):.3f} (prompts {min(r):.2f} to {max(r):.2f})")


if __name__ == "__main__":
    main()

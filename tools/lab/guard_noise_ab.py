"""`python tools/lab/guard_noise_ab.py ARTIFACT [--window 9 --window 33] [--spinner] ...`: the guard's cost figures
over windows of several lengths, on a machine with slow moments.

Opens one runtime per ``--window`` (``RoundCosts.WINDOW``, the rounds each cost median is over; the guard on as
default) on ARTIFACT in one process. Each pass runs every prompt on every runtime as ``bench`` does: the request
(EAGLE, the artifact's default tree, EOS ignored), then its ``--no-draft`` twin on the same runtime (which measures the
plain figure the guard reads), the runtimes' order rotating from prompt to prompt; the first pass warms up and is not
counted. ``--spinner`` starts a process beside it that spins one core for 50-300 ms at random moments 0.2-1 s apart (a
shared machine's slow moments, which on a 2-vCPU VM can last a whole request). Every EAGLE output must equal its twin's
(it stops with an error otherwise). Prints per window: the geomean of the per-prompt median speeds over plain decoding,
the geomean over every request, and the requests that ran mostly plain (fewer than half their rounds drafted) among
the prompts whose draft pays (``--paying``, 1-based; default 1,3,4: the built-in prompts whose draft pays on the
fixture). The figures of docs/runtime.md ("The speculation guard", the window of 33 rounds) come from it. A program
that prints figures, not a test.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time
from pathlib import Path

import click
from chain_ab import geomean, read_prompts

from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.bench import TEXT_PROMPTS  # bench's built-in prompts


def spin_at_random(seed: int) -> None:
    """Forever: sleep 0.2-1 s, then keep one core busy for 50-300 ms."""
    rng = random.Random(seed)
    while True:
        time.sleep(rng.uniform(0.2, 1.0))
        end = time.perf_counter() + rng.uniform(0.05, 0.3)
        while time.perf_counter() < end:
            pass


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--window", "windows", type=int, multiple=True, default=(9, 33), show_default=True,
              help="RoundCosts.WINDOW of one runtime (repeat for several).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSON lines of {\"prompt\": TEXT} (default: bench's four built-in prompts).")
@click.option("--count", default=12, show_default=True, help="How many of --prompts' prompts.")
@click.option("--paying", default="1,3,4", show_default=True,
              help="Prompts (1-based) whose draft pays: their mostly-plain requests are counted.")
@click.option("--passes", default=30, show_default=True, help="Counted passes (after one warm-up pass).")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--spinner/--no-spinner", default=False, show_default=True,
              help="A process beside it spinning one core at random moments.")
def main(artifact: Path, windows: tuple[int, ...], prompts_file: Path | None, count: int, paying: str,
         passes: int, max_new_tokens: int, threads: int, spinner: bool) -> None:
    texts = TEXT_PROMPTS if prompts_file is None else read_prompts(prompts_file, count)
    pays = {int(i) - 1 for i in paying.split(",") if i.strip()} & set(range(len(texts)))
    rts = {}
    for w in windows:
        rt = EagleRuntime.open(artifact, threads=threads)
        rt.generator.costs.WINDOW = w
        rts[w] = rt
    keys = list(rts)
    ids = [rts[keys[0]].encode(t) for t in texts]
    speed = {w: [[] for _ in ids] for w in keys}
    mostly_plain = dict.fromkeys(keys, 0)
    noise = mp.Process(target=spin_at_random, args=(1,), daemon=True) if spinner else None
    if noise is not None:
        noise.start()
    try:
        for turn in range(passes + 1):
            for i, x in enumerate(ids):
                j = (turn * len(ids) + i) % len(keys)
                for w in keys[j:] + keys[:j]:
                    rt = rts[w]
                    t0 = time.perf_counter()
                    r = rt.generate(prompt_ids=x, max_new_tokens=max_new_tokens, stop_on_eos=False)
                    t1 = time.perf_counter()
                    p = rt.generate(prompt_ids=x, max_new_tokens=max_new_tokens, stop_on_eos=False, use_draft=False)
                    t2 = time.perf_counter()
                    if r.tokens != p.tokens:
                        raise click.ClickException(f"prompt {i + 1}, window {w}: EAGLE made other tokens than plain "
                                                   "decoding")
                    if turn:
                        speed[w][i].append((t2 - t1) / (t1 - t0))
                        if i in pays and r.stats.spec_rounds < r.stats.rounds / 2:
                            mostly_plain[w] += 1
    finally:
        if noise is not None:
            noise.terminate()
    click.echo(f"{artifact}: {len(ids)} prompts x {max_new_tokens} tokens, {passes} passes, {threads} threads"
               f"{', a spinner beside it' if spinner else ''}; speed over plain decoding on the same runtime")
    for w in keys:
        meds = [statistics.median(v) for v in speed[w]]
        every = [v for vs in speed[w] for v in vs]
        click.echo(f"  window {w:3d}: per-prompt medians {geomean(meds):.3f}x ({' '.join(f'{m:.2f}' for m in meds)}),"
                   f" every request {geomean(every):.3f}x; paying requests run mostly plain: "
                   f"{mostly_plain[w]} of {len(pays) * passes}")


if __name__ == "__main__":
    main()

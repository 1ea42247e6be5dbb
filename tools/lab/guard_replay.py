"""The speculation guard's policies compared on recorded acceptance, with no clock in the loop.

    python tools/lab/guard_replay.py record ARTIFACT --out rec.json [--prompts FILE] [--max-new-tokens 128]
    python tools/lab/guard_replay.py replay rec.json [--ratio 2,3,4] [--read-cost 1.0]

``record`` decodes every prompt plainly (greedy, EOS ignored), then, for every position k of the output, runs one
speculative round from there (the prompt and the first k - 1 tokens as the prompt, the artifact's default tree, the
guard off) and keeps what it accepted, ``a(k)``: what a round would commit at every point of the text, ``a(k) + 1``.
A shadow read's hit at token k (the draft's top-k held it) is ``a(k) >= 1``.

``replay`` runs the runtime's ``Guard`` (runtime/guard.py, the same object) over those records as the generator
drives it: a speculative round commits ``a(k) + 1`` tokens and costs ``ratio`` plain steps, a plain round one token
and one step, a shadow read ``--read-cost`` steps when ``shadow_due`` says so, its hits over the lagging tokens; the
runtime's running tau for the tree (``RoundCosts.prior``) carries from prompt to prompt as in one runtime. It prints
each policy's speed against plain decoding (plain steps over the steps it took) and against always drafting, per
prompt and over all prompts, for each ratio. The costs are models (a round's cost does not depend on what it
accepted; a probe's catch-up pass is in its round): measured ratios come from ``bench``'s split or ``round_bench``.
What it compares is the policies' decisions, the same for every run, where a timed A/B on a shared 2-core machine
moved more between identical runs than between the policies.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace
from pathlib import Path

import click

from eagle_export.runtime.guard import PLAIN, SPEC, Guard, GuardPolicy, RoundCosts

# The policies compared: the one before 2026-12-06 (reads every 8/16/32... tokens judged on all they read, a collapse
# caught over 4 rounds), each of that day's three changes alone, and the default (all three).
BEFORE = GuardPolicy(shadow_window=10 ** 6, window=4)
POLICIES = {
    "before (reads every 8/16/32..., all lagged tokens, window 4)": (BEFORE, False),
    "+ reads spaced by their cost": (BEFORE, True),
    "+ reads judged on their last 16 tokens": (replace(BEFORE, shadow_window=16), False),
    "+ a collapse caught over 3 rounds": (replace(BEFORE, window=3), False),
    "default (all three)": (GuardPolicy(), True),
}


def replay_one(policy: GuardPolicy, floor: bool, accepted: list[int], depth: int, ratio: float, read_cost: float,
               costs: RoundCosts, tree, seen: float | None = None) -> float:
    """Plain steps one request took over its ``len(accepted)`` tokens (the first comes from the prefill) under
    ``policy``; ``accepted[k]``: what a round from k committed tokens accepts. ``costs`` carries the running tau.
    seen: the ratio the guard reads (a figure measured in a slow or fast moment; default ``ratio``, which is what a
    speculative round costs either way)."""
    n = len(accepted)
    seen = ratio if seen is None else seen
    g = Guard(policy, prior=costs.prior(tree))
    g.start(seen)
    k, steps, lag0 = 1, 0.0, None  # lag0: the first committed token the draft has not read
    while k < n:
        if g.mode == SPEC:
            committed = min(accepted[k] + 1, n - k)
            steps += ratio
            costs.note_tau(tree, committed)
            nxt = g.after(SPEC, committed, seen)
            if nxt == PLAIN:  # leaving: its accepted path goes to the lag rows
                lag0 = k
            else:
                lag0 = None
        else:
            committed = 1
            steps += 1.0
            g.after(PLAIN, 1, None)
            if lag0 is None:
                lag0 = k
        k += committed
        if lag0 is not None and g.shadow_due(k - lag0, read_cost if floor else None):
            steps += read_cost
            # rows of tokens lag0 .. k-1 predict tokens lag0+1 .. k-1; the last shadow_window of them count
            window = min(k - lag0 - 1, policy.shadow_window)
            hits = sum(accepted[q] >= 1 for q in range(k - window, k))
            g.shadow(hits, window, depth, seen)
            lag0 = None if g.mode == SPEC else k
    return steps


@click.group()
def main() -> None:
    """Record acceptance at every position, then replay guard policies over it."""


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSON lines as `bench --prompts` takes them (default: the fixture's prompts file).")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--threads", default=2, show_default=True)
def record(artifact: Path, out: Path, prompts: Path | None, max_new_tokens: int, threads: int) -> None:
    from eagle_export.prompts import prompt_ids, read_prompts
    from eagle_export.runtime import EagleRuntime

    rt = EagleRuntime.open(artifact, threads=threads, guard=False)
    tree = rt.manifest.tree_defaults
    specs = read_prompts(prompts or Path(__file__).resolve().parents[2] / "fixture" / "prompts.jsonl")
    rows = []
    with click.progressbar(specs, label="prompts") as bar:
        for spec in bar:
            ids = list(prompt_ids(rt, spec))
            tokens = rt.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, use_draft=False,
                                 stop_on_eos=False).tokens
            accepted = [0]
            for k in range(1, len(tokens)):
                r = rt.generate(prompt_ids=ids + tokens[:k - 1], max_new_tokens=tree.total_tokens + tree.depth + 2,
                                stop_on_eos=False)
                a = r.stats.accept_lengths[0]
                m = min(a + 2, len(tokens) - k + 1)  # the round's tokens that plain decoding's run reached
                if r.tokens[:m] != tokens[k - 1:k - 1 + m]:
                    raise click.ClickException(f"{spec.source}: the round at {k} committed other tokens than plain "
                                               "decoding (not lossless: stop and look)")
                accepted.append(a)
            rows.append({"prompt": spec.source, "accepted": accepted})
    out.write_text(json.dumps({"artifact": str(artifact), "tree": tree.to_dict(), "prompts": rows}))
    click.echo(f"wrote {out}: {len(rows)} prompts x {max_new_tokens} tokens")


@main.command()
@click.argument("recording", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--ratio", default="2,3,4", show_default=True, help="A speculative round's cost in plain steps.")
@click.option("--read-cost", default=1.0, show_default=True, help="A shadow read's cost in plain steps.")
@click.option("--noise", default=0.0, show_default=True,
              help="Each request's guard reads the ratio times exp(N(0, NOISE)) (seeded), as a figure measured in a "
                   "slow or fast moment; its rounds still cost the ratio.")
def replay(recording: Path, ratio: str, read_cost: float, noise: float) -> None:
    rec = json.loads(recording.read_text())
    depth = rec["tree"]["depth"]
    tree = tuple(sorted(rec["tree"].items()))
    for r in (float(x) for x in ratio.split(",")):
        click.echo(f"\nratio {r:g} plain steps a round, a read {read_cost:g} steps ({recording.name}, depth {depth})")
        always = []
        for p in rec["prompts"]:
            acc, k, rounds = p["accepted"], 1, 0
            while k < len(acc):
                k += min(acc[k] + 1, len(acc) - k)
                rounds += 1
            always.append((len(acc) - 1) / (rounds * r))
        click.echo(f"  {'always drafting':62s} speed vs plain: all {_total(rec, always):.3f}x, worst prompt "
                   f"{min(always):.3f}x")
        for name, (policy, floor) in POLICIES.items():
            costs, rng = RoundCosts(), random.Random(0)  # every policy reads the same figures
            speeds = [(len(p["accepted"]) - 1) / replay_one(policy, floor, p["accepted"], depth, r, read_cost, costs,
                                                              tree, r * math.exp(rng.gauss(0.0, noise)))
                      for p in rec["prompts"]]
            vs = [s / a for s, a in zip(speeds, always, strict=True)]
            click.echo(f"  {name:62s} speed vs plain: all {_total(rec, speeds):.3f}x, worst prompt "
                       f"{min(speeds):.3f}x, median {statistics.median(speeds):.3f}x; vs always drafting: median "
                       f"{statistics.median(vs):.3f}x, worst {min(vs):.3f}x")


def _total(rec: dict, speeds: list[float]) -> float:
    """Speed over all prompts: their tokens over their steps."""
    tokens = [len(p["accepted"]) - 1 for p in rec["prompts"]]
    return sum(tokens) / sum(t / s for t, s in zip(tokens, speeds, strict=True))


if __name__ == "__main__":
    main()

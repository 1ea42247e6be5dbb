"""The speedup a size can reach: per-round costs measured on an artifact of that size, combined with an acceptance
profile, give each tree's tokens/s; the best tree against our plain decoding and the peer's.

    python tools/lab/projection.py measure ARTIFACT --out costs.json [--tree 1,4,4 ...] [--tokens 48]
        [--prompt-len 256] [--threads 2] [--peer-dir DIR] [--prompts FILE]
    python tools/lab/projection.py project costs.json --profile PROFILE [--label TEXT]

``measure`` runs the runtime as it decodes (speculation guard off, EOS ignored) on one prompt of --prompt-len ids
(or on every prompt of --prompts, a trained pair's prompt file): plain decoding, then each tree, and records per
round the draft, target and host milliseconds (the generator's own split), the tau the tree reached and its
acceptance per depth (n-alpha). With --peer-dir (a model onnxruntime-genai's builder made of the same target) the
peer's milliseconds per token in its own loop, same prompt. Random-weight artifacts accept nothing; their costs are
what a round costs at that size, whatever the head knows.

``project`` reads such costs and an acceptance PROFILE (JSON), and for every measured tree

    tokens/s = tau / (draft + verify + host per round),   plain: 1 / (step + host per step)

with tau from the profile: ``{"per_depth": {"1": [a1, a2, ...], "4": [...]}}`` (per top_k, the acceptance at each
depth given the one above, as ``bench`` prints it; tau = 1 + sum over depths d of a1 x ... x ad, the tree's
total_tokens not modelled, so use it for the trees it was measured with or chains), ``{"geometric": {"tokens": K,
"tau": T}}`` (a published chain figure: K draft tokens a round reaching tau T, one acceptance a at every depth,
solved from T = 1 + a + ... + a^K), ``from:K/D/T`` (the acceptance per depth one measured tree reached, for the
other trees of its top_k: the check of the projection, a deep chain's profile predicting the shallower chains'
measured tokens/s), or ``measured`` (each tree's own tau). docs/bench.md ("The speedup each size can reach") has
the figures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click


def chain_tau(per_depth: list[float], depth: int) -> float:
    """Expected committed tokens a round (bonus included) of a tree of ``depth`` levels whose path survives level d
    with probability per_depth[d - 1] given level d - 1: 1 + sum_d prod_{i <= d} a_i."""
    if depth > len(per_depth):
        raise ValueError(f"the profile has {len(per_depth)} depths, the tree {depth}")
    tau, p = 1.0, 1.0
    for a in per_depth[:depth]:
        p *= a or 0.0  # None: no round reached the depth above (bench's n_alpha), so none survives it
        tau += p
    return tau


def geometric_rate(tokens: int, tau: float) -> float:
    """The per-depth acceptance a with 1 + a + ... + a^tokens = tau (bisection; tau in [1, tokens + 1])."""
    if not 1.0 <= tau <= tokens + 1:
        raise ValueError(f"tau {tau} is outside [1, {tokens + 1}] for {tokens} draft tokens")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if chain_tau([mid] * tokens, tokens) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def tree_tau(profile: dict, key: str, tree: dict) -> float:
    """The profile's tau for a measured tree (``tree``: its costs entry, top_k/depth and the tau it measured)."""
    if profile == "measured":
        return tree["tau"]
    k, depth = tree["top_k"], tree["depth"]
    if "geometric" in profile:
        g = profile["geometric"]
        if k != 1:
            raise ValueError("a geometric profile describes chains (top_k 1)")
        return chain_tau([geometric_rate(g["tokens"], g["tau"])] * depth, depth)
    rates = profile["per_depth"].get(str(k))
    if rates is None:
        raise ValueError(f"the profile has no acceptance for top_k {k} (tree {key})")
    return chain_tau(rates, depth)


def project(costs: dict, profile) -> list[dict]:
    """One row per measured tree the profile covers, best first: tau, round ms, tokens/s, x our plain, x the peer."""
    plain = costs["plain"]
    plain_tok_s = 1000.0 / (plain["target_ms"] + plain["host_ms"])
    peer_tok_s = 1000.0 / costs["peer_ms"] if costs.get("peer_ms") else None
    rows = []
    for key, t in costs["trees"].items():
        try:
            tau = tree_tau(profile, key, t)
        except ValueError:
            continue
        round_ms = t["draft_ms"] + t["verify_ms"] + t["host_ms"]
        tok_s = 1000.0 * tau / round_ms
        rows.append({"tree": key, "tau": tau, "round_ms": round_ms, "tok_s": tok_s, "vs_plain": tok_s / plain_tok_s,
                     "vs_peer": None if peer_tok_s is None else tok_s / peer_tok_s,
                     "measured_tok_s": t.get("tok_s")})
    rows.sort(key=lambda r: -r["tok_s"])
    return rows


def _measure_one(rt, prompts, tree, tokens: int) -> dict:
    draft = target = host = 0.0
    rounds = spec = made = 0
    wall = 0.0
    accepts: list[int] = []
    for ids in prompts:
        t0 = time.perf_counter()
        r = rt.generate(prompt_ids=ids, max_new_tokens=tokens, tree=tree, use_draft=tree is not None,
                        stop_on_eos=False)
        wall += time.perf_counter() - t0 - r.stats.prefill_s
        st = r.stats
        draft, target, host = draft + st.draft_s, target + st.target_s, host + st.host_s
        # the rounds' tokens: the first comes from the prompt's pass (prefill), outside the rounds and their time
        rounds, spec, made = rounds + st.rounds, spec + st.spec_rounds, made + len(r.tokens) - 1
        accepts += st.spec_accept_lengths
    out = {"rounds": rounds, "target_ms": 1000 * target / rounds, "host_ms": 1000 * host / rounds,
           "tok_s": made / wall}
    if tree is not None:
        from eagle_export.tools.commands.bench import n_alpha

        out.update(top_k=tree.top_k, depth=tree.depth, total_tokens=tree.total_tokens, draft_ms=1000 * draft / spec,
                   verify_ms=out.pop("target_ms"), tau=made / rounds, per_depth=n_alpha(accepts, tree.depth))
    return out


@click.group()
def cli() -> None:
    """Per-round costs at a size, and the speedup they allow at an acceptance profile."""


@cli.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--tree", "trees", multiple=True, help="top_k,depth,total_tokens (repeatable; default: chains 1-6 "
              "and the artifact's default tree)")
@click.option("--tokens", default=48, show_default=True, help="tokens generated per prompt and mode")
@click.option("--prompt-len", default=256, show_default=True, help="ids in the synthetic prompt (cached rows)")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSON lines {\"prompt\": text}: measure on these (the artifact's tokenizer) instead")
@click.option("--threads", default=2, show_default=True)
@click.option("--peer-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
def measure(artifact: Path, out: Path, trees, tokens: int, prompt_len: int, prompts, threads: int, peer_dir) -> None:
    """Per-round costs of plain decoding and of each tree on ARTIFACT, written to --out."""
    from eagle_export.runtime import EagleRuntime
    from eagle_export.tree_params import TreeParams

    with EagleRuntime.open(artifact, threads=threads, guard=False) as rt:
        vocab = rt.manifest.target.vocab_size
        if prompts is not None:
            ids = [rt.encode(json.loads(x)["prompt"]) for x in prompts.read_text().splitlines() if x.strip()]
        else:
            ids = [[(7 * i + 3) % (vocab - 1) for i in range(prompt_len)]]
        chosen = [TreeParams(*(int(x) for x in s.split(","))) for s in trees] or [
            *(TreeParams(1, d, d) for d in range(1, 7)), rt.manifest.tree_defaults]
        rt.generate(prompt_ids=ids[0], max_new_tokens=4, stop_on_eos=False)  # sessions open, caches warm
        got = {"artifact": str(artifact), "threads": threads, "prompts": len(ids), "tokens": tokens,
               "cached_rows": statistics.median(len(x) for x in ids),
               "plain": _measure_one(rt, ids, None, tokens), "trees": {}}
        for t in dict.fromkeys(chosen):
            rt.generate(prompt_ids=ids[0], max_new_tokens=4, tree=t, stop_on_eos=False)  # its session opens
            got["trees"][f"{t.top_k}/{t.depth}/{t.total_tokens}"] = _measure_one(rt, ids, t, tokens)
            click.echo(f"{t.label}: {got['trees'][f'{t.top_k}/{t.depth}/{t.total_tokens}']}", err=True)
    if peer_dir is not None:  # in a process of its own: another session's thread pool slows it (step_vs_peer.py)
        ids_file = out.with_suffix(".prompts.json")
        ids_file.write_text(json.dumps(ids))
        cmd = [sys.executable, __file__, "peer-step", str(peer_dir), str(ids_file), "--tokens", str(tokens),
               "--threads", str(threads)]
        got["peer_ms"] = float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
        ids_file.unlink()
    out.write_text(json.dumps(got, indent=1))
    click.echo(f"wrote {out}")


def _profile(text: str, costs: dict):
    """``project``'s --profile: 'measured', 'from:K/D/T' (the per-depth acceptance a measured tree reached, for every
    tree of its top_k), or a JSON file."""
    if text == "measured":
        return text
    if text.startswith("from:"):
        t = costs["trees"][text[5:]]
        return {"per_depth": {str(t["top_k"]): t["per_depth"]}}
    return json.loads(Path(text).read_text())


@cli.command(name="peer-step", hidden=True)
@click.argument("peer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("ids_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tokens", default=48)
@click.option("--threads", default=2)
def peer_step(peer_dir: Path, ids_file: Path, tokens: int, threads: int) -> None:
    """The peer's milliseconds per generated token in its own loop (after the prompt), median over the prompts."""
    import onnxruntime_genai as og

    cfg_path = peer_dir / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    cfg_path.write_text(json.dumps(cfg, indent=2))
    model = og.Model(str(peer_dir))
    ms = []
    for x in json.loads(ids_file.read_text()):
        p = og.GeneratorParams(model)
        p.set_search_options(do_sample=False, max_length=len(x) + tokens)
        g = og.Generator(model, p)
        g.append_tokens(x)
        t0 = time.perf_counter()
        n = 0
        while not g.is_done() and n < tokens:
            g.generate_next_token()
            n += 1
        ms.append(1000 * (time.perf_counter() - t0) / n)
    click.echo(statistics.median(ms))


@cli.command(name="project")
@click.argument("costs", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--profile", required=True, help="a JSON file; 'measured' (each tree's own tau in COSTS); or "
              "'from:K/D/T' (the acceptance per depth that tree measured, for every tree of its top_k)")
@click.option("--label", default=None)
def project_cmd(costs: Path, profile: str, label: str | None) -> None:
    """Each measured tree's projected tokens/s at PROFILE's acceptance, best first (a markdown table)."""
    c = json.loads(costs.read_text())
    prof = _profile(profile, c)
    plain = c["plain"]
    plain_tok_s = 1000.0 / (plain["target_ms"] + plain["host_ms"])
    click.echo(f"{label or c['artifact']}: projected at {profile}; plain decoding {plain_tok_s:.1f} tok/s "
               f"(step {plain['target_ms']:.2f} + host {plain['host_ms']:.2f} ms; measured {plain['tok_s']:.1f})"
               + (f"; peer {1000 / c['peer_ms']:.1f} tok/s" if c.get("peer_ms") else ""))
    click.echo("| tree | tau | draft + verify + host ms | projected tok/s | x our plain | x the peer "
               "| measured tok/s |")
    click.echo("|---|---|---|---|---|---|---|")
    for r in project(c, prof):
        t = c["trees"][r["tree"]]
        peer = "" if r["vs_peer"] is None else f"{r['vs_peer']:.2f}x"
        meas = (f"{r['measured_tok_s']:.1f} (projected {r['tok_s'] / r['measured_tok_s']:.2f}x)"
                if profile == "measured" or profile.startswith("from:") else "")
        click.echo(f"| {r['tree']} | {r['tau']:.2f} | {t['draft_ms']:.2f} + {t['verify_ms']:.2f} + "
                   f"{t['host_ms']:.2f} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}x | {peer} | {meas} |")


if __name__ == "__main__":
    cli()

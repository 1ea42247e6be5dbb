"""`eagle-export demo`, the README's main job: export the shipped trained fixture, generate a sample, print tau and the
speedup.

    eagle-export demo [--workdir demo] [--max-new-tokens 64] [--heads eagle1,eagle3]

The fixture (``fixture/``, made by ``tools/recipe/make_fixture.py``) is a small trained code model with a trained
EAGLE-1/2 head and a trained EAGLE-3 head. For each head the demo exports an artifact (once, into
WORKDIR/<head>) with the tree that ``eagle-export tune`` picked on a 2-core CPU (``fixture/tree.json``), prints
one EAGLE completion, then runs ``eagle-export bench``'s measurement on the fixture's prompt set: EAGLE and
plain decoding alternately on the same runtime, tau, speedup, where the time goes, and whether EAGLE's tokens
equal plain decoding's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import MANIFEST_NAME
from eagle_export.prompts import read_prompts
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.bench import bench
from eagle_export.tree_params import TreeParams

FIXTURE = Path(__file__).resolve().parents[2] / "fixture"
HEADS = ("eagle1", "eagle3")


def fixture_tree(head: str, fixture: Path = FIXTURE) -> TreeParams:
    """The tuned default tree recorded for a head in fixture/tree.json."""
    trees = json.loads((fixture / "tree.json").read_text())
    t = trees[head]
    return TreeParams(t["top_k"], t["depth"], t["total_tokens"])


def export_fixture(head: str, out: Path, fixture: Path = FIXTURE) -> Path:
    """Export the fixture's target with one of its heads (fp32, for ONNX Runtime CPU) unless out already holds it.

    Capacity 960: the tree's draft positions run a few past the capacity, and the heads know 1024 positions.
    """
    if not (out / MANIFEST_NAME).is_file():
        tree = fixture_tree(head, fixture)
        export_artifact(fixture / "target", fixture / head, out,
                        ExportOptions(max_seq_len=960, tree=tree, overwrite=True))
    return out


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("demo"), show_default=True)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--heads", default=",".join(HEADS), show_default=True, help="Which of the fixture's heads to run.")
def main(workdir: Path, max_new_tokens: int, heads: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    chosen = [h.strip() for h in heads.split(",") if h.strip()]
    bad = [h for h in chosen if h not in HEADS]
    if bad or not chosen:
        raise click.BadParameter(f"choose from {', '.join(HEADS)}", param_hint="--heads")
    prompts = read_prompts(FIXTURE / "prompts.jsonl")
    for head in chosen:
        art = workdir / head
        click.echo(f"== {head}: exporting fixture/target + fixture/{head} to {art} ..." if not
                   (art / MANIFEST_NAME).is_file() else f"== {head}: artifact {art}")
        export_fixture(head, art)
        rt = EagleRuntime.open(art)
        sample = rt.generate(prompts[0].text, max_new_tokens=max_new_tokens, stop_on_eos=False)
        # A 6.7 M-parameter model trained for 20 minutes writes code-shaped noise: show it compactly.
        text = "\n".join(line for line in (prompts[0].text + (sample.text or "")).splitlines() if line.strip())
        click.echo(f"prompt + EAGLE completion (blank lines dropped; tau {sample.stats.tau:.2f}):\n{text}\n")
        report = bench(art, prompts=prompts, max_new_tokens=max_new_tokens)
        click.echo(report.format())
        click.echo("")


if __name__ == "__main__":
    main()

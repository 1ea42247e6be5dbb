"""The README's main job: make the bundled tiny model, export it, generate, print tau and speedup.

    python -m eagle_export.tools.demo [--workdir demo] [--max-new-tokens 48]

The default model is a tiny random Llama target with a random EAGLE-1/2 head, made offline by
``tools/tiny_models.py``: it proves the pipeline end to end (and losslessness), not speed: a random
head is rarely accepted, so expect tau near 1 and no speedup until a trained head is used.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import click

from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import MANIFEST_NAME
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.tiny_models import make_tiny_draft, make_tiny_target

PROMPTS = ["The quick brown fox", "def main():", "Once upon a time", "import numpy as np"]


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("demo"), show_default=True)
@click.option("--max-new-tokens", type=int, default=48, show_default=True)
def main(workdir: Path, max_new_tokens: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    target, draft, art = workdir / "target", workdir / "draft", workdir / "artifact"
    if not (target / "config.json").is_file():
        click.echo(f"making the tiny model in {workdir} ...")
        make_tiny_target(target, "gqa", seed=0)
        make_tiny_draft(draft, target, seed=1)
    if not (art / MANIFEST_NAME).is_file():
        export_artifact(target, draft, art, ExportOptions(max_seq_len=512, overwrite=True))
    click.echo(f"artifact: {art}")
    rt = EagleRuntime.open(art)
    sample = rt.generate(PROMPTS[0], max_new_tokens=max_new_tokens)
    click.echo(f"\nprompt: {PROMPTS[0]!r}\nEAGLE : {sample.text!r}  (finish={sample.finish_reason})\n")
    speedups, taus, same = [], [], True
    for prompt in PROMPTS:
        kw = dict(max_new_tokens=max_new_tokens, stop_on_eos=False)
        t0 = time.perf_counter()
        base = rt.generate(prompt, use_draft=False, **kw)
        t1 = time.perf_counter()
        eagle = rt.generate(prompt, **kw)
        t2 = time.perf_counter()
        same &= base.tokens == eagle.tokens
        taus.append(eagle.stats.tau)
        speedups.append((t1 - t0) / (t2 - t1))
    click.echo(f"tau (tokens per target forward): {statistics.mean(taus):.2f}")
    click.echo(f"speedup vs --no-draft (median over {len(PROMPTS)} prompts, same run): "
               f"{statistics.median(speedups):.2f}x")
    click.echo(f"lossless (EAGLE tokens == --no-draft tokens): {same}")


if __name__ == "__main__":
    main()

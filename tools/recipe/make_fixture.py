"""Make the shipped fixture from scratch, offline: tokenizer, trained target, trained EAGLE-1/2 and EAGLE-3 heads.

    python -m eagle_export.tools.recipe.make_fixture --work fixture-work --out fixture [--stage all|target|heads|pack]

Stages (each reads the previous one's output from --work, so a stage can be rerun alone):
  target  corpus (the interpreter's stdlib sources) -> BPE tokenizer -> small Llama target (fp32, --work/target)
  heads   the target's greedy continuations of corpus prompts, its features -> EAGLE-1/2 head (--work/eagle1)
          and EAGLE-3 head (--work/eagle3), both in the published layouts
  pack    fp16 copies of the three models in --out, plus CARD.md and recipe.json (figures from the stages);
          the rest of --out (prompts.jsonl, tree.json) is left as it is

Deterministic for a given interpreter (corpus) and torch build: fixed seeds, fixed step counts, no timing-based
decisions. Prints losses and accuracies as it goes; the figures land in --work/*.json and the card.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np

VOCAB = 2048
VAL_TOKENS = 100_000


def _save_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def stage_target(work: Path, steps: int | None, log=click.echo) -> None:
    from .fixture_data import save_tokenizer, stdlib_corpus, token_stream, train_tokenizer
    from .train_target import TargetRecipe, train_target

    t0 = time.perf_counter()
    corpus = stdlib_corpus()
    log(f"corpus: {len(corpus.files)} files, {corpus.chars / 1e6:.1f} M chars from {corpus.root} "
        f"(sha256 {corpus.sha256[:16]})")
    tok = train_tokenizer(corpus.texts, VOCAB)
    stream = token_stream(tok, corpus.texts)
    log(f"tokenizer: BPE {tok.get_vocab_size()} tokens, corpus = {len(stream) / 1e6:.2f} M tokens "
        f"({corpus.chars / len(stream):.2f} chars/token)")
    recipe = TargetRecipe() if steps is None else TargetRecipe(steps=steps)
    train, val = stream[:-VAL_TOKENS], stream[-VAL_TOKENS:]
    model, stats = train_target(train, val, tok.get_vocab_size(), tok.token_to_id("<s>"), tok.token_to_id("</s>"),
                                recipe, log)
    out = work / "target"
    out.mkdir(parents=True, exist_ok=True)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=model.config.eos_token_id, do_sample=False)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    np.save(work / "stream.npy", stream)
    stats.update({"recipe": asdict(recipe), "corpus": {"root": corpus.root, "files": len(corpus.files),
                  "chars": corpus.chars, "tokens": int(len(stream)), "sha256": corpus.sha256,
                  "python": platform.python_version()}, "vocab": tok.get_vocab_size(),
                  "stage_seconds": time.perf_counter() - t0})
    _save_json(work / "target.json", stats)


def stage_heads(work: Path, steps: int | None, log=click.echo) -> None:
    from .train_heads import HeadRecipe, make_head_data, train_head

    t0 = time.perf_counter()
    recipe = HeadRecipe() if steps is None else HeadRecipe(steps=steps)
    data = make_head_data(work, recipe, log)
    results = {"data": data.summary(), "recipe": asdict(recipe)}
    for variant in ("eagle1", "eagle3"):
        results[variant] = train_head(work, variant, data, recipe, log)
    results["stage_seconds"] = time.perf_counter() - t0
    _save_json(work / "heads.json", results)


def stage_pack(work: Path, out: Path, log=click.echo) -> None:
    from .fixture_card import write_card, write_fp16

    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "eagle1", "eagle3"):  # only the recipe's own outputs: prompts.jsonl, tree.json stay
        if (out / name).exists():
            shutil.rmtree(out / name)
        write_fp16(work / name, out / name)
    write_card(work, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"fixture: {out} ({size / 2**20:.1f} MiB)")


@click.command()
@click.option("--work", type=click.Path(path_type=Path), default=Path("fixture-work"), show_default=True,
              help="Scratch directory for the fp32 models and the stage figures.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("fixture"), show_default=True,
              help="Where the fp16 fixture and its card go (the repository's fixture/ by default).")
@click.option("--stage", type=click.Choice(["all", "target", "heads", "pack"]), default="all", show_default=True)
@click.option("--target-steps", type=int, default=None, help="Override the target's step count (quick trials).")
@click.option("--head-steps", type=int, default=None, help="Override each head's step count (quick trials).")
def main(work: Path, out: Path, stage: str, target_steps: int | None, head_steps: int | None) -> None:
    """Make the trained tiny fixture (target + EAGLE-1/2 + EAGLE-3 heads) from scratch."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if stage in ("all", "target"):
        stage_target(work, target_steps)
    if stage in ("all", "heads"):
        stage_heads(work, head_steps)
    if stage in ("all", "pack"):
        stage_pack(work, out)
    click.echo(f"done in {(time.perf_counter() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()

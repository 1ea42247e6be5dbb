"""`eagle-export`: export EAGLE graphs to ONNX and generate with them.

Every user-facing failure is an EagleExportError, printed as one line with exit status 2.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from .errors import EagleExportError
from .tree_params import TreeLimits, TreeParams

_DEF_TREE = TreeParams()
_DEF_LIMITS = TreeLimits()


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EagleExportError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="eagle-export")
def main() -> None:
    """Export EAGLE speculative decoding to ONNX and run it."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")


@main.command("export")
@click.option("--target", "target_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face target directory (config.json + safetensors).")
@click.option("--draft", "draft_dir", required=True, type=click.Path(path_type=Path),
              help="EAGLE-1/2 head directory (config.json + model.safetensors or pytorch_model.bin).")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--max-seq-len", type=int, default=2048, show_default=True,
              help="Cache capacity: prompt plus generated tokens.")
@click.option("--max-top-k", type=int, default=_DEF_LIMITS.max_top_k, show_default=True,
              help="Top-k width computed inside the draft graph (upper bound for --top-k).")
@click.option("--max-depth", type=int, default=_DEF_LIMITS.max_depth, show_default=True)
@click.option("--max-total-tokens", type=int, default=_DEF_LIMITS.max_total_tokens, show_default=True)
@click.option("--top-k", type=int, default=_DEF_TREE.top_k, show_default=True, help="Default tree top_k.")
@click.option("--depth", type=int, default=_DEF_TREE.depth, show_default=True, help="Default tree depth.")
@click.option("--total-tokens", type=int, default=_DEF_TREE.total_tokens, show_default=True,
              help="Default number of draft nodes verified per round.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_cmd(target_dir, draft_dir, out_dir, dtype, max_seq_len, max_top_k, max_depth, max_total_tokens,
               top_k, depth, total_tokens, overwrite, quiet) -> None:
    """Trace the target verify graph and the draft step graph to ONNX in OUT."""
    from .export.exporter import ExportOptions, export_artifact

    opts = ExportOptions(dtype=dtype, max_seq_len=max_seq_len,
                         limits=TreeLimits(max_top_k, max_depth, max_total_tokens),
                         tree=TreeParams(top_k, depth, total_tokens), overwrite=overwrite)
    path = export_artifact(target_dir, draft_dir, out_dir, opts, progress=not quiet)
    click.echo(f"wrote {path}")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise EagleExportError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


@main.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", help="Prompt text (needs the artifact's tokenizer).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--top-k", type=int, default=None, help="Tree top_k (default: the artifact's).")
@click.option("--depth", type=int, default=None, help="Tree depth (default: the artifact's).")
@click.option("--total-tokens", type=int, default=None, help="Draft nodes per round (default: the artifact's).")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding on the same target graph.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--backend", type=click.Choice(["ort"]), default="ort", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate_cmd(artifact, prompt, prompt_ids, max_new_tokens, top_k, depth, total_tokens, no_draft, ignore_eos,
                 backend, as_json) -> None:
    """Generate from ARTIFACT (a directory made by `eagle-export export`)."""
    from .runtime import EagleRuntime

    if (prompt is None) == (prompt_ids is None):
        raise EagleExportError("give exactly one of --prompt or --prompt-ids")
    rt = EagleRuntime.open(artifact, backend=backend)
    d = rt.manifest.tree_defaults
    tree = TreeParams(top_k if top_k is not None else d.top_k, depth if depth is not None else d.depth,
                      total_tokens if total_tokens is not None else d.total_tokens)
    kwargs = dict(max_new_tokens=max_new_tokens, tree=tree, use_draft=not no_draft, stop_on_eos=not ignore_eos)
    if prompt_ids is not None:
        kwargs["prompt_ids"] = _parse_ids(prompt_ids)
    stream = rt.stream(prompt, **kwargs)
    if as_json:
        for _ in stream:
            pass
    else:
        shown = ""
        done: list[int] = []
        for chunk in stream:
            done += chunk
            if rt.tokenizer is None:
                click.echo(" ".join(map(str, chunk)) + " ", nl=False)
            else:  # print the growing text's new suffix, so multi-token characters come out whole
                text = rt.decode(done) or ""
                click.echo(text[len(shown):], nl=False)
                shown = text
        click.echo()
    res = stream.result
    if as_json:
        out = res.to_dict()
        out["mode"] = "no-draft" if no_draft else "eagle"
        out["tree"] = None if no_draft else tree.to_dict()
        click.echo(json.dumps(out))
    else:
        s = res.stats
        click.echo(f"[{len(res.tokens)} tokens, finish={res.finish_reason}, rounds={s.rounds}, tau={s.tau:.2f}, "
                   f"prefill {s.prefill_s * 1e3:.1f} ms, {len(res.tokens) / max(s.decode_s + s.prefill_s, 1e-9):.1f} "
                   "tok/s overall]", err=True)


@main.command("validate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(["ort", "tensorrt"]), default="ort", show_default=True,
              help="Which exported engines to check against PyTorch.")
@click.option("--prompts", type=click.IntRange(min=0), default=8, show_default=True,
              help="Random prompts for the end-to-end checks (0 skips them).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens generated per prompt in the end-to-end checks.")
@click.option("--target", "target_dir", type=click.Path(path_type=Path), default=None,
              help="Original target checkpoint (default: the manifest's target.source).")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path), default=None,
              help="Original draft checkpoint (default: the manifest's draft.source).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs and prompts.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads for PyTorch and ONNX Runtime (default: theirs); 1 is fastest for tiny models.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the readable report.")
def validate_cmd(artifact, backend, prompts, max_new_tokens, target_dir, draft_dir, seed, threads, as_json) -> None:
    """Check ARTIFACT against the PyTorch model: every graph output, greedy tokens, EAGLE rounds.

    Exit status 0 when every check passes, 1 when one fails, 2 on an error in what you give.
    """
    from .tools.validate import validate

    log = None if as_json else (lambda msg: click.echo(f"[validate] {msg}", err=True))
    report = validate(artifact, backend=backend, prompts=prompts, max_new_tokens=max_new_tokens, target=target_dir,
                      draft=draft_dir, seed=seed, threads=threads, log=log)
    click.echo(json.dumps(report.to_dict()) if as_json else report.format())
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()

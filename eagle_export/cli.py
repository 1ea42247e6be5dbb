"""`eagle-export`: export EAGLE graphs to ONNX and generate with them.

Every user-facing failure is an EagleExportError, printed as one line with exit status 2.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
from pathlib import Path

import click

from .errors import EagleExportError
from .export.checkpoint.readings import READING_CHOICES
from .extras import HTTP_CLIENT, RAY, SERVE, require
from .progress import end_open_bars, setup_logging
from .text_stream import TextStream
from .tree_params import TreeLimits, TreeParams, tree_over_defaults

_DEF_TREE = TreeParams()

_THRESHOLD = click.option(
    "--threshold", type=float, default=None,
    help="Tree threshold: draft nodes whose cumulative draft probability is below it are left out of the verify, "
         "so an unsure draft verifies fewer tokens (0 = off; default: the artifact's).")
_NO_GUARD = click.option(
    "--no-guard", is_flag=True,
    help="Draft every round: turn off the speculation guard, which runs plain rounds while speculation is slower "
         "than plain decoding and probes back (docs/runtime.md).")
_DEF_LIMITS = TreeLimits()


# ---- option families shared by the verbs: one declaration each ---------------------------------------------------

BACKENDS = ("ort", "tensorrt")


def _backend_option(f):
    return click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
                        help="ort: ONNX Runtime on the ONNX graphs; tensorrt: the engines of `eagle-export build` "
                             "(CUDA GPU).")(f)


def _threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="Intra-op threads for ONNX Runtime and PyTorch (default: theirs).")(f)


def _tree_options(kind: str):
    """--top-k, --depth, --total-tokens. kind: "export" (the artifact's defaults, recorded at export), "run" (one tree
    for this run, default: the artifact's), "grid" (lists of values to measure, tune)."""
    if kind == "export":
        specs = [("--top-k", dict(type=int, default=_DEF_TREE.top_k, show_default=True, help="Default tree top_k.")),
                 ("--depth", dict(type=int, default=_DEF_TREE.depth, show_default=True, help="Default tree depth.")),
                 ("--total-tokens", dict(type=int, default=_DEF_TREE.total_tokens, show_default=True,
                                         help="Default number of draft nodes verified per round."))]
    elif kind == "run":
        specs = [("--top-k", dict(type=int, default=None, help="Tree top_k (default: the artifact's).")),
                 ("--depth", dict(type=int, default=None, help="Tree depth (default: the artifact's).")),
                 ("--total-tokens", dict(type=int, default=None,
                                         help="Draft nodes per round (default: the artifact's)."))]
    else:
        specs = [("--top-k", dict(default=None, help="top_k values, e.g. 1,2,4,8 or 2-6 [default: 1,2,4,8; on a "
                                                     "quantized artifact at accuracy level 4 on ONNX Runtime: 1,2].")),
                 ("--depth", dict(default=None, help="depth values [default: 2,4,8; quantized as above: 1-5].")),
                 ("--total-tokens", dict(default=None, help="total_tokens values [default: 4,8,16,32,60; quantized "
                                                            "as above: 2-5]."))]

    def apply(f):
        for name, kw in reversed(specs):
            f = click.option(name, **kw)(f)
        return f

    return apply


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EagleExportError as e:
            end_open_bars()  # an interrupted step's bar: the error starts on its own line
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="eagle-export")
def main() -> None:
    """Export EAGLE speculative decoding to ONNX, build TensorRT engines, and run it."""
    setup_logging(logging.WARNING)


@main.command("export")
@click.option("--target", "target_dir", required=True,
              help="Hugging Face target directory (config.json + safetensors), or a Hub repo id (org/name) "
                   "resolved through the Hugging Face cache (HF_HUB_OFFLINE=1: cache only).")
@click.option("--draft", "draft_dir", required=True,
              help="EAGLE head directory (config.json + model.safetensors or pytorch_model.bin) in any published "
                   "format: SafeAILab EAGLE-1/2 or EAGLE-3, SpecForge, speculators, ModelOpt, detected from the "
                   "files (docs/formats.md); or a Hub repo id, as --target.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Artifact directory to write.")
# --dtype spells eagle_export.dtypes.EXPORT_DTYPES (not imported here: it imports torch, and the CLI starts light)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Graph float dtype (bf16 runs on --backend tensorrt only).")
@click.option("--max-seq-len", type=int, default=None,
              help="Cache capacity: prompt plus generated tokens [default: min(2048, the target's "
                   "max_position_embeddings, the head's max_position_embeddings - --max-depth)].")
@click.option("--max-top-k", type=int, default=_DEF_LIMITS.max_top_k, show_default=True,
              help="Top-k width computed inside the draft graph (upper bound for --top-k).")
@click.option("--max-depth", type=int, default=_DEF_LIMITS.max_depth, show_default=True,
              help="Deepest draft tree the graphs allow (upper bound for --depth; sizes the draft's scratch rows).")
@click.option("--max-total-tokens", type=int, default=_DEF_LIMITS.max_total_tokens, show_default=True,
              help="Most draft nodes verified per round (upper bound for --total-tokens; the verify graph takes "
                   "this + 1 tokens).")
@_tree_options("export")
@click.option("--max-batch", type=int, default=1, show_default=True,
              help="Most sequences one runtime decodes at once (the graphs' batch range [1, N], in the manifest).")
@click.option("--fused/--no-fused", default=True, show_default=True,
              help="Also write the fused target graph ONNX Runtime runs (GroupQueryAttention writing the cache in "
                   "place; fp32/fp16 targets with head_dim a multiple of 16; docs/graph-contract.md).")
@click.option("--draft-tree/--no-draft-tree", default=True, show_default=True,
              help="Also write the draft tree graphs: a round's context pass and its tree in one call, one graph per "
                   "top_k grown --max-depth levels (ONNX Runtime drafts with them where a round's top_k has one, "
                   "cut to its depth; docs/graph-contract.md).")
@click.option("--draft-tree-top-k", default=None,
              help="The top_k values to write a draft tree graph for, e.g. 1,2 [default: 1,2,3,4 and --top-k's; "
                   "values above --max-top-k are left out]. Each adds a small graph file and seconds to the export.")
@click.option("--quantize", type=click.Choice(["none", "int4", "int8"]), default="none", show_default=True,
              help="Weight-only block quantization of the target's MatMul weights, its lm_head included (see "
                   "--quantize-float-lm-head); ONNX Runtime runs it as MatMulNBits, TensorRT from DequantizeLinear "
                   "(symmetric only). tools/lab/results.md.")
@click.option("--quantize-block-size", type=int, default=32, show_default=True,
              help="Rows of K sharing one scale (a power of 2 from 16 to 256).")
@click.option("--quantize-symmetric/--quantize-asymmetric", default=True, show_default=True,
              help="Symmetric: signed codes, no zero points (what TensorRT builds). Asymmetric: a zero point per "
                   "block (ONNX Runtime only).")
@click.option("--quantize-accuracy-level", type=int, default=4, show_default=True,
              help="ONNX Runtime's MatMulNBits accuracy level: 4 quantizes activations to int8 (its fast CPU "
                   "kernel), 0/1 compute in float.")
@click.option("--quantize-draft/--quantize-float-draft", default=None,
              help="Quantize the draft graphs too (their MatMuls and the lm_head they read), or keep them float "
                   "[default: quantize: a float draft level costs a third of an int4 step at the 1B shape, an int4 "
                   "one a tenth; the target verifies every token either way].")
@click.option("--quantize-draft-only", type=click.Choice(["int4", "int8"]), default=None,
              help="With --quantize none: quantize the draft graphs alone; the target stays float, and its tokens "
                   "with it. A cheaper draft call; acceptance may move (int8 kept the fixture's; docs/bench.md, "
                   "\"A quantized draft on a float target\"). Takes the --quantize-block-size, -symmetric and "
                   "-accuracy-level settings.")
@click.option("--quantize-lm-head/--quantize-float-lm-head", default=True, show_default=True,
              help="Quantize the target's lm_head as its other MatMuls (onnxruntime-genai's int4 builder does too; "
                   "a tied embedding keeps its float copy), or keep it float: at 128k-token vocabularies a float "
                   "lm_head outweighs the quantized layers.")
@click.option("--quantize-inexact-trees", is_flag=True,
              help="Keep a branching default tree (--top-k > 1) at an accuracy level that rounds activations: more "
                   "tokens per round, but EAGLE may then differ from plain decoding at near-ties (bench and validate "
                   "report where). Without it the default tree is the chain of --depth, on which EAGLE equals plain "
                   "decoding token for token (tools/lab/results.md).")
@click.option("--feature-layers", default=None,
              help="EAGLE-3 only: comma-separated target decoder layers whose inputs the head reads, in the order "
                   "it concatenates them, repeats allowed (default: the ids the checkpoint names, converted to "
                   "inputs of layers, else its format's default, the reference's 2, L//2, L-3).")
@click.option("--head-reading", type=click.Choice(READING_CHOICES), default="auto", show_default=True,
              help="How the head's config is read: auto = as the library that wrote it trained it, where the files "
                   "name the writer (ModelOpt's rope and first-layer norm, SpecForge 0.2.0's norm_output); config = "
                   "as written (the serving engines' reading); or one writer's reading forced (docs/formats.md).")
@click.option("--draft-vocab", type=int, default=None,
              help="Keep only N tokens in the draft's lm_head (EAGLE-1/2: of the target's vocabulary; EAGLE-3: of "
                   "the head's draft vocabulary), mapped back to target ids inside the draft graphs: a cheaper draft "
                   "level, unchanged output, acceptance may drop. EOS ids are always kept [default: all tokens].")
@click.option("--draft-vocab-corpus", type=click.Path(path_type=Path), default=None,
              help="UTF-8 text file whose token counts (the target's tokenizer) rank the tokens --draft-vocab keeps "
                   "[default: the tokenizer's BPE merge order, else token id order; docs/cli.md].")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress output (a bar on a terminal, else one line per step).")
def export_cmd(target_dir, draft_dir, out_dir, dtype, max_seq_len, max_top_k, max_depth, max_total_tokens,
               top_k, depth, total_tokens, max_batch, fused, draft_tree, draft_tree_top_k, quantize,
               quantize_block_size, quantize_symmetric, quantize_accuracy_level, quantize_draft, quantize_draft_only,
               quantize_lm_head, quantize_inexact_trees, feature_layers,
               head_reading, draft_vocab, draft_vocab_corpus, overwrite, quiet) -> None:
    """Trace the target verify graph and the draft step graph to ONNX in OUT."""
    from .export.checkpoint.hub import resolve_checkpoint
    from .export.exporter import ExportOptions, export_with_report
    from .export.quantization.artifact import QuantizeOptions

    target_dir = resolve_checkpoint(target_dir, "--target", progress=not quiet)
    draft_dir = resolve_checkpoint(draft_dir, "--draft", progress=not quiet)
    layers = None if feature_layers is None else _parse_ids(feature_layers, "--feature-layers")
    tree_ks = None if draft_tree_top_k is None else tuple(_parse_ids(draft_tree_top_k, "--draft-tree-top-k"))
    if quantize != "none" and quantize_draft_only is not None:
        raise click.UsageError(f"--quantize-draft-only takes --quantize none: --quantize {quantize} quantizes the "
                               "draft with the target already (unless --quantize-float-draft)")
    if quantize == "none":
        given = [o for o, v in (("--quantize-draft", quantize_draft is True),
                                ("--quantize-float-draft", quantize_draft is False),
                                ("--quantize-asymmetric", not quantize_symmetric and quantize_draft_only is None),
                                ("--quantize-inexact-trees", quantize_inexact_trees),
                                ("--quantize-float-lm-head", not quantize_lm_head)) if v]
        if given:
            raise click.UsageError(f"{given[0]} needs --quantize int4 or int8"
                                   + (" or --quantize-draft-only" if given[0] == "--quantize-asymmetric" else ""))
        quant = None if quantize_draft_only is None else QuantizeOptions(
            bits=int(quantize_draft_only[3:]), block_size=quantize_block_size, symmetric=quantize_symmetric,
            accuracy_level=quantize_accuracy_level, draft=True, lm_head=False, target=False)
    else:
        quant = QuantizeOptions(bits=int(quantize[3:]), block_size=quantize_block_size, symmetric=quantize_symmetric,
                                accuracy_level=quantize_accuracy_level, draft=quantize_draft is not False,
                                lm_head=quantize_lm_head, inexact_trees=quantize_inexact_trees)
    opts = ExportOptions(dtype=dtype, max_seq_len=max_seq_len,
                         limits=TreeLimits(max_top_k, max_depth, max_total_tokens),
                         tree=TreeParams(top_k, depth, total_tokens), max_batch=max_batch, overwrite=overwrite,
                         fused=fused, draft_tree=draft_tree, draft_tree_top_k=tree_ks, feature_layers=layers,
                         head_reading=head_reading, quantize=quant, draft_vocab=draft_vocab,
                         draft_vocab_corpus=draft_vocab_corpus)
    report = export_with_report(target_dir, draft_dir, out_dir, opts, progress=not quiet)
    click.echo(report.summary())


@main.command("build")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--engine-lib", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx"]), default="auto",
              show_default=True, help="auto: tensorrt when it imports, else tensorrt_rtx (TensorRT for RTX).")
@click.option("--max-batch", type=int, default=None,
              help="Largest batch in the profiles [default: the artifact's, set by `export --max-batch`].")
@click.option("--max-prefill", type=int, default=None,
              help="Largest prefill chunk (prompt tokens per forward) [default: min(256, max_seq_len)].")
@click.option("--max-tree-tokens", type=int, default=None,
              help="Largest verify (root + draft nodes) [default: the artifact's --max-total-tokens + 1].")
@click.option("--workspace", default=None, help="TensorRT workspace pool limit, e.g. 512M, 2G [default: TensorRT's].")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Timing cache file, read if present and written after building (tensorrt only).")
@click.option("--quiet", is_flag=True, help="No progress output (a bar on a terminal, else one line per engine).")
def build_cmd(artifact, engine_lib, max_batch, max_prefill, max_tree_tokens, workspace, timing_cache, quiet) -> None:
    """Build TensorRT engines for the graphs of ARTIFACT and record them in its manifest."""
    from .engines.builder import BuildOptions, build_engines

    opts = BuildOptions(engine_lib=engine_lib, max_batch=max_batch, max_prefill=max_prefill,
                        max_tree_tokens=max_tree_tokens, workspace=workspace, timing_cache=timing_cache)
    m = build_engines(artifact, opts, progress=not quiet)
    e = m.engines
    for name, g in e.graphs.items():
        ranges = "; ".join(
            f"{p['name']}: " + ", ".join(f"{a} {lo}..{hi}" for a, (lo, _, hi) in p["axes"].items() if a != "batch")
            for p in g.profiles)
        click.echo(f"{name}: {g.file} ({g.size_bytes / 2**20:.1f} MiB, {g.precision}, {g.build_s:.1f} s) [{ranges}]")
    click.echo(f"built with {e.lib} {e.lib_version} into {artifact}")


def _spin(value: str | None) -> str | None:
    """--spin checked here, so a typo is a usage error naming the choices."""
    if value is None:
        return None
    from .runtime.ort_backend import parse_spin

    try:
        parse_spin(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


def _parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise EagleExportError(f"{option} must be comma-separated integers, got {text!r}") from None


@main.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", help="Prompt text (needs the artifact's tokenizer).")
@click.option("--chat", is_flag=True,
              help="Send --prompt as one user message through the tokenizer's chat template (with the generation "
                   "prompt appended).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@_tree_options("run")
@_THRESHOLD
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding on the same target graph.")
@_NO_GUARD
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature; 0 = greedy (then --top-p/--top-k-sampling/--seed are ignored).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Sample from the smallest set of most likely tokens whose probability reaches top-p (1 = off).")
@click.option("--top-k-sampling", type=int, default=0, show_default=True,
              help="Sample among the k most likely tokens only (0 = off). Not the tree's --top-k.")
@click.option("--seed", type=int, default=None,
              help="Random seed of the generation (default: a random one, reported in the stats line and the --json "
                   "output).")
@click.option("--samples", type=int, default=None,
              help="Run N independent generations with seeds seed..seed+N-1: one line each (the text as a JSON "
                   "string, or the ids); with --json one object holding a list `samples`.")
@_backend_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate_cmd(artifact, prompt, chat, prompt_ids, max_new_tokens, top_k, depth, total_tokens, threshold, no_draft,
                 no_guard, ignore_eos, temperature, top_p, top_k_sampling, seed, samples, backend, as_json) -> None:
    """Generate from ARTIFACT (a directory made by `eagle-export export`)."""
    from .runtime import EagleRuntime
    from .runtime.chat import user_message
    from .runtime.sampling import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise EagleExportError("give exactly one of --prompt or --prompt-ids")
    if chat and prompt is None:
        raise EagleExportError("--chat applies the chat template to --prompt text: it cannot be used with --prompt-ids")
    if samples is not None and samples < 1:
        raise EagleExportError(f"--samples must be >= 1, got {samples}")
    sampling = SamplingParams(temperature, top_p, top_k_sampling, seed).validate()
    if sampling.is_greedy:
        sampling = None
    elif seed is None:  # pick one, so the run can be repeated from the JSON output
        sampling = sampling.with_seed(secrets.randbelow(2**31))
    rt = EagleRuntime.open(artifact, backend=backend, guard=not no_guard)
    m = rt.manifest
    tree = None  # no tree given: the artifact's default decoding (tree_defaults, or its per-batch table's row for 1)
    if (top_k, depth, total_tokens, threshold) != (None, None, None, None):
        tree = tree_over_defaults(m.tree_defaults, top_k, depth, total_tokens, threshold)
    kwargs = dict(max_new_tokens=max_new_tokens, tree=tree, use_draft=not no_draft, stop_on_eos=not ignore_eos)
    shown = tree or m.default_tree(rt.max_batch)  # None: the default is no draft (`eagle-export tune` found none paid)
    if prompt_ids is not None:
        kwargs["prompt_ids"] = _parse_ids(prompt_ids)
    if chat:
        kwargs["messages"], prompt = user_message(prompt), None
    settings = {"mode": "no-draft" if no_draft or shown is None else "eagle",
                "tree": None if no_draft or shown is None else shown.to_dict(),
                "default": tree is None and not no_draft,  # the artifact's default decoding (None tree: no draft)
                "guard": not no_guard and not no_draft and shown is not None,
                "sampling": None if sampling is None else sampling.to_dict()}
    if samples is not None:
        _generate_samples(rt, prompt, kwargs, sampling, samples, settings, as_json)
        return
    stream = rt.stream(prompt, sampling=sampling, **kwargs)
    if as_json:
        for _ in stream:
            pass
    else:
        text = None if rt.tokenizer is None else TextStream(lambda ids: rt.decode(ids) or "")
        for chunk in stream:
            if text is None:
                click.echo(" ".join(map(str, chunk)) + " ", nl=False)
            else:  # a character split across tokens is held back until it completes
                click.echo(text.push(chunk), nl=False)
        click.echo("" if text is None else text.flush())
    res = stream.result
    if as_json:
        out = res.to_dict()
        out.update(settings)
        click.echo(json.dumps(out))
    else:
        s = res.stats
        seed = "" if sampling is None else f"seed={sampling.seed}, "  # to repeat a sampled run: --seed
        mode = "no draft" if no_draft or shown is None else (
            f"drafted {s.spec_rounds}/{s.rounds} rounds" + (f", guard off {s.guard_switches}x" if s.guard_switches
                                                            else ""))
        click.echo(f"[{len(res.tokens)} tokens, finish={res.finish_reason}, {seed}rounds={s.rounds}, tau={s.tau:.2f}, "
                   f"{mode}, opened in {rt.open_s or 0.0:.1f} s, prefill {s.prefill_s * 1e3:.1f} ms, "
                   f"{len(res.tokens) / max(s.decode_s + s.prefill_s, 1e-9):.1f} tok/s overall]", err=True)


def _generate_samples(rt, prompt, kwargs, sampling, n, settings, as_json) -> None:
    """n independent generations; sample i uses seed sampling.seed + i (all equal when greedy)."""
    results = []
    for i in range(n):
        params = None if sampling is None else sampling.with_seed(sampling.seed + i)
        res = rt.generate(prompt, sampling=params, **kwargs)
        results.append((None if params is None else params.seed, res))
        if not as_json:
            click.echo(json.dumps(res.text) if rt.tokenizer is not None else " ".join(map(str, res.tokens)))
    if as_json:
        out = dict(settings)
        out["prompt_tokens"] = results[0][1].prompt_len
        out["samples"] = [{"seed": s, **{k: v for k, v in r.to_dict().items() if k != "prompt_tokens"}}
                          for s, r in results]
        click.echo(json.dumps(out))
    else:
        tokens = sum(len(r.tokens) for _, r in results)
        from eagle_export.runtime.results import tau

        overall = tau([a for _, r in results for a in r.stats.accept_lengths])
        seeds = "" if sampling is None else f", seeds {sampling.seed}..{sampling.seed + n - 1}"
        click.echo(f"[{n} samples, {tokens} tokens{seeds}, tau={overall:.2f}]", err=True)


@main.command("validate")
@click.argument("artifact", type=click.Path(path_type=Path))
@_backend_option
@click.option("--prompts", type=click.IntRange(min=0), default=8, show_default=True,
              help="Random prompts for the end-to-end checks (0 skips them).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens generated per prompt in the end-to-end checks.")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help='JSON lines for the end-to-end checks instead of random prompts, each {"prompt": "text"}, '
                   '{"prompt_ids": [1, 2, 3]} or {"messages": [...]}.')
@click.option("--target", "target_dir", default=None,
              help="Original target checkpoint, a directory or a Hub repo id in the Hugging Face cache (default: "
                   "the manifest's target.source).")
@click.option("--draft", "draft_dir", default=None,
              help="Original draft checkpoint, a directory or a Hub repo id (default: the manifest's draft.source).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs and prompts.")
@_threads_option
@click.option("--against-library", is_flag=True,
              help="Also compare the draft graph with the forward of the library that wrote the head (ModelOpt, "
                   "...), steps 1 and 2; skipped with the reason when that library is not installed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the readable report.")
def validate_cmd(artifact, backend, prompts, max_new_tokens, prompts_file, target_dir, draft_dir, seed, threads,
                 against_library, as_json) -> None:
    """Check ARTIFACT against the PyTorch model: every graph output, greedy tokens, EAGLE rounds.

    Exit status 0 when every check passes, 1 when one fails, 2 on an error in what you give.
    """
    from .export.checkpoint.hub import resolve_checkpoint
    from .prompts import read_prompts
    from .tools.commands.validate import validate

    if target_dir is not None:
        target_dir = resolve_checkpoint(target_dir, "--target", progress=not as_json)
    if draft_dir is not None:
        draft_dir = resolve_checkpoint(draft_dir, "--draft", progress=not as_json)
    specs = read_prompts(prompts_file) if prompts_file is not None else None
    log = None if as_json else (lambda msg: click.echo(f"[validate] {msg}", err=True))
    report = validate(artifact, backend=backend, prompts=prompts, max_new_tokens=max_new_tokens, target=target_dir,
                      draft=draft_dir, seed=seed, threads=threads, log=log, prompt_specs=specs,
                      against_library=against_library)
    click.echo(json.dumps(report.to_dict()) if as_json else report.format())
    sys.exit(0 if report.passed else 1)


# The prompt set of bench and tune (eagle_export/prompts.py reads it, as for validate --prompts-file).
_PROMPTS_FILE = click.option(
    "--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
    help='JSON lines, each {"prompt": "text"}, {"prompt_ids": [1, 2, 3]} or {"messages": [{"role": "user", '
         '"content": "text"}]} (default: a small built-in set).')


@main.command("bench")
@click.argument("artifact", type=click.Path(path_type=Path), required=False)
@_PROMPTS_FILE
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens generated per prompt and mode (greedy; EOS ignored unless --stop-at-eos).")
@_tree_options("run")
@_THRESHOLD
@_NO_GUARD
@_backend_option
@_threads_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--plot", "plot_file", type=click.Path(path_type=Path), default=None,
              help="Draw the n-alpha curve to this PNG (with --concurrency: throughput against N; needs matplotlib).")
@click.option("--concurrency", default=None,
              help="N, or a list 1,2,4: M requests from N client threads on one runtime opened with max_batch N, "
                   "EAGLE and batched --no-draft side by side (the artifact needs `export --max-batch N`).")
@click.option("--requests", type=click.IntRange(min=1), default=None,
              help="With --concurrency: requests per pass, M [default: 2 x the largest N, at least the prompts].")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Interleaved passes over the prompts, per-prompt medians reported [default: 3 with --peer, else "
                   "1]. With --concurrency: passes per mode and N (alternating); the pass of median throughput is "
                   "reported.")
@click.option("--stop-at-eos", is_flag=True,
              help="Stop each generation at its first EOS, as the reference implementation and transformers do "
                   "(default: EOS ignored, every run makes --max-new-tokens tokens).")
@click.option("--peer", type=click.Choice(["ort-genai"]), default=None,
              help="Also run this peer decoder on the same prompts, interleaved with ours: ORT GenAI's greedy "
                   "decoding of the artifact's target, built offline with its own builder (needs "
                   "`pip install 'eagle-export[peers]'`; docs/bench.md).")
@click.option("--peer-precision", type=click.Choice(["fp32", "int4"]), default=None,
              help="The peer's precision [default: int4 for an int4 artifact, else fp32].")
@click.option("--peer-target", type=click.Path(path_type=Path), default=None,
              help="The Hugging Face folder to build the peer from [default: the target the artifact was exported "
                   "from, manifest target.source].")
@click.option("--peer-cache", type=click.Path(path_type=Path), default=None,
              help="Where built peer models are kept and reused [default: ARTIFACT/peers].")
@click.option("--spin", default=None, callback=lambda c, p, v: _spin(v),
              help="ONNX Runtime's intra-op thread spinning for our sessions: off, run (spin during a call, stop as "
                   "it returns), on; or per phase, e.g. target=run,draft=off [default: the runtime's; "
                   "docs/runtime.md, Threading].")
@click.option("--url", default=None,
              help="Bench a running `eagle-export serve` at this URL instead of ARTIFACT (with --concurrency; "
                   "see docs/serve.md).")
@click.option("--api-key", envvar="EAGLE_EXPORT_API_KEY", default=None,
              help="With --url: the server's API key [env: EAGLE_EXPORT_API_KEY].")
def bench_cmd(artifact, prompts_file, max_new_tokens, top_k, depth, total_tokens, threshold, no_guard, backend,
              threads, as_json, plot_file, concurrency, requests, repeats, stop_at_eos, peer, peer_precision,
              peer_target, peer_cache, spin, url, api_key) -> None:
    """Measure EAGLE against --no-draft on ARTIFACT (or a server's --url), side by side in one run (see
    docs/bench.md)."""
    from .prompts import read_prompts
    from .tools.commands.bench import bench, plot_n_alpha, require_matplotlib

    if (artifact is None) == (url is None):
        raise EagleExportError("give ARTIFACT, or --url of a running `eagle-export serve` (not both)")
    if plot_file is not None and url is None:
        require_matplotlib()  # fail before the bench runs, not after
    prompts = read_prompts(prompts_file) if prompts_file is not None else None
    log = None if as_json else (lambda msg: click.echo(f"[bench] {msg}", err=True))
    peer_opts = [n for n, v in (("--peer-precision", peer_precision), ("--peer-target", peer_target),
                                ("--peer-cache", peer_cache)) if v is not None]
    if peer is None and peer_opts:
        raise EagleExportError(f"{', '.join(peer_opts)} go(es) with --peer")
    if (peer is not None or stop_at_eos) and (url is not None or concurrency is not None):
        raise EagleExportError("--peer and --stop-at-eos are not available with --url or --concurrency")
    if url is not None:
        require("serve", *HTTP_CLIENT, command="`eagle-export bench --url`")
        from .tools.commands.bench.http import bench_http

        if plot_file is not None or repeats not in (None, 1) or no_guard:
            raise EagleExportError("--plot, --repeats and --no-guard are not available with --url (run bench "
                                   "--concurrency on the artifact for those; a server's guard is `serve --no-guard`)")
        given = {k: v for k, v in (("top_k", top_k), ("depth", depth), ("total_tokens", total_tokens),
                                   ("threshold", threshold)) if v is not None}
        report = bench_http(url, concurrency=_parse_ids(concurrency or "1", "--concurrency"), requests=requests,
                            prompts=prompts, max_new_tokens=max_new_tokens, tree=given or None, api_key=api_key,
                            log=log)
        click.echo(json.dumps(report.to_dict()) if as_json else report.format())
        return
    if concurrency is not None:
        from .tools.commands.bench.concurrency import bench_concurrency, plot_throughput

        ns = _parse_ids(concurrency, "--concurrency")
        tree = None
        if (top_k, depth, total_tokens, threshold) != (None, None, None, None):
            from .manifest import load_manifest

            tree = tree_over_defaults(load_manifest(artifact).tree_defaults, top_k, depth, total_tokens, threshold)
        report = bench_concurrency(artifact, concurrency=ns, requests=requests, prompts=prompts,
                                   max_new_tokens=max_new_tokens, tree=tree, backend=backend, threads=threads,
                                   repeats=repeats or 1, guard=not no_guard, log=log)
        click.echo(json.dumps(report.to_dict()) if as_json else report.format())
        if plot_file is not None:
            plot_throughput(report, plot_file)
            if not as_json:
                click.echo(f"throughput plot: {plot_file}")
        return
    if requests is not None:
        raise EagleExportError("--requests goes with --concurrency")
    report = bench(artifact, prompts=prompts, max_new_tokens=max_new_tokens, top_k=top_k, depth=depth,
                   total_tokens=total_tokens, threshold=threshold, guard=not no_guard, backend=backend,
                   threads=threads, stop_at_eos=stop_at_eos, spin=spin,
                   repeats=repeats, peer=peer, peer_precision=peer_precision, peer_target=peer_target,
                   peer_cache=peer_cache, log=log)
    click.echo(json.dumps(report.to_dict()) if as_json else report.format())
    if plot_file is not None:
        plot_n_alpha(report, plot_file)
        if not as_json:
            click.echo(f"n-alpha plot: {plot_file}")


# What tune says when it measured on its built-in prompts: a tree is only as good as the text it was ranked on.
BUILTIN_PROMPTS_HINT = ("measured on the built-in one-line prompts: acceptance depends on the text, so for the tree "
                        "your traffic should get, run tune with --prompts FILE holding prompts like it (a shallow "
                        "pair's chain tuned here decoded code at 0.90-0.96x plain, a tree tuned on code 1.09x; "
                        "docs/tune.md)")


@main.command("tune")
@click.argument("artifact", type=click.Path(path_type=Path))
@_PROMPTS_FILE
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens generated per prompt, mode and setting (greedy, EOS ignored).")
@_tree_options("grid")
@click.option("--no-refine", is_flag=True, help="Measure the grid only (no second stage around the best).")
@click.option("--no-screen", is_flag=True,
              help="Measure every grid setting on every prompt (default: the first half of the prompts, then the "
                   "rest for the best third).")
@_backend_option
@_threads_option
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Passes over the prompts per setting (the medians take them all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--plot", "plot_file", type=click.Path(path_type=Path), default=None,
              help="Draw speedup versus tree size to this PNG (needs matplotlib).")
@click.option("--dry-run", is_flag=True, help="Measure and report; leave the manifest as it is.")
@click.option("--batch-sizes", default="auto", show_default=True,
              help="Numbers of concurrent sequences to tune a tree for (e.g. 1,2,4; auto: 1, 2, 4, ... up to the "
                   "artifact's --max-batch). Sizes >= 2 add a batched stage and the manifest's batch_trees table.")
@click.option("--batch-requests", type=click.IntRange(min=1), default=None,
              help="Requests per batched pass [default: 2 x N, at least the prompts].")
@click.option("--batch-repeats", type=click.IntRange(min=1), default=None,
              help="Pass pairs per candidate and N in the batched stage [default: --repeats].")
@click.option("--confirm", type=click.IntRange(min=0), default=3, show_default=True,
              help="Measure the best N settings twice more, interleaved, before ranking them (0: no).")
@click.option("--spin", default="auto", show_default=True,
              callback=lambda c, p, v: v if v == "auto" else _spin(v),
              help="ONNX Runtime's thread spin policy: auto measures off, run and target=run,draft=off with the "
                   "default tree first and keeps the fastest; a policy (off, run, on, or per phase) is used as "
                   "given. Either is recorded for the runtime's default (docs/runtime.md, Threading).")
@click.option("--min-speedup", type=click.FloatRange(min=0, min_open=True), default=1.05, show_default=True,
              help="A tree becomes the default only if it beats plain decoding by this factor; else the default is "
                   "no draft (batch_trees' row for one sequence says null).")
@click.option("--thresholds", default=None,
              help="Verify-width thresholds to try with the best tree, e.g. 0.01,0.05; 0 for none [default: "
                   "0.01,0.05].")
@click.option("--inexact-trees", is_flag=True,
              help="On an artifact where EAGLE is token-exact on chains only (a quantized one at accuracy level 4, "
                   "on ONNX Runtime), also measure branching trees (top_k > 1): a setting where EAGLE then differs "
                   "from plain decoding is reported with where and by what margin, and never chosen.")
def tune_cmd(artifact, prompts_file, max_new_tokens, top_k, depth, total_tokens, no_refine, no_screen, backend,
             threads, repeats, as_json, plot_file, dry_run, batch_sizes, batch_requests, batch_repeats, confirm,
             spin, inexact_trees, min_speedup, thresholds) -> None:
    """Measure tokens/s over a grid of tree settings on ARTIFACT and write the best into its manifest as
    tree_defaults, and the best tree (or no draft) per number of concurrent sequences as batch_trees (see
    docs/tune.md).

    Exit status 0 when done, 1 when a setting was lossy (nothing written), 2 on an error in what you give.
    """
    from .prompts import read_prompts
    from .tools.commands.bench import require_matplotlib
    from .tools.commands.tune import Grid, parse_list, parse_thresholds, plot_speedup, tune, write_winner

    Grid.parse(top_k, depth, total_tokens)  # refuse a malformed list before opening anything
    parse_thresholds(thresholds)
    if batch_sizes != "auto":
        parse_list(batch_sizes, "--batch-sizes", 1)
    if plot_file is not None:
        require_matplotlib()
    prompts = read_prompts(prompts_file) if prompts_file is not None else None
    log = None if as_json else (lambda msg: click.echo(f"[tune] {msg}", err=True))
    report = tune(artifact, prompts=prompts, max_new_tokens=max_new_tokens, top_k=top_k, depth=depth,
                  total_tokens=total_tokens, backend=backend, threads=threads, repeats=repeats,
                  refine=not no_refine, log=log, batch_sizes=batch_sizes, batch_requests=batch_requests,
                  batch_repeats=batch_repeats, spin=spin, confirm=confirm, screen=not no_screen,
                  inexact_trees=inexact_trees, min_speedup=min_speedup,
                  thresholds=thresholds)
    lossy = bool(report.lossy) or not report.batch_lossless or not report.spin_lossless
    written = False
    if not dry_run and not lossy:
        write_winner(artifact, report)
        written = True
    if as_json:
        out = report.to_dict()
        out["written"] = written
        click.echo(json.dumps(out))
    else:
        click.echo(report.format())
        if written:
            w = report.winner.tree
            click.echo(f"wrote tree_defaults {w.label} into {Path(artifact) / 'manifest.json'}"
                       + (f", and the spin policy {report.recorded_spin}" if report.recorded_spin else ""))
            if report.batch_table is not None:
                click.echo(f"wrote batch_trees ({len(report.batch_table.rows)} rows) into "
                           f"{Path(artifact) / 'manifest.json'}")
            if report.no_draft:
                click.echo("default decoding: no draft (batch_trees row 1 is null; `generate` without tree options, "
                           "`bench`, `serve` and the API decode plainly)")
        elif dry_run:
            click.echo("dry run: manifest not changed")
        if prompts_file is None:
            click.echo(BUILTIN_PROMPTS_HINT)
    if plot_file is not None:
        plot_speedup(report, plot_file)
        if not as_json:
            click.echo(f"speedup plot: {plot_file}")
    if lossy:
        what = len(report.lossy) or ("a batched" if not report.batch_lossless else "a spin stage")
        click.echo(f"error: {what} setting(s) were lossy (EAGLE tokens differ from "
                   "no-draft): manifest not changed", err=True)
        sys.exit(1)


@main.command("gpu-check", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def gpu_check_cmd(ctx) -> None:
    """Check this GPU end to end: export tiny models, build TensorRT engines, run and compare with the reference
    (`eagle-export gpu-check --help` lists its options; --emulate runs it on a CPU)."""
    from .tools.commands.gpu_check import main as gpu_check

    gpu_check.main(args=list(ctx.args), prog_name="eagle-export gpu-check")


@main.command("demo", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def demo_cmd(ctx) -> None:
    """The main job: export the bundled trained fixture with each of its heads, generate a sample, and measure tau
    and the speedup over plain decoding (`eagle-export demo --help` lists its options)."""
    from .tools.commands.demo import main as demo

    demo.main(args=list(ctx.args), prog_name="eagle-export demo")


@main.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind (the default answers this machine only; 0.0.0.0 opens it to the network).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Sequences decoded at once per runtime [default: the artifact's export --max-batch].")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot beyond the batch; past that the server answers 429 at once.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Per-request timeout in seconds (the request is cancelled).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt accepted [default: the artifact's capacity - 1].")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--api-key", envvar="EAGLE_EXPORT_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics [env: EAGLE_EXPORT_API_KEY].")
@click.option("--model-name", default=None, help="The model id clients name [default: the artifact folder's name].")
@_backend_option
@_threads_option
@click.option("--drain-timeout", "drain_timeout_s", type=click.FloatRange(min=0), default=None,
              help="On SIGTERM/SIGINT, how long accepted requests may run on; those still running then get an error "
                   "event or a 503 [default: --timeout].")
@click.option("--header-timeout", "header_timeout_s", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Seconds for a request's head to arrive (408 and the connection closed).")
@click.option("--body-timeout", "body_timeout_s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds for a request's body to arrive once its head has (408).")
@click.option("--replica-header", is_flag=True,
              help="Name the replica (host:pid) in an x-eagle-replica header and in /health.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Deploy with Ray Serve (on RAY_ADDRESS's cluster, else a local Ray instance).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ray Serve replicas, one runtime each (--ray).")
@click.option("--replica-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="CPUs Ray reserves per replica (--ray).")
@_NO_GUARD
def serve_cmd(artifact, host, port, max_batch, max_queue, timeout_s, max_prompt_tokens, max_body_bytes, api_key,
              model_name, backend, threads, drain_timeout_s, header_timeout_s, body_timeout_s, replica_header,
              use_ray, replicas, replica_cpus, no_guard) -> None:
    """Serve ARTIFACT over HTTP with OpenAI's completions and chat completions API (see docs/serve.md).

    \b
    Requests take OpenAI's defaults, not `generate`'s: without "max_tokens" a completion gets 16 tokens (chat:
    up to the capacity), without "temperature" it samples at temperature 1 (generate: 64 tokens, greedy).
    Send "temperature": 0 for greedy output.
    """
    from .manifest import load_manifest

    if use_ray:
        require("ray", *RAY, command="`eagle-export serve --ray`")
    require("serve", *SERVE)
    from .serve.engine import ServeOptions

    man = load_manifest(artifact)  # a bad artifact is one line before anything starts
    if max_batch is not None and max_batch > man.max_batch:
        raise EagleExportError(f"--max-batch {max_batch} is above the artifact's batch range (export --max-batch "
                               f"{man.max_batch}): re-export with --max-batch {max_batch}")
    if replicas > 1 and not use_ray:
        raise EagleExportError("--replicas needs --ray (one process serves one runtime)")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach this port can use it",
                   err=True)
    opts = ServeOptions(str(Path(artifact).resolve()), backend, max_batch, max_queue, timeout_s, max_prompt_tokens,
                        max_body_bytes, api_key or None, model_name or Path(artifact).resolve().name, threads,
                        drain_timeout_s=drain_timeout_s, header_timeout_s=header_timeout_s,
                        body_timeout_s=body_timeout_s, replica_header=replica_header, guard=not no_guard)
    if use_ray:
        from .serve.run import serve_ray

        serve_ray(opts, replicas, host, port, replica_cpus)
    else:
        from .serve.run import serve_uvicorn

        serve_uvicorn(opts, host, port)


if __name__ == "__main__":
    main()

"""GPU check: export a tiny model, build TensorRT engines, run them, compare with PyTorch and ONNX Runtime.

    python -m eagle_export.tools.gpu_check [--workdir gpu_check] [--dtype fp32 --dtype fp16]
        [--engine-lib auto|tensorrt|tensorrt-rtx] [--prompts 4] [--new-tokens 48] [--bench-tokens 128]

Needs an NVIDIA GPU, PyTorch with CUDA and a TensorRT Python module (``tensorrt`` 10.x/11.x or
``tensorrt_rtx``). Prints, per dtype:

1. token-for-token agreement of greedy EAGLE and ``--no-draft`` generation, on TensorRT and on ONNX
   Runtime, with the target's own greedy output (transformers ``generate``, fp32);
2. per-graph max error of the TensorRT engine (and of ONNX Runtime) against the PyTorch modules the graphs
   were traced from, for a prefill-like and a verify/tree-like call (both profiles);
3. tokens/s of EAGLE versus ``--no-draft`` on the same engines (with a random head tau is near 1, so
   EAGLE is not expected to be faster here: the figure proves the loop runs, not the speedup).

Exit status 0 when fp32 agrees token for token (ties with a top-2 gap < 1e-4 excepted) and every fp32 max
error is below 1e-3; 1 otherwise; fp16 figures are reported, not judged. Without CUDA (or with
``--skip-trt-run``) the TensorRT execution parts are skipped and said so; export, build and the ONNX
Runtime parts still run. It finishes in about a minute on a tiny model (TensorRT-RTX compiles kernels
for the GPU the first time an engine runs: allow it a little more there).
"""

from __future__ import annotations

import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.manifest import MANIFEST_NAME

FP32_TOL = 1e-3
TIE_GAP = 1e-4


def say(msg: str = "") -> None:
    click.echo(msg)
    sys.stdout.flush()


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    import onnxruntime as ort

    info["onnxruntime"] = ort.__version__
    info["ort_providers"] = ",".join(ort.get_available_providers())
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - report whatever stops the import
            info[name] = f"not importable ({type(e).__name__})"
    return info


class Reference:
    """The target's own greedy decoding (transformers, fp32, eager attention), on the GPU when there is one."""

    def __init__(self, target_dir: Path):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval().to(self.dev)
        self.model.generation_config.eos_token_id = None
        self.config = GenerationConfig

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int) -> list[int]:
        cfg = self.config(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n)
        out = self.model.generate(torch.tensor([prompt], device=self.dev), generation_config=cfg)
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def top2_gap(self, prefix: list[int]) -> float:
        top = torch.topk(self.model(torch.tensor([prefix], device=self.dev)).logits[0, -1], 2).values
        return float(top[0] - top[1])


def agreement(ref: Reference, prompt: list[int], got: list[int], want: list[int],
              judged: bool) -> tuple[int, int, str | None]:
    """(tokens equal before the first difference, tokens compared, None | 'tie' | what differs)."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            gap = ref.top2_gap(prompt + want[:i])
            if gap < TIE_GAP:
                return i, len(want), "tie"
            why = "MISMATCH" if judged else "differs (reduced precision, not judged)"
            return i, len(want), f"{why} at new token {i}, reference top-2 gap {gap:.2g}"
    return min(len(got), len(want)), len(want), None if len(got) == len(want) else "LENGTH"


def graph_inputs(m, graph: str, new: int, past: int, rows: int, rng) -> dict[str, np.ndarray]:
    """Random inputs for one call, as float32/int64/bool numpy arrays (the runtime's conventions).

    rows: logit rows for the target; for the draft, how many of the new rows come from ``hidden_in``
    (tree levels: all of them; context passes: 0, all rows from target ``features``).
    """
    ti, di = m.target, m.draft
    ids = rng.integers(0, ti.vocab_size, (1, new))
    pos = (past + np.arange(new))[None]
    mask = rng.random((1, new, past + new)) < 0.7
    mask[:, :, past:] |= np.eye(new, dtype=bool)
    mask[:, :, past:] &= np.tri(new, dtype=bool)  # keep it tree-like (no future columns)
    if graph == C.TARGET_GRAPH:
        x = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask,
             C.LOGIT_INDICES: np.arange(new - rows, new)[None]}
        heads, hd, layers = ti.kv_heads, ti.head_dim, ti.num_layers
    else:
        x = {C.INPUT_IDS: ids,
             C.DRAFT_FEATURES: rng.standard_normal((1, new - rows, di.feature_dim)).astype(np.float32),
             C.HIDDEN_IN: rng.standard_normal((1, rows, di.hidden_size)).astype(np.float32),
             C.POSITION_IDS: pos, C.ATTENTION_MASK: mask}
        heads, hd, layers = di.kv_heads, di.head_dim, 1
    for name in C.past_names(layers):
        x[name] = rng.standard_normal((1, past, heads, hd)).astype(np.float32)
    return x


def run_backend(backend, m, graph: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One call through a backend's run(), with inputs and outputs laid out as the generator lays them out."""
    from eagle_export.dtypes import torch_dtype

    dev = backend.device
    dt = torch_dtype(m.dtype)
    spec = m.graphs[graph].spec
    inputs: dict = {}
    for t in spec.inputs:
        a = x[t.name]
        if t.dtype in ("int64", "bool"):
            inputs[t.name] = np.ascontiguousarray(a.astype(t.dtype))  # host arrays, staged by the backend
        else:  # float inputs live in device buffers; an empty cache prefix is a view of a real buffer
            buf = torch.zeros((a.shape[0], a.shape[1] + 1, *a.shape[2:]), dtype=dt, device=dev)
            view = buf[:, : a.shape[1]]
            view.copy_(torch.from_numpy(a).to(dt))
            inputs[t.name] = view
    axes = {C.BATCH: 1, C.NEW_TOKENS: x[C.INPUT_IDS].shape[1]}
    if C.LOGIT_INDICES in x:
        axes[C.LOGIT_ROWS] = x[C.LOGIT_INDICES].shape[1]
    outputs = {t.name: torch.zeros(tuple(axes[d] if isinstance(d, str) else d for d in t.shape),
                                   dtype={"float32": torch.float32, "int64": torch.int64}.get(t.dtype, dt), device=dev)
               for t in spec.outputs}
    backend.run(graph, inputs, outputs)
    if dev != "cpu":
        torch.cuda.synchronize()
    return {n: t.float().cpu().numpy() for n, t in outputs.items()}


def pytorch_outputs(modules, m, graph: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    spec = m.graphs[graph].spec
    with torch.no_grad():
        outs = modules[graph](*[torch.from_numpy(np.asarray(x[n])) for n in spec.input_names])
    return {n: o.float().numpy() for n, o in zip(spec.output_names, outs, strict=True)}


def max_errors(got: dict, want: dict) -> dict[str, float]:
    errs = {}
    for n, w in want.items():
        if n == C.TOPK_IDS:
            errs[n] = float((got[n] != w).mean()) if w.size else 0.0  # fraction differing (ties may swap)
        else:
            errs[n] = float(np.abs(got[n] - w).max()) if w.size else 0.0
    return errs


def summarize(errs: dict[str, float]) -> str:
    present = [v for n, v in errs.items() if n.startswith("present_")]
    shown = {n: v for n, v in errs.items() if not n.startswith("present_")}
    if present:
        shown["present_*"] = max(present)
    return ", ".join(f"{n} {v:.2e}" for n, v in shown.items())


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("gpu_check"), show_default=True)
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["fp32", "fp16", "bf16"]),
              default=("fp32", "fp16"), show_default=True)
@click.option("--engine-lib", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx"]), default="auto",
              show_default=True)
@click.option("--prompts", type=int, default=4, show_default=True)
@click.option("--new-tokens", type=int, default=48, show_default=True)
@click.option("--bench-tokens", type=int, default=128, show_default=True)
@click.option("--skip-trt-run", is_flag=True, help="Build the engines but do not run them (no GPU).")
def main(workdir: Path, dtypes, engine_lib: str, prompts: int, new_tokens: int, bench_tokens: int,
         skip_trt_run: bool) -> None:
    """Export, build, run on TensorRT and ONNX Runtime, compare, time. Exit status 1 if an fp32 check fails."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    logging.getLogger("eagle_export").setLevel(logging.ERROR)  # e.g. "no tokenizer": ids are all we use
    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.export.exporter import ExportOptions, export_artifact
    from eagle_export.export.loaders import load_eagle1_head, load_target
    from eagle_export.export.modules import DraftStep, TargetVerify
    from eagle_export.runtime import EagleRuntime
    from eagle_export.tools.tiny_models import make_tiny_draft, make_tiny_target
    from eagle_export.tree_params import TreeLimits, TreeParams

    t_start = time.perf_counter()
    env = environment()
    say("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    run_trt = torch.cuda.is_available() and not skip_trt_run
    if not run_trt:
        say("TensorRT execution: SKIPPED (" + ("--skip-trt-run" if skip_trt_run else "no CUDA device") + "); "
            "engines are still built, ONNX Runtime parts still run")
    target, draft = workdir / "target", workdir / "draft"
    if not (target / "config.json").is_file():
        make_tiny_target(target, "gqa", seed=0, vocab_size=512, with_tokenizer=False)
        make_tiny_draft(draft, target, seed=1)
    ref = Reference(target)
    rng = np.random.default_rng(0)
    prompt_list = [[int(v) for v in rng.integers(3, 512, size=n)] for n in rng.integers(4, 40, size=prompts)]
    want = [ref.generate(p, new_tokens) for p in prompt_list]
    loaded = load_target(target, progress=False)
    head, _, _ = load_eagle1_head(draft, loaded)
    failures: list[str] = []
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)

    for dtype in dtypes:
        say(f"\n=== {dtype} ===")
        art = workdir / f"artifact_{dtype}"
        if not (art / MANIFEST_NAME).is_file():
            export_artifact(target, draft, art, ExportOptions(dtype=dtype, max_seq_len=256, overwrite=True,
                                                              limits=TreeLimits(8, 6, 31)), progress=False)
        t0 = time.perf_counter()
        m = build_engines(art, BuildOptions(engine_lib=engine_lib, max_prefill=64), progress=False)
        e = m.engines
        say(f"built with {e.lib} {e.lib_version} in {time.perf_counter() - t0:.1f} s: " + ", ".join(
            f"{n} {g.size_bytes / 2**20:.1f} MiB" for n, g in e.graphs.items()))
        judged = dtype == "fp32"

        backends = {}
        if run_trt:
            t0 = time.perf_counter()
            backends["tensorrt"] = EagleRuntime.open(art, backend="tensorrt")
            say(f"tensorrt runtime opened in {time.perf_counter() - t0:.1f} s")
        if m.dtype != "bfloat16":
            backends["ort"] = EagleRuntime.open(art, backend="ort")
        else:
            say("ort: skipped (no bf16 kernels)")

        # 1. Token agreement with the target's greedy output.
        for bname, rt in backends.items():
            if bname == "tensorrt":  # the first run compiles kernels (TensorRT-RTX JIT): keep it out of timings
                rt.generate(prompt_ids=prompt_list[0], max_new_tokens=8, tree=tree, stop_on_eos=False)
            for mode, use_draft in (("eagle", True), ("no-draft", False)):
                same = total = 0
                notes = []
                for p, w in zip(prompt_list, want, strict=True):
                    got = rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, use_draft=use_draft,
                                      stop_on_eos=False).tokens
                    k, n, note = agreement(ref, p, got, w, judged)
                    same += k
                    total += n
                    if note:
                        notes.append(note)
                bad = [x for x in notes if x != "tie"]
                say(f"{bname:8s} {mode:8s}: {same}/{total} tokens equal the target's greedy output"
                    + (f" ({', '.join(notes)})" if notes else ""))
                if judged and bad:  # reduced-precision runs are reported, not judged
                    failures.append(f"{dtype} {bname} {mode}: {bad}")

        # 2. Per-graph max error against the PyTorch modules (fp32 modules, same inputs).
        modules = {C.TARGET_GRAPH: TargetVerify(loaded.model).eval(),
                   C.DRAFT_GRAPH: DraftStep(head, m.tree_limits.max_top_k).eval()}
        calls = {C.TARGET_GRAPH: [("prefill", 40, 0, 1), ("verify", 13, 50, 13)],
                 C.DRAFT_GRAPH: [("context", 40, 0, 0), ("tree", 8, 50, 8)]}
        for graph, cases in calls.items():
            for label, new, past, rows in cases:
                x = graph_inputs(m, graph, new, past, rows, np.random.default_rng(new + past))
                ref_out = pytorch_outputs(modules, m, graph, x)
                for bname, rt in backends.items():
                    errs = max_errors(run_backend(rt.backend, m, graph, x), ref_out)
                    say(f"{bname:8s} {graph} {label:7s} (new {new}, past {past}): max |err| {summarize(errs)}")
                    worst = max(v for n, v in errs.items() if n != C.TOPK_IDS)
                    if judged and worst > FP32_TOL:
                        failures.append(f"{dtype} {bname} {graph} {label}: max error {worst:.2e} > {FP32_TOL}")

        # 3. Speed on the same engines: EAGLE vs --no-draft.
        if "tensorrt" in backends:
            rt = backends["tensorrt"]
            rates = {}
            for mode, use_draft in (("eagle", True), ("no-draft", False)):
                runs = []
                for p in prompt_list:
                    r = rt.generate(prompt_ids=p, max_new_tokens=bench_tokens, tree=tree, use_draft=use_draft,
                                    stop_on_eos=False)
                    runs.append((len(r.tokens) / max(r.stats.decode_s + r.stats.prefill_s, 1e-9), r.stats.tau))
                rates[mode] = (statistics.median(x for x, _ in runs), statistics.mean(t for _, t in runs))
            (ev, tau), (nv, _) = rates["eagle"], rates["no-draft"]
            say(f"tensorrt speed: EAGLE {ev:.0f} tok/s (tau {tau:.2f}) vs --no-draft {nv:.0f} tok/s: "
                f"{ev / nv:.2f}x (random head: tau near 1 is expected)")

    say(f"\ntotal {time.perf_counter() - t_start:.0f} s; "
        + ("no fp32 check failed" if not failures else f"FAILED: {failures}"))
    if not run_trt:
        say("NOTE: TensorRT execution was skipped: only the build and the ONNX Runtime parts were checked")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

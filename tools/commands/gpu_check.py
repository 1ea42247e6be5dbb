"""The one script to run on a GPU: export tiny models, build TensorRT engines, run them, compare, time.

    eagle-export gpu-check [--workdir gpu_check] [--engine-lib auto|tensorrt|tensorrt-rtx]
        [--case eagle1:fp32 --case eagle3:bf16 ...] [--prompts 3] [--new-tokens 32] [--json FILE] [--emulate]

Needs an NVIDIA GPU, PyTorch with CUDA and the TensorRT module that runs on it: ``tensorrt`` 10.x/11.x on a
data-centre GPU (H100/H200, compute capability 9.0), ``tensorrt_rtx`` on an RTX card (7.5-8.9, 12.x). It
first prints the library, its version and the GPU's compute capability, and stops with exit status 2 when
they do not go together (or there is no GPU). Then, per case (head variant x dtype; default EAGLE-1/2 fp32,
fp16 and bf16, EAGLE-3 fp16 and bf16; bf16 only from compute capability 8.0):

1. greedy EAGLE and ``--no-draft`` against the target's own greedy output (transformers, fp32), on a 1-token
   prompt, a prompt longer than the engines' --max-prefill (chunked prefill) and random prompts;
2. a sampled run (temperature 0.8, top-p 0.9, seed 1) against the same run on the CPU reference (ONNX
   Runtime, forced to its CPU provider), and against itself (same seed, same tokens);
3. per-graph max error of the engines (and of the CPU reference) against the PyTorch modules, for a
   prefill-like and a verify/tree-like call (both profiles);
4. greedy EAGLE on ONNX Runtime's CUDA execution provider (fp16/fp32) against the same reference, when
   ``onnxruntime-gpu`` is installed (else the command that installs it is printed and the step skipped);
5. host work against GPU time per call (CUDA events around each call on the backend's stream), and
   EAGLE vs ``--no-draft`` tokens/s on the same engines (random heads: tau near 1, so no speedup expected).

Judged (exit status 1 on failure): fp32 tokens equal the reference's (ties with a top-2 gap < 1e-4 excepted),
every fp32 max error below 1e-3, and the same seed giving the same tokens twice. Reduced precision and the
sampled comparison with the CPU are reported, not judged (different kernels may flip near-ties). A JSON
summary goes to WORKDIR/gpu_check.json (or --json). Budget: under 5 minutes on a GPU (TensorRT builds
dominate). ``--emulate`` runs the same script on a CPU through the TensorRT emulator of
``tools/testing/trt_emulator.py`` (TensorRT-RTX engines; no GPU timing): CI uses it so the script does not rot.
"""

from __future__ import annotations

import json
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
DEFAULT_CASES = ("eagle1:fp32", "eagle1:fp16", "eagle1:bf16", "eagle3:fp16", "eagle3:bf16")
MAX_PREFILL = 32  # engines' prefill profile: the long prompt below is prefilled in chunks
LONG_PROMPT = 100
VOCAB = 512


def say(msg: str = "") -> None:
    click.echo(msg)
    sys.stdout.flush()


def ort_install_problem() -> str | None:
    """Why ONNX Runtime's CUDA provider is not usable here, with the command that fixes it, or None."""
    from importlib import metadata

    import onnxruntime as ort

    from eagle_export.engines.libs import ORT_GPU_INSTALL

    have = set()
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            metadata.version(dist)
            have.add(dist)
        except metadata.PackageNotFoundError:
            pass
    if have == {"onnxruntime", "onnxruntime-gpu"}:
        return f"both onnxruntime and onnxruntime-gpu are installed (one module, mixed files): {ORT_GPU_INSTALL}"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"ONNX Runtime has no CUDAExecutionProvider here: {ORT_GPU_INSTALL}"
    return None


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(0))
    import onnxruntime as ort

    info["onnxruntime"] = ort.__version__
    info["ort_providers"] = ",".join(ort.get_available_providers())
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
        x = {C.INPUT_EMBEDS: rng.standard_normal((1, new, di.hidden_size)).astype(np.float32),
             C.DRAFT_FEATURES: rng.standard_normal((1, new - rows, di.feature_dim)).astype(np.float32),
             C.HIDDEN_IN: rng.standard_normal((1, rows, di.hidden_size)).astype(np.float32),
             C.POSITION_IDS: pos, C.ATTENTION_MASK: mask}
        heads, hd, layers = di.kv_heads, di.head_dim, di.num_layers
    for name in C.past_names(layers):
        x[name] = rng.standard_normal((1, past, heads, hd)).astype(np.float32)
    return x


def run_backend(backend, m, graph: str, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One call through a backend's run(), with buffers from its ``zeros`` laid out as the generator lays them
    out (host arrays for ids, positions, masks and logit rows), outputs read back through ``to_host``."""
    from eagle_export.dtypes import torch_dtype

    dt = torch_dtype(m.dtype)
    # A TensorRT engine's IO is the graph's and what `build` appended (the timing proxy wraps the backend)
    engine = getattr(getattr(backend, "_inner", backend), "graphs", {}).get(graph)
    spec = getattr(engine, "spec", None) or m.graphs[graph].spec
    inputs: dict = {}
    for t in spec.inputs:
        a = x[t.name]
        if t.dtype in ("int64", "bool"):
            inputs[t.name] = np.ascontiguousarray(a.astype(t.dtype))  # host arrays, staged by the backend
        else:  # float inputs live in device buffers; an empty cache prefix is a view of a real buffer
            buf = backend.zeros((a.shape[0], a.shape[1] + 1, *a.shape[2:]), dt)
            view = buf[:, : a.shape[1]]
            view.copy_(torch.from_numpy(a).to(dt))
            inputs[t.name] = view
    axes = {C.BATCH: 1, C.NEW_TOKENS: x[C.POSITION_IDS].shape[1]}
    if C.LOGIT_INDICES in x:
        axes[C.LOGIT_ROWS] = x[C.LOGIT_INDICES].shape[1]
    fixed = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}  # else the artifact's dtype
    outputs = {t.name: backend.zeros(tuple(axes[d] if isinstance(d, str) else d for d in t.shape),
                                     fixed.get(t.dtype, dt))
               for t in spec.outputs}
    backend.run(graph, inputs, outputs)
    return {n: backend.to_host(t.float() if t.dtype == torch.bfloat16 else t).astype(np.float32)
            if t.dtype != torch.int64 else backend.to_host(t) for n, t in outputs.items()}


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


class CallTimer:
    """Wraps a backend (runtime.backend.Backend): host seconds inside each ``run``, and the device time of the
    call's work on the backend's stream between two CUDA events (None on the emulator)."""

    def __init__(self, inner):
        self._inner = inner
        self.name, self.device, self.host_memory = inner.name, inner.device, inner.host_memory
        self.max_prefill, self.last_exec_s = inner.max_prefill, inner.last_exec_s
        self.host_s: list[float] = []
        self._events: list = []
        self.cuda = str(inner.device).startswith("cuda")

    def run(self, graph, inputs, outputs) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._inner.stream)
        t0 = time.perf_counter()
        self._inner.run(graph, inputs, outputs)
        self.host_s.append(time.perf_counter() - t0)
        if self.cuda:
            end.record(self._inner.stream)
            self._events.append((start, end))

    @property
    def open_s(self) -> float:
        return self._inner.open_s

    def device_s(self) -> list[float] | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in self._events]

    def zeros(self, shape, dtype):
        return self._inner.zeros(shape, dtype)

    def check_tree(self, tree) -> None:
        self._inner.check_tree(tree)

    def to_host(self, x):
        return self._inner.to_host(x)

    def copy_from_host(self, dst, src) -> None:  # the generator gathers the draft's embedding rows through it
        self._inner.copy_from_host(dst, src)

    def synchronize(self) -> None:
        self._inner.synchronize()


def median_us(values) -> float | None:
    return None if not values else 1e6 * statistics.median(values)


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("gpu_check"), show_default=True)
@click.option("--case", "cases", multiple=True, help="head:dtype, e.g. eagle3:bf16 (repeatable; default: "
              + ", ".join(DEFAULT_CASES) + ").")
@click.option("--engine-lib", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx"]), default="auto",
              show_default=True)
@click.option("--prompts", type=int, default=3, show_default=True, help="Random prompts besides the 1-token and "
              "the long one.")
@click.option("--new-tokens", type=int, default=32, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Where to write the JSON summary (default WORKDIR/gpu_check.json).")
@click.option("--emulate", is_flag=True, help="No GPU: run the TensorRT backend on the CPU emulator "
              "(tools/testing/trt_emulator.py) with TensorRT-RTX engines.")
@click.option("--emulate-capability", default="8.9", show_default=True, help="The compute capability the "
              "emulator reports (to see the mismatch check on a CPU).")
def main(workdir: Path, cases, engine_lib: str, prompts: int, new_tokens: int, json_path: Path | None,
         emulate: bool, emulate_capability: str) -> None:
    """Export, build, run on TensorRT and the CPU reference, compare, time. Exit 1 if a judged check fails."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    logging.getLogger("eagle_export").setLevel(logging.ERROR)  # e.g. "no tokenizer": ids are all we use
    from eagle_export.engines.builder import BuildOptions, build_engines
    from eagle_export.engines.libs import cannot_run, gpu_capability, load_lib
    from eagle_export.errors import EagleExportError
    from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
    from eagle_export.export.exporter import ExportOptions, export_artifact
    from eagle_export.export.graphs.heads import DraftStep
    from eagle_export.export.graphs.target import TargetVerify
    from eagle_export.runtime import EagleRuntime
    from eagle_export.runtime.sampling import SamplingParams
    from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target
    from eagle_export.tree_params import TreeLimits, TreeParams

    t_start = time.perf_counter()
    env = environment()
    say("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    # Library, version and compute capability first: stop before any work when they cannot go together.
    if emulate:
        capability = tuple(int(v) for v in emulate_capability.split("."))
        engine_lib = "tensorrt-rtx" if engine_lib == "auto" else engine_lib
    else:
        capability = gpu_capability()
        if capability is None:
            say("error: no CUDA device (torch sees none): run this on the GPU machine, or pass --emulate")
            sys.exit(2)
    try:
        lib = load_lib(engine_lib, capability)
    except EagleExportError as e:
        say(f"error: {e}")
        sys.exit(2)
    why = cannot_run(lib.name, capability)
    say(f"library: {lib.label}; compute capability {capability[0]}.{capability[1]}"
        + (" (emulated on the CPU)" if emulate else f" ({env.get('gpu')})"))
    if why is not None:
        from eagle_export.engines.libs import PIP_HINTS

        other = "tensorrt" if lib.name == "tensorrt_rtx" else "tensorrt_rtx"
        say(f"error: {why}: install the other library ({PIP_HINTS[other]}) or pass --engine-lib")
        sys.exit(2)
    ort_problem = None if emulate else ort_install_problem()
    if ort_problem is not None:
        say(f"note: {ort_problem}; the ONNX Runtime CUDA step is skipped")
    chosen = list(cases or DEFAULT_CASES)
    for c in chosen:
        head, _, dtype = c.partition(":")
        if head not in ("eagle1", "eagle3") or dtype not in ("fp32", "fp16", "bf16"):
            say(f"error: case {c!r} is not head:dtype with head eagle1|eagle3 and dtype fp32|fp16|bf16")
            sys.exit(2)
    if capability < (8, 0):
        skipped = [c for c in chosen if c.endswith(":bf16")]
        chosen = [c for c in chosen if not c.endswith(":bf16")]
        if skipped:
            say(f"skipped {skipped}: bf16 needs compute capability 8.0")

    target = workdir / "target"
    drafts = {"eagle1": workdir / "draft_eagle1", "eagle3": workdir / "draft_eagle3"}
    if not (target / "config.json").is_file():
        make_tiny_target(target, "gqa", seed=0, vocab_size=VOCAB, with_tokenizer=False)
    if not (drafts["eagle1"] / "config.json").is_file():
        make_tiny_draft(drafts["eagle1"], target, seed=1)
    if not (drafts["eagle3"] / "config.json").is_file():
        make_tiny_eagle3_draft(drafts["eagle3"], target, seed=2)
    ref = Reference(target)
    rng = np.random.default_rng(0)
    prompt_list = [[7], [int(v) for v in rng.integers(3, VOCAB, size=LONG_PROMPT)]]
    prompt_list += [[int(v) for v in rng.integers(3, VOCAB, size=n)] for n in rng.integers(4, 40, size=prompts)]
    want = [ref.generate(p, new_tokens) for p in prompt_list]
    loaded = load_target(target, progress=False)
    failures: list[str] = []
    summary: dict = {"environment": env, "library": lib.name, "library_version": lib.version,
                     "capability": list(capability), "emulated": emulate, "cases": {}}
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1)

    for case in chosen:
        head_name, _, dtype = case.partition(":")
        say(f"\n=== {case} ===")
        out: dict = summary["cases"].setdefault(case, {})
        art = workdir / f"artifact_{head_name}_{dtype}"
        if not (art / MANIFEST_NAME).is_file():
            export_artifact(target, drafts[head_name], art, ExportOptions(dtype=dtype, max_seq_len=256,
                                                                         overwrite=True, limits=TreeLimits(8, 6, 31)),
                            progress=False)
        t0 = time.perf_counter()
        m = build_engines(art, BuildOptions(engine_lib=lib.name.replace("_", "-"), max_prefill=MAX_PREFILL),
                          progress=False)
        out["build_s"] = time.perf_counter() - t0
        say(f"built with {m.engines.lib} {m.engines.lib_version} in {out['build_s']:.1f} s")
        judged = dtype == "fp32"
        t0 = time.perf_counter()
        if emulate:
            from eagle_export.tools.testing.trt_emulator import emulated_runtime

            trt_rt = emulated_runtime(art, compute_capability=capability)
        else:
            trt_rt = EagleRuntime.open(art, backend="tensorrt")
        out["open_s"] = time.perf_counter() - t0
        timer = CallTimer(trt_rt.backend)
        trt_rt.generator.backend = trt_rt.backend = timer
        cpu_rt = (EagleRuntime.open(art, backend="ort", providers=["CPUExecutionProvider"], fused=False)
                  if m.dtype != "bfloat16" else None)  # ONNX Runtime has no bf16 kernels
        t0 = time.perf_counter()  # the first run compiles kernels (TensorRT-RTX JIT): keep it out of the timings
        trt_rt.generate(prompt_ids=prompt_list[0], max_new_tokens=8, tree=tree, stop_on_eos=False)
        out["first_run_s"] = time.perf_counter() - t0

        # 1. Greedy tokens against the target's greedy output.
        for mode, use_draft in (("eagle", True), ("no-draft", False)):
            same = total = 0
            notes = []
            for p, w in zip(prompt_list, want, strict=True):
                got = trt_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, use_draft=use_draft,
                                      stop_on_eos=False).tokens
                k, n, note = agreement(ref, p, got, w, judged)
                same, total = same + k, total + n
                if note:
                    notes.append(note)
            bad = [x for x in notes if x != "tie"]
            out[f"greedy_{mode}"] = {"equal": same, "total": total, "notes": notes}
            say(f"tensorrt {mode:8s}: {same}/{total} tokens equal the target's greedy output (1-token, "
                f"{LONG_PROMPT}-token and {prompts} random prompts)" + (f" ({', '.join(notes)})" if notes else ""))
            if judged and bad:
                failures.append(f"{case} {mode}: {bad}")

        # 2. Sampling: the same seed twice on TensorRT, and once on the CPU reference.
        for p in prompt_list[:2]:
            a = trt_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, sampling=sampling,
                                stop_on_eos=False).tokens
            b = trt_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, sampling=sampling,
                                stop_on_eos=False).tokens
            if a != b:
                failures.append(f"{case}: the same seed gave different tokens on TensorRT")
            line = f"tensorrt sampled (seed 1, {len(p)}-token prompt): repeatable {a == b}"
            if cpu_rt is not None:
                c = cpu_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, sampling=sampling,
                                    stop_on_eos=False).tokens
                k = next((i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y), len(a))
                line += f"; {k}/{len(a)} tokens equal the CPU reference before the first difference"
                out.setdefault("sampled_vs_cpu", []).append({"prompt_tokens": len(p), "equal_prefix": k,
                                                             "total": len(a)})
            say(line)

        # 3. Per-graph max error against the PyTorch modules (fp32 modules, same inputs).
        d = load_draft_head(drafts[head_name], loaded)
        modules = {C.TARGET_GRAPH: TargetVerify(loaded.model, d.feature_layers).eval(),
                   C.DRAFT_GRAPH: DraftStep(d.head, m.tree_limits.max_top_k).eval()}
        calls = {C.TARGET_GRAPH: [("prefill", MAX_PREFILL, 0, 1), ("verify", 13, 50, 13)],
                 C.DRAFT_GRAPH: [("context", MAX_PREFILL, 0, 0), ("tree", 8, 50, 8)]}
        for graph, cases_ in calls.items():
            for label, new, past, rows in cases_:
                x = graph_inputs(m, graph, new, past, rows, np.random.default_rng(new + past))
                ref_out = pytorch_outputs(modules, m, graph, x)
                for bname, backend in (("tensorrt", timer), ("cpu-ref", cpu_rt.backend if cpu_rt else None)):
                    if backend is None:
                        continue
                    errs = max_errors(run_backend(backend, m, graph, x), ref_out)
                    out.setdefault("max_error", {})[f"{bname} {graph} {label}"] = errs
                    say(f"{bname:8s} {graph} {label:7s} (new {new}, past {past}): max |err| {summarize(errs)}")
                    worst = max(v for n, v in errs.items() if n != C.TOPK_IDS)
                    if judged and worst > FP32_TOL:
                        failures.append(f"{case} {bname} {graph} {label}: max error {worst:.2e} > {FP32_TOL}")

        # 4. ONNX Runtime's CUDA execution provider (ONNX Runtime has no bf16 kernels).
        if not emulate and ort_problem is None and m.dtype != "bfloat16":
            cuda_rt = EagleRuntime.open(art, backend="ort", providers=["CUDAExecutionProvider"])
            same = total = 0
            notes = []
            for p, w in zip(prompt_list, want, strict=True):
                got = cuda_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, stop_on_eos=False).tokens
                k, n, note = agreement(ref, p, got, w, judged)
                same, total = same + k, total + n
                if note:
                    notes.append(note)
            out["ort_cuda_greedy"] = {"equal": same, "total": total, "notes": notes}
            say(f"onnxruntime-cuda eagle: {same}/{total} tokens equal the target's greedy output"
                + (f" ({', '.join(notes)})" if notes else ""))
            if judged and [x for x in notes if x != "tie"]:
                failures.append(f"{case} onnxruntime-cuda: {notes}")

        # 5. Host work against device time per call, and EAGLE vs --no-draft on the same engines.
        rates = {}
        for mode, use_draft in (("eagle", True), ("no-draft", False)):
            timer.host_s.clear()
            timer._events.clear()
            runs = []
            for p in prompt_list:
                r = trt_rt.generate(prompt_ids=p, max_new_tokens=new_tokens, tree=tree, use_draft=use_draft,
                                    stop_on_eos=False)
                runs.append((len(r.tokens) / max(r.stats.decode_s + r.stats.prefill_s, 1e-9), r.stats.tau))
            dev_s = timer.device_s()
            rates[mode] = {"tokens_per_s": statistics.median(v for v, _ in runs),
                           "tau": statistics.mean(t for _, t in runs), "calls": len(timer.host_s),
                           "host_us_per_call": median_us(timer.host_s), "device_us_per_call": median_us(dev_s)}
            say(f"tensorrt {mode:8s}: {rates[mode]['tokens_per_s']:.0f} tok/s, tau {rates[mode]['tau']:.2f}; per "
                f"call (median of {len(timer.host_s)}): host {rates[mode]['host_us_per_call']:.0f} us, device "
                + (f"{rates[mode]['device_us_per_call']:.0f} us" if dev_s else "n/a (emulated)"))
        out["speed"] = rates
        ratio = rates["eagle"]["tokens_per_s"] / rates["no-draft"]["tokens_per_s"]
        say(f"tensorrt speed: EAGLE/--no-draft {ratio:.2f}x (random heads: tau near 1 is expected)")

    summary["failures"] = failures
    summary["total_s"] = time.perf_counter() - t_start
    json_path = json_path or workdir / "gpu_check.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1, default=str))
    say(f"\ntotal {summary['total_s']:.0f} s; summary in {json_path}; "
        + ("no judged check failed" if not failures else f"FAILED: {failures}"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

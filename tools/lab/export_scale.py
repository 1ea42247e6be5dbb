"""Scale benchmark: export real-size random-weight models and measure what decides EAGLE's speedup at that size.

    python tools/lab/export_scale.py [--models 1b,3b,8b] [--work /tmp/scale] [--keep]

For each shape (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, each with an EAGLE-3 head of draft vocabulary 32000)
it writes a random-weight checkpoint laid out as the published ones are (fp16 safetensors, sharded with an index
above 5 GB; the head as one model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d), writing tensor by
tensor so the whole model is never in memory. Then, each in a child process of its own so peak memory is the
step's alone: `export --dtype fp16`, and `EagleRuntime.open` followed by per-call timings on ONNX Runtime CPU:
a one-token target step, verifies of 4/8/16/32 tokens (on the target graph the runtime opened: the fused one when
the artifact has one, bound as the runtime binds it), a draft step (one tree level), each the fastest of --reps
calls (--clock cpu: process CPU time), and the host work of a round from a short EAGLE generation. It prints a
table and the bound

    speedup <= tau x t_step / (t_verify(total_tokens + 1) + depth x t_draft + host)

at tau 3, 4, 5 for the default tree (random weights accept nothing: tau is the trained heads' business; this
says what tau a CPU needs). Figures go to stdout and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_export.tree_params import TreeParams

DRAFT_VOCAB = 32000
SHARD_BYTES = 5 * 10**9  # what `save_pretrained` shards published Llama checkpoints at
CONTEXT = 256  # cache rows in place when the per-call costs are measured
VERIFY_SIZES = (4, 8, 16, 32)

# Shapes of the published checkpoints (config.json of meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope=LLAMA3_ROPE),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope=LLAMA3_ROPE),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope={**LLAMA3_ROPE, "factor": 8.0}),
}
NAMES = {"1b": "Llama-3.2-1B", "3b": "Llama-3.2-3B", "8b": "Llama-3.1-8B"}
VOCAB = 128256


# ---- checkpoints, written tensor by tensor -----------------------------------------------------------------------

ST_DTYPES = {torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]], make) -> int:
    """Write a safetensors file whose tensors ``make(name, shape, dtype)`` produces one at a time.

    The format is an 8-byte header length, a JSON header with each tensor's dtype, shape and byte range, then
    the bytes; since every range follows from the shapes, the header is written first and the tensors streamed
    after it (safetensors' own writers take every tensor at once). Returns the file's size.
    """
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        n = 1
        for d in shape:
            n *= d
        size = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, dtype in specs:
            t = make(name, shape, dtype).contiguous()
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: made {tuple(t.shape)} {t.dtype}, header says {shape} {dtype}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
    return path.stat().st_size


def _random_maker(seed: int, std: float = 0.02):
    """Tensor factory for random weights: N(0, std) matrices, ones for norms, given id maps (d2t, t2d)."""
    gen = torch.Generator().manual_seed(seed)
    fixed: dict[str, torch.Tensor] = {}

    def make(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name in fixed:
            return fixed.pop(name)
        if "norm" in name:
            return torch.ones(shape, dtype=dtype)
        t = torch.empty(shape, dtype=dtype)
        rows = max(1, (64 << 20) // max(1, t[0].numel() * t.element_size())) if t.dim() > 1 else t.shape[0]
        for i in range(0, t.shape[0], rows):  # in slices: the float32 randn temporary stays small
            t[i:i + rows] = torch.randn(t[i:i + rows].shape, generator=gen).mul_(std).to(dtype)
        return t

    make.fixed = fixed
    return make


def target_specs(shape: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    f16 = torch.float16
    specs = [("model.embed_tokens.weight", (VOCAB, h), f16)]
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        specs += [(p + "input_layernorm.weight", (h,), f16), (p + "mlp.down_proj.weight", (h, i), f16),
                  (p + "mlp.gate_proj.weight", (i, h), f16), (p + "mlp.up_proj.weight", (i, h), f16),
                  (p + "post_attention_layernorm.weight", (h,), f16), (p + "self_attn.k_proj.weight", (kv, h), f16),
                  (p + "self_attn.o_proj.weight", (h, q), f16), (p + "self_attn.q_proj.weight", (q, h), f16),
                  (p + "self_attn.v_proj.weight", (kv, h), f16)]
    specs.append(("model.norm.weight", (h,), f16))
    if not shape["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (VOCAB, h), f16))
    return specs


def _nbytes(spec) -> int:
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty((), dtype=spec[2]).element_size()


def write_target(out: Path, shape: dict, seed: int = 0) -> int:
    """A random Llama target with this shape: config.json, generation_config.json, safetensors (sharded past 5 GB
    with model.safetensors.index.json, as save_pretrained lays it out). Returns the weight bytes."""
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    rope = dict(shape["rope"])
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"], hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=shape["tie_word_embeddings"],
        bos_token_id=128000, eos_token_id=128001, rope_parameters=rope,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = torch.float16
    cfg.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    specs = target_specs(shape)
    total = sum(_nbytes(s) for s in specs)
    make = _random_maker(seed)
    if total <= SHARD_BYTES:
        write_safetensors(out / "model.safetensors", specs, make)
        return total
    shards: list[list] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + _nbytes(s) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += _nbytes(s)
    weight_map = {}
    for k, group in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, group, make)
        weight_map.update({s[0]: name for s in group})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def write_eagle3_head(out: Path, shape: dict, seed: int = 1) -> int:
    """A random EAGLE-3 head for the target shape, in the published layout (no embed_tokens: it reads the
    target's). Returns the weight bytes."""
    out.mkdir(parents=True, exist_ok=True)
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": i, "num_attention_heads": shape["num_attention_heads"],
           "num_key_value_heads": shape["num_key_value_heads"], "head_dim": hd, "num_hidden_layers": 1,
           "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": shape["rope"]["rope_theta"],
           "rope_scaling": {k: v for k, v in shape["rope"].items() if k != "rope_theta"},
           "target_hidden_size": h, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "float16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    f16 = torch.float16
    p = "midlayer."
    specs = [("d2t", (DRAFT_VOCAB,), torch.int64), ("fc.weight", (h, 3 * h), f16),
             ("lm_head.weight", (DRAFT_VOCAB, h), f16),
             (p + "hidden_norm.weight", (h,), f16), (p + "input_layernorm.weight", (h,), f16),
             (p + "mlp.down_proj.weight", (h, i), f16), (p + "mlp.gate_proj.weight", (i, h), f16),
             (p + "mlp.up_proj.weight", (i, h), f16), (p + "post_attention_layernorm.weight", (h,), f16),
             (p + "self_attn.k_proj.weight", (kv, 2 * h), f16), (p + "self_attn.o_proj.weight", (h, q), f16),
             (p + "self_attn.q_proj.weight", (q, 2 * h), f16), (p + "self_attn.v_proj.weight", (kv, 2 * h), f16),
             ("norm.weight", (h,), f16), ("t2d", (VOCAB,), torch.bool)]
    make = _random_maker(seed)
    # The draft vocabulary: the 32000 most frequent target ids in the reference's recipe; here every 4th id.
    tid = torch.arange(DRAFT_VOCAB, dtype=torch.int64) * (VOCAB // DRAFT_VOCAB)
    make.fixed["d2t"] = tid - torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[tid] = True
    make.fixed["t2d"] = t2d
    write_safetensors(out / "model.safetensors", specs, make)
    return sum(_nbytes(s) for s in specs if s[2] == f16)


# ---- child steps (each in its own process: its peak memory is its own) -----------------------------------------


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes, from /proc (VmRSS, VmHWM)."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":")
            got[k] = int(v.split()[0]) * 1024
    return got.get("VmRSS", 0), got.get("VmHWM", 0)


def child_export(target: str, draft: str, out: str, dtype: str, feature_layers: list[int] | None = None,
                 quantize: str | None = None) -> dict:
    from eagle_export.export.exporter import ExportOptions, export_with_report
    from eagle_export.export.quantization.artifact import QuantizeOptions

    quant = None if quantize is None else QuantizeOptions(bits=int(quantize.removeprefix("int")))
    opts = ExportOptions(dtype=dtype, max_seq_len=2048, overwrite=True, feature_layers=feature_layers, quantize=quant)
    r = export_with_report(target, draft, out, opts, progress=False)
    return {"wall_s": r.wall_s, "peak_rss": r.peak_rss_bytes, "weights": r.weights_bytes,
            "artifact": r.artifact_bytes, "lean": r.lean}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _best_time(fn, reps: int, clock: str = "wall") -> float:
    """The fastest of ``reps`` timed calls after a warm-up: on a shared machine the other jobs only ever add time,
    so the minimum is the closest to the call's own cost. clock "cpu": the process's CPU time (all its threads,
    which do not spin then: ``child_open``), which another job's preemptions do not inflate."""
    tick = CLOCKS[clock]
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = tick()
        fn()
        times.append(tick() - t0)
    return min(times)


def child_open(artifact: str, reps: int, clock: str = "wall") -> dict:
    import numpy as np
    from graph_bench import bind_target_call

    from eagle_export import contract as C
    from eagle_export.runtime import EagleRuntime

    rss0, _ = _rss()
    # CPU time counts a spinning thread's waiting: with --clock cpu the threads do not spin, so it counts work.
    rt = EagleRuntime.open(artifact, spin="off" if clock == "cpu" else None)
    open_s = rt.open_s
    rss_open, hwm_open = _rss()
    m = rt.manifest
    np_dtype = np.dtype(m.dtype)
    sessions = {name: g.session for name, g in rt.backend.graphs.items()}
    # The target graph the runtime opened: the fused one when the artifact has it (ONNX Runtime), else the standard
    # one; bound as the runtime binds it (the fused graph's cache is one capacity-long buffer written in place).
    target_graph = C.graph_for("ort", "target", sessions)
    d = m.draft

    def target_call(n: int):
        return bind_target_call(sessions[target_graph], m, target_graph, CONTEXT, n)

    costs = {}
    costs["step"] = _best_time(target_call(1), reps, clock)
    for n in VERIFY_SIZES:
        costs[f"verify{n}"] = _best_time(target_call(n), reps, clock)
    tree = m.tree_defaults
    rows = tree.top_k
    dfeed = {C.INPUT_EMBEDS: np.zeros((1, rows, d.hidden_size), np_dtype),
             C.DRAFT_FEATURES: np.zeros((1, 0, d.feature_dim), np_dtype),
             C.HIDDEN_IN: np.zeros((1, rows, d.hidden_size), np_dtype),
             C.POSITION_IDS: np.full((1, rows), CONTEXT, np.int64),
             C.ATTENTION_MASK: np.ones((1, rows, CONTEXT + rows), bool)}
    for name in C.past_names(1):
        dfeed[name] = np.zeros((1, CONTEXT, d.kv_heads, d.head_dim), np_dtype)
    step = rt.backend.graph(C.DRAFT_GRAPH).session  # the step graph opens when first asked for
    costs["draft"] = _best_time(lambda: step.run(None, dfeed), reps, clock)
    costs["verify_tree"] = _best_time(target_call(tree.verify_tokens), reps, clock)
    host = _host_per_round(rt)
    _, hwm = _rss()
    return {"open_s": open_s, "open_rss": rss_open - rss0, "open_rss_total": rss_open, "open_hwm": hwm_open,
            "run_hwm": hwm, "target_graph": target_graph, "clock": clock, "costs": costs, "host_s": host,
            "tree": asdict(tree)}


def _host_per_round(rt) -> float:
    """Host work per EAGLE round: decode time minus graph execution, over a short generation, run twice and the
    second one counted (the first pays first-touch costs: buffers, and the draft's embedding rows, read from disk
    when the page cache has dropped them, 0.5 ms a row at 3B)."""
    from eagle_export.runtime.timing import TimingInstalled
    from eagle_export.tools.commands.bench import _generate

    with TimingInstalled(rt) as proxy:
        ids = [(1000 + i) % rt.manifest.target.vocab_size for i in range(32)]
        for _ in range(2):
            run = _generate(rt, proxy, ids, 8, rt.manifest.tree_defaults, True)
    return (run.decode_s - run.draft_s - run.target_s) / max(run.rounds, 1)


def open_estimate(artifact: Path) -> int:
    """Bytes of weights ONNX Runtime CPU holds once the runtime has opened ``artifact``: every initializer of the
    graphs it opens (the fused target graph when there is one, not the standard graph's quantized copy), each stored
    tensor counted once, float16 ones twice (its CPU provider has no fp16 MatMul and holds them as float32)."""
    import onnx

    from eagle_export import contract as C
    from eagle_export.manifest import load_manifest

    m = load_manifest(artifact)
    opened = {C.graph_for("ort", "target", m.graphs), C.DRAFT_GRAPH}
    tree = C.tree_graphs(m.graphs).get(m.tree_defaults.top_k)  # the runtime opens the default tree's graph
    if tree is not None:
        opened.add(tree[0])
    seen: set[tuple[str, str]] = set()
    total = 0
    for name in opened:
        g = onnx.load(str(artifact / m.graphs[name].file), load_external_data=False)
        for t in g.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if "location" in ext:
                key = (ext["location"], ext.get("offset", "0"))
                if key in seen:
                    continue
                seen.add(key)
                n = int(ext["length"])
            else:
                n = len(t.raw_data)
            total += n * (2 if t.data_type == onnx.TensorProto.FLOAT16 else 1)
    return total


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(args)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed (status {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the table ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    params: int
    weights_bytes: int
    write_s: float
    export: dict
    open: dict | None  # None: not opened (--no-open)

    def bound(self, tau: float) -> float:
        """The default tree: verify total_tokens + 1, depth draft steps."""
        c = self.open["costs"]
        tree = self.open["tree"]
        round_s = c["verify_tree"] + tree["depth"] * c["draft"] + self.open["host_s"]
        return tau * c["step"] / round_s

    def chain_bound(self, tau: float) -> float:
        """A depth-3 chain (top_k 1): verify 4 tokens, 3 draft steps (timed at top_k rows: an upper bound)."""
        c = self.open["costs"]
        return tau * c["step"] / (c["verify4"] + 3 * c["draft"] + self.open["host_s"])


def _gb(x: float) -> str:
    return f"{x / 2**30:.2f}"


def format_table(rows: list[Row]) -> str:
    out = ["| model | params | weights GiB | export s | export peak GiB (x weights) | artifact GiB (x weights) | "
           "open s | open RSS GiB (x weights) | step ms | verify 4/8/16/32 ms | draft ms | host ms | "
           "bound, default tree, tau 3/4/5 | bound, 3-chain, tau 2/3/4 |", "|" + "---|" * 14]
    for r in rows:
        e = r.export
        w = e["weights"]
        base, _, cut = r.model.partition("-L")
        label = NAMES.get(base, base) + (f" ({cut} layers)" if cut else "")
        cells = [f"{label} + EAGLE-3", f"{r.params / 1e9:.2f} B", _gb(w), f"{e['wall_s']:.0f}",
                 f"{_gb(e['peak_rss'])} ({e['peak_rss'] / w:.2f}x)", f"{_gb(e['artifact'])} ({e['artifact'] / w:.2f}x)"]
        if r.open is None:
            cells += ["not opened"] + [""] * 7
        else:
            o, c = r.open, r.open["costs"]
            cells += [f"{o['open_s']:.1f}", f"{_gb(o['open_rss'])} ({o['open_rss'] / w:.2f}x)",
                      f"{c['step'] * 1e3:.0f}", "/".join(f"{c[f'verify{n}'] * 1e3:.0f}" for n in VERIFY_SIZES),
                      f"{c['draft'] * 1e3:.0f}", f"{o['host_s'] * 1e3:.0f}",
                      "/".join(f"{r.bound(t):.2f}" for t in (3, 4, 5)),
                      "/".join(f"{r.chain_bound(t):.2f}" for t in (2, 3, 4))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def run_model(key: str, work: Path, reps: int, keep: bool, dtype: str = "fp16", open_it: bool = True,
              layers: int | None = None, log=print, quantize: str | None = None, clock: str = "wall") -> Row:
    shape = dict(SHAPES[key])
    feature_layers = None
    if layers is not None:  # a cut-down copy: the real widths, fewer decoder layers (per-layer costs)
        shape["num_hidden_layers"] = layers
        feature_layers = [0, layers // 2, layers - 1]
    name = key if layers is None else f"{key}-L{layers}"
    base = work / name
    tdir, ddir, art = base / "target", base / "eagle3", base / "artifact"
    t0 = time.perf_counter()
    if not (tdir / "config.json").is_file() or not (ddir / "model.safetensors").is_file():
        log(f"[{key}] writing random checkpoints to {base}")
        write_target(tdir, shape)
        write_eagle3_head(ddir, shape)
    write_s = time.perf_counter() - t0
    params = sum(_nbytes(s) // 2 for s in target_specs(shape))
    log(f"[{key}] exporting {dtype}" + (f", --quantize {quantize}" if quantize else ""))
    exp = _child(["export", str(tdir), str(ddir), str(art), dtype, feature_layers, quantize])
    log(f"[{key}] export {exp['wall_s']:.0f} s, peak {_gb(exp['peak_rss'])} GiB; opening and timing")
    opened = None
    if open_it:
        need = open_estimate(art) * 1.1
        avail = _mem_available()
        if need > avail:
            log(f"[{key}] not opening: ONNX Runtime CPU would hold ~{_gb(need)} GiB of weights, "
                f"{_gb(avail)} GiB available")
        else:
            opened = _child(["open", str(art), str(reps), clock])
    row = Row(name, params, exp["weights"], write_s, exp, opened)
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1b,3b,8b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/scale"), help="where checkpoints and artifacts go")
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="export dtype")
    ap.add_argument("--quantize", choices=("int4", "int8"), default=None,
                    help="export --quantize (symmetric, block 32, level 4): the target's projections")
    ap.add_argument("--no-open", action="store_true", help="export only (no open, no per-call costs)")
    ap.add_argument("--layers", type=int, default=None,
                    help="cut each model down to this many decoder layers (real widths): per-layer costs of a "
                         "model too large to open here")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per measured graph call (the fastest counts)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="per-call clock: wall, or cpu (the process's CPU time, all threads, opened with spinning off: "
                         "what a loaded machine's preemptions do not inflate)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and artifacts (default: delete each)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        args = json.loads(a.child)
        res = child_export(*args[1:]) if args[0] == "export" else child_open(args[1], int(args[2]), *args[3:])
        print(json.dumps(res))
        return 0
    keys = [k.strip() for k in a.models.split(",") if k.strip()]
    bad = [k for k in keys if k not in SHAPES]
    if bad:
        print(f"error: unknown model {bad[0]!r}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    rows = []
    for key in keys:
        rows.append(run_model(key, a.work, a.reps, a.keep, a.dtype, not a.no_open, a.layers, quantize=a.quantize,
                              clock=a.clock))
        print(format_table(rows[-1:]), flush=True)
    tree = TreeParams()
    print(f"\ndefault tree top_k {tree.top_k}, depth {tree.depth}, total_tokens {tree.total_tokens} "
          f"(verify {tree.total_tokens + 1} tokens); context {CONTEXT} cache rows; ONNX Runtime CPU")
    print(format_table(rows))
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE cost benchmark: a target step's cost with routed experts (export/graphs/families.py: the selected experts
gathered by index) against the same layers made dense at the active experts' width, and dense at all experts' width.

    python tools/lab/moe_cost.py [--shapes qwen3-30b-a3b,gpt-oss-20b] [--layers 1] [--widths 1,4,16,32]
                                          [--variants moe,union,active,all]

For each shape (the published config's hidden size, heads, expert count, top-k and expert width; ``--layers``
decoder layers; a 1024-token vocabulary so the lm_head does not hide the MLP) it builds a random-weight
transformers model, traces the standard target verify graph (fp32) up to four ways, each in a child process so
peak memory is one variant's: ``moe`` (the model as exported: the STATIC selection, a ``TopK`` of min(T x top_k,
experts) experts), ``union`` (the UNION selection the fused graph uses: ``NonZero``, exactly the hit experts),
``active`` (each MoE block replaced by one SwiGLU MLP of
top_k x the expert width: what the step would cost if exactly the active experts' weights were read), ``all``
(one SwiGLU MLP of experts x the expert width: every expert computed). Then ONNX Runtime CPU times a verify of
T new tokens over 256 cached rows, the fastest of --reps calls, for each T in --widths. Figures go to stdout.
The clock is the process's CPU time per call by default (one intra-op thread, spinning off), which a preemption
on a shared machine does not inflate; ``--clock wall`` reads wall time.
Random routing spreads the tokens over experts as evenly as a trained router does at worst, so a T-token
call's hit experts are near min(T x top_k, experts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONTEXT = 256
SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json: 128 experts, top-8, moe_intermediate_size 768, GQA 32/4, head_dim 128.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True),
    # openai/gpt-oss-20b config.json: 32 experts, top-4, intermediate_size 2880, GQA 64/8, head_dim 64, sinks.
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, attention_bias=True),
}


def _expert_dims(cfg: dict) -> tuple[int, int, int]:
    """(experts, top_k, expert width)."""
    if cfg["model_type"] == "qwen3_moe":
        return cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    return cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]


class SwiGLU(torch.nn.Module):
    """A dense SwiGLU MLP of the given width (the stand-in for ``active`` and ``all``)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, width, bias=False)
        self.up_proj = torch.nn.Linear(hidden, width, bias=False)
        self.down_proj = torch.nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def child(shape: str, variant: str, layers: int, widths: list[int], reps: int, threads: int, clock: str) -> dict:
    import onnxruntime as ort
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle_export import contract as C
    from eagle_export.export.exporter import _export_graph
    from eagle_export.export.graphs.families import STATIC, UNION
    from eagle_export.export.graphs.target import TargetVerify

    cfg = dict(SHAPES[shape])
    mt = cfg.pop("model_type")
    experts, top_k, width = _expert_dims(SHAPES[shape])
    config = AutoConfig.for_model(mt, num_hidden_layers=layers, vocab_size=1024, initializer_range=0.02,
                                  tie_word_embeddings=False, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config).eval()
        if variant not in ("moe", "union"):
            for layer in model.model.layers:
                layer.mlp = SwiGLU(config.hidden_size, (top_k if variant == "active" else experts) * width)
                for p in layer.mlp.parameters():
                    p.normal_(0, 0.02)
    params = sum(p.numel() for p in model.model.layers.parameters())
    hd, kv = config.head_dim, config.num_key_value_heads
    spec = C.target_verify_spec(num_layers=layers, kv_heads=kv, head_dim=hd, vocab_size=1024,
                                feature_dim=config.hidden_size, dtype="float32")
    b, t, p = 1, 3, 5
    args = (torch.zeros(b, t, dtype=torch.long), torch.arange(p, p + t)[None],
            torch.ones(b, t, p + t, dtype=torch.bool),
            torch.tensor([[0, 2]]), *[torch.zeros(b, p, kv, hd) for _ in range(2 * layers)])
    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "target_verify.onnx"
        with torch.no_grad():
            module = TargetVerify(model, None, UNION if variant == "union" else STATIC)
            _export_graph(module.eval(), args, spec, path)
        del model
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        now = time.process_time if clock == "cpu" else time.perf_counter
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        rng = torch.Generator().manual_seed(1)
        for n in widths:
            feed = {C.INPUT_IDS: torch.randint(0, 1024, (1, n), generator=rng).numpy(),
                    C.POSITION_IDS: torch.arange(CONTEXT, CONTEXT + n)[None].numpy(),
                    C.ATTENTION_MASK: torch.ones(1, n, CONTEXT + n, dtype=torch.bool).numpy(),
                    C.LOGIT_INDICES: torch.zeros(1, 1, dtype=torch.long).numpy()}
            feed.update({name: torch.randn(1, CONTEXT, kv, hd).numpy() * 0.1 for name in C.past_names(layers)})
            best = float("inf")
            for _ in range(reps + 1):
                t0 = now()
                sess.run([C.LOGITS], feed)
                best = min(best, now() - t0)
            out[n] = best
    return {"params": params, "times": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--widths", default="1,4,16,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--variants", default="moe,union,active,all")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")]
    if a.child:
        shape, variant = a.child.split(":")
        print(json.dumps(child(shape, variant, a.layers, widths, a.reps, a.threads, a.clock)))
        return 0
    print("| shape | layers | variant | layer params | " + " | ".join(f"T={w} ms" for w in widths) + " |")
    print("|---|---|---|---|" + "---|" * len(widths))
    for shape in a.shapes.split(","):
        for variant in a.variants.split(","):
            cmd = [sys.executable, __file__, "--child", f"{shape}:{variant}",
                   "--layers", str(a.layers), "--widths", a.widths, "--reps", str(a.reps), "--threads", str(a.threads),
                   "--clock", a.clock]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                print(f"{shape} {variant}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            times = " | ".join(f"{r['times'][str(w)] * 1e3:.1f}" for w in widths)
            print(f"| {shape} | {a.layers} | {variant} | {r['params'] / 1e6:.0f} M | {times} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

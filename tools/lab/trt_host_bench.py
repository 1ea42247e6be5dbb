"""Host work of the TensorRT backend per call, on a CPU: TrtBackend over the emulator with TensorRT's execution
stubbed out, so what is timed is the backend's own planning, staging and binding (plus the stand-in's calls).

    python tools/lab/trt_host_bench.py ARTIFACT [--new-tokens 60] [--reset-each-call]

ARTIFACT needs engines (`eagle-export build`). One EAGLE generation is run three times; the last is reported:
median host microseconds per call of each engine that ran (the default tree's tree engine where `build` made
one, its candidates replayed from a real call), and how many set_input_shape / set_tensor_address /
get_tensor_shape calls the contexts received per graph call. ``--reset-each-call`` clears the plan cache and the
per-context memos before every call, which is what the backend did before it cached them (every binding
described, planned and set at every call). Figures are printed, never judged.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from eagle_export.tree_params import TreeParams

COUNTED = ("set_input_shape", "set_tensor_address", "get_tensor_shape")


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--new-tokens", type=int, default=60, show_default=True)
@click.option("--reset-each-call", is_flag=True, help="Clear the plan cache and context memos before each call.")
def main(artifact: Path, new_tokens: int, reset_each_call: bool) -> None:
    from eagle_export import contract as C
    from eagle_export.tools.testing import trt_emulator as E

    rt = E.emulated_runtime(artifact)
    be = rt.backend
    contexts = [c for g in be.graphs.values() for c in g.contexts]
    tree = TreeParams(4, 3, 12)
    prompt = list(range(3, 3 + min(37, rt.manifest.max_seq_len // 2)))
    # A tree engine's candidates make the next round's tree: one real generation keeps a valid block to replay.
    rt.generate(prompt_ids=prompt, max_new_tokens=2, tree=tree, stop_on_eos=False)
    gen = rt.generator
    block = gen._xblock.clone() if gen.tree_depths else None
    for c in contexts:  # TensorRT's execution becomes a no-op (no rule checks, no ONNX Runtime)
        c.execute_async_v3 = lambda handle: True
    times: list[tuple[str, float]] = []
    inner = be.run

    def timed(graph, inputs, outputs):
        if reset_each_call:
            for g in be.graphs.values():
                g.plans.clear()
                for memo in (*g.shapes, *g.addresses, *g.checked):
                    memo.clear()
        t0 = time.perf_counter()
        inner(graph, inputs, outputs)
        times.append((graph, time.perf_counter() - t0))
        if C.is_tree_graph(graph) and block is not None:
            gen._xblock.copy_(block)

    be.run = timed
    for _ in range(3):
        times.clear()
        before = {k: sum(c.calls[k] for c in contexts) for k in COUNTED}
        rt.generate(prompt_ids=prompt, max_new_tokens=new_tokens, tree=tree, stop_on_eos=False)
    n = len(times)
    per_call = {k: (sum(c.calls[k] for c in contexts) - before[k]) / n for k in COUNTED}
    med = {g: 1e6 * statistics.median(t for name, t in times if name == g) for g in be.graphs
           if any(name == g for name, _ in times)}
    click.echo(f"{artifact}: {rt.manifest.target.num_layers}-layer target, {n} calls"
               + (" (plans and memos reset before each call)" if reset_each_call else ""))
    click.echo("median host us per call: " + ", ".join(f"{g} {v:.0f}" for g, v in med.items()))
    click.echo("TensorRT calls per graph call: " + ", ".join(f"{k} {v:.1f}" for k, v in per_call.items()))


if __name__ == "__main__":
    main()

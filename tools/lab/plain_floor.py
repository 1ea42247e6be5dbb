"""`python tools/lab/plain_floor.py ARTIFACT [--peer-dir DIR]`: our plain decoding against the floor a Python host
can reach on the same graph, and against onnxruntime-genai.

Up to four decoders generate the same greedy tokens from the same prompt (EOS ignored), in one process, their order
rotated every round with a pause after each request: our runtime (``generate(use_draft=False)``); a **minimal loop**
over the artifact's fused target graph (one session, the caches bound once, per token: write the id and position,
rebind the grown mask, run, argmax); and, with --peer-dir, onnxruntime-genai on its model of the same checkpoint
(a folder its builder made: ``bench --peer`` keeps one under ``ARTIFACT/peers``) twice: as onnxruntime-genai runs
it (``peer``), and its graph in the same minimal loop (``peerloop``: the graph without the peer's host). Every
decoder's tokens must equal the others' or the program stops with an error.

Per decoder: wall microseconds a token; for ours and the two loops also the graph's execution alone (the
backend's ``last_exec_s`` after every call; the loops time their run calls) and the rest of a token (host work and
binding); and each decoder's paired median ratio to the minimal loop (round by round: a noisy machine moves a whole
round). What ours spends beyond the loop is what the runtime's machinery costs a plain step.

``--only NAME --requests N`` runs one decoder alone for N requests after a warm one and prints only its figures:
run it twice under ``valgrind --tool=callgrind`` (``--threads 1 --spin off``, N and N + k requests) and the
difference counts the instructions of k requests, which no neighbour's load can move. One thread: valgrind runs a
process's threads one at a time, so a thread waiting for another's share of a call spins and counts instructions.
A program that prints figures, not a test.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from eagle_export import contract as C
from eagle_export.dtypes import DTYPES
from eagle_export.manifest import load_manifest

DECODERS = ("loop", "ours", "peer", "peerloop")


def timed_run(s, b, run_s: list[float]) -> None:
    """One run of session ``s`` on binding ``b``, its seconds appended to ``run_s``."""
    t0 = time.perf_counter()
    s.run_with_iobinding(b)
    run_s.append(time.perf_counter() - t0)


def greedy_steps(s, b, run_s: list[float], tok: int, L: int, tokens: int, step_inputs, logits: np.ndarray) -> list[int]:
    """The one-token steps after a prefill that gave ``tok`` over ``L`` rows: ``step_inputs(tok, L)`` writes and
    binds a step's inputs, and the next token is the argmax of ``logits[0, 0]``. ``tokens`` tokens in all."""
    out = [tok]
    for _ in range(tokens - 1):
        step_inputs(tok, L)
        timed_run(s, b, run_s)
        tok, L = int(logits[0, 0].argmax()), L + 1
        out.append(tok)
    return out


def minimal_loop(directory: Path, threads: int, spin: str, prompt: list[int], tokens: int):
    """A callable decoding ``tokens`` greedy tokens after ``prompt`` with as little host work as Python allows, and
    the list its run calls' seconds go into."""
    import onnxruntime as ort

    from eagle_export.runtime.ort_backend import quantized_session_config, session_options

    m = load_manifest(directory)
    if C.TARGET_FUSED_GRAPH not in m.graphs:
        raise click.ClickException(f"{directory} has no fused target graph (re-export it): the minimal loop binds it")
    entry, t = m.graphs[C.TARGET_FUSED_GRAPH], m.target
    s = ort.InferenceSession(str(directory / entry.file), sess_options=session_options(
        threads, spin, quantized_session_config(m)), providers=["CPUExecutionProvider"])
    dt = DTYPES[m.dtype].numpy
    cap = entry.axes[C.CAPACITY][1]
    b = s.io_binding()
    keep = [np.zeros((1, t.kv_heads, cap, t.head_dim), dt) for _ in range(2 * t.num_layers)]
    for i in range(t.num_layers):
        for buf, (past, present) in zip(keep[2 * i:2 * i + 2], ((C.past_key(i), C.present_key(i)),
                                                                 (C.past_value(i), C.present_value(i))), strict=True):
            b.bind_cpu_input(past, buf)
            b.bind_output(present, "cpu", 0, dt, list(buf.shape), buf.ctypes.data)
    n = len(prompt)
    ids, pos, lidx = (np.zeros((1, max(n, 1)), np.int64) for _ in range(3))
    mask = np.ones((1, 1, cap), np.bool_)
    logits, feats = np.zeros((1, 1, t.vocab_size), np.float32), np.zeros((1, n, t.feature_dim), dt)
    run_s: list[float] = []

    def step_inputs(tok: int, L: int) -> None:
        ids[0, 0], pos[0, 0] = tok, L
        b.bind_cpu_input(C.ATTENTION_MASK, mask[:, :, :L + 1])

    def decode() -> list[int]:
        ids[0, :n], pos[0, :n], lidx[0, 0] = prompt, np.arange(n), n - 1
        b.bind_cpu_input(C.INPUT_IDS, ids[:, :n])
        b.bind_cpu_input(C.POSITION_IDS, pos[:, :n])
        b.bind_cpu_input(C.ATTENTION_MASK, np.tril(np.ones((1, n, n), np.bool_)))
        b.bind_cpu_input(C.LOGIT_INDICES, lidx[:, :1])
        b.bind_output(C.LOGITS, "cpu", 0, np.float32, [1, 1, t.vocab_size], logits.ctypes.data)
        b.bind_output(C.FEATURES, "cpu", 0, dt, [1, n, t.feature_dim], feats.ctypes.data)
        timed_run(s, b, run_s)
        tok = int(logits[0, 0].argmax())
        b.bind_cpu_input(C.INPUT_IDS, ids[:, :1])
        b.bind_cpu_input(C.POSITION_IDS, pos[:, :1])
        lidx[0, 0] = 0
        b.bind_output(C.FEATURES, "cpu", 0, dt, [1, 1, t.feature_dim], feats.ctypes.data)
        return greedy_steps(s, b, run_s, tok, n, tokens, step_inputs, logits)

    return decode, run_s


def peer_loop(peer_dir: Path, threads: int, spin: str, prompt: list[int], tokens: int):
    """The minimal loop over onnxruntime-genai's graph (its ``model.onnx``) on our session options, its caches one
    buffer of the request's length bound as past and present, as onnxruntime-genai binds them: the peer's graph
    without the peer's host."""
    import onnxruntime as ort

    from eagle_export.runtime.ort_backend import session_options

    cfg = json.loads((peer_dir / "genai_config.json").read_text())["model"]
    dec, vocab = cfg["decoder"], int(cfg["vocab_size"])
    s = ort.InferenceSession(str(peer_dir / dec["filename"]), sess_options=session_options(threads, spin),
                             providers=["CPUExecutionProvider"])
    b = s.io_binding()
    n, cap = len(prompt), len(prompt) + tokens
    shape = [1, dec["num_key_value_heads"], cap, dec["head_size"]]
    keep = [np.zeros(shape, np.float32) for _ in range(2 * dec["num_hidden_layers"])]
    for i in range(dec["num_hidden_layers"]):
        for buf, kind in zip(keep[2 * i:2 * i + 2], ("key", "value"), strict=True):
            b.bind_cpu_input(f"past_key_values.{i}.{kind}", buf)
            b.bind_output(f"present.{i}.{kind}", "cpu", 0, np.float32, shape, buf.ctypes.data)
    ids, ones = np.zeros((1, n), np.int64), np.ones((1, cap), np.int64)
    logits = np.zeros((1, n, vocab), np.float32)
    run_s: list[float] = []

    def step_inputs(tok: int, L: int) -> None:
        ids[0, 0] = tok
        b.bind_cpu_input("attention_mask", ones[:, :L + 1])

    def decode() -> list[int]:
        ids[0, :n] = prompt
        b.bind_cpu_input("input_ids", ids[:, :n])
        b.bind_cpu_input("attention_mask", ones[:, :n])
        b.bind_output("logits", "cpu", 0, np.float32, [1, n, vocab], logits.ctypes.data)
        timed_run(s, b, run_s)
        tok = int(logits[0, n - 1].argmax())
        b.bind_cpu_input("input_ids", ids[:, :1])
        b.bind_output("logits", "cpu", 0, np.float32, [1, 1, vocab], logits.ctypes.data)
        return greedy_steps(s, b, run_s, tok, n, tokens, step_inputs, logits)

    return decode, run_s


def ours(directory: Path, threads: int, spin: str, prompt: list[int], tokens: int):
    """Our runtime's plain decoding, and the list its graph executions' seconds go into (``last_exec_s``)."""
    from eagle_export.runtime import EagleRuntime

    rt = EagleRuntime.open(directory, threads=threads, guard=False, spin=f"target={spin},draft=off")
    backend, run_s = rt.backend, []
    inner = backend.run

    def timed_run(graph, inputs, outputs):
        inner(graph, inputs, outputs)
        run_s.append(backend.last_exec_s)

    backend.run = timed_run
    return (lambda: rt.generate(prompt_ids=prompt, max_new_tokens=tokens, use_draft=False,
                                stop_on_eos=False).tokens), run_s


def peer(peer_dir: Path, threads: int, prompt: list[int], tokens: int, work: Path):
    """onnxruntime-genai's greedy decoding of its model (a copy of its config in ``work``: ``threads`` intra-op
    threads, EOS out of reach; the model files linked, not copied)."""
    import onnxruntime_genai as og

    cfg = json.loads((peer_dir / "genai_config.json").read_text())
    for f in peer_dir.iterdir():
        if f.name != "genai_config.json":
            (work / f.name).symlink_to(f.resolve())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    cfg["model"]["eos_token_id"] = int(cfg["model"]["vocab_size"]) - 1
    (work / "genai_config.json").write_text(json.dumps(cfg))
    model = og.Model(str(work))

    def decode() -> list[int]:
        p = og.GeneratorParams(model)
        p.set_search_options(do_sample=False, max_length=len(prompt) + tokens)
        g = og.Generator(model, p)
        g.append_tokens(prompt)
        while not g.is_done():
            g.generate_next_token()
        return [int(x) for x in g.get_sequence(0)][len(prompt):]

    return decode, None


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--peer-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="An onnxruntime-genai model folder of the same checkpoint (bench --peer keeps one).")
@click.option("--tokens", default=64, show_default=True)
@click.option("--rounds", default=40, show_default=True, help="Rotations: each decoder one request per round.")
@click.option("--threads", default=2, show_default=True)
@click.option("--spin", type=click.Choice(["off", "run", "on"]), default="run", show_default=True,
              help="The target session's spin policy, ours and the loop's alike (the runtime's default is run).")
@click.option("--only", type=click.Choice(DECODERS), default=None, help="One decoder alone (for callgrind).")
@click.option("--requests", default=3, show_default=True, type=click.IntRange(min=1),
              help="With --only: requests after the warm one.")
def main(artifact: Path, peer_dir: Path | None, tokens: int, rounds: int, threads: int, spin: str,
         only: str | None, requests: int) -> None:
    m = load_manifest(artifact)
    vocab = m.target.vocab_size
    prompt = [(7 * i + 3) % (vocab - 1) for i in range(12)]
    names = [only] if only else [n for n in DECODERS if not n.startswith("peer") or peer_dir is not None]
    if names[0].startswith("peer") and peer_dir is None:
        raise click.UsageError(f"--only {only} needs --peer-dir")
    with tempfile.TemporaryDirectory() as work:
        made = {}
        for name in names:
            if name == "loop":
                made[name] = minimal_loop(artifact, threads, spin, prompt, tokens)
            elif name == "ours":
                made[name] = ours(artifact, threads, spin, prompt, tokens)
            elif name == "peerloop":
                made[name] = peer_loop(peer_dir, threads, spin, prompt, tokens)
            else:
                made[name] = peer(peer_dir, threads, prompt, tokens, Path(work))
        ref = None
        for name, (decode, _) in made.items():  # a warm request each, and the tokens checked
            got = decode()
            ref = got if ref is None else ref
            if got != ref:
                raise click.ClickException(f"{name}'s tokens differ from {names[0]}'s: {got[:12]} vs {ref[:12]}")
        wall: dict[str, list[float]] = {n: [] for n in names}
        graph: dict[str, list[float]] = {n: [] for n in names}
        for r in range(requests if only else rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                decode, run_s = made[name]
                if run_s is not None:
                    run_s.clear()
                t0 = time.perf_counter()
                decode()
                wall[name].append((time.perf_counter() - t0) / tokens)
                if run_s is not None:
                    graph[name].append(sum(run_s) / tokens)
                if not only:
                    time.sleep(0.03)
    click.echo(f"{artifact}, {tokens} tokens a request, {threads} threads, spin {spin}, "
               f"{requests if only else rounds} requests each (medians):")
    for name in names:
        w = statistics.median(wall[name])
        line = f"  {name:8s} {w * 1e6:7.1f} us a token"
        if graph[name]:
            g = statistics.median(graph[name])
            line += f"  (graph {g * 1e6:.1f}, the rest {(w - g) * 1e6:.1f})"
        if not only and name != "loop" and "loop" in wall:
            paired = statistics.median(a / b for a, b in zip(wall[name], wall["loop"], strict=True))
            line += f"  {paired:.3f}x the loop (paired)"
        click.echo(line)


if __name__ == "__main__":
    main()

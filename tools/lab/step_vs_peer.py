"""Plain greedy decoding of quantized artifacts side by side with onnxruntime-genai's model of the same checkpoint.

    python tools/lab/step_vs_peer.py ARTIFACT [ARTIFACT ...] --peer-dir DIR [--tokens 16] [--rounds 7] [--threads 2]
        [--spin "target=run,draft=off;on"] [--processes]

DIR is a model onnxruntime-genai's builder made (``bench --peer`` keeps one under ``ARTIFACT/peers``, or
``--peer-cache``). Each decoder generates --tokens tokens from the same 12-id prompt (EOS ignored), in an order
rotated every round with a 50 ms pause after each run (the peer's threads spin on); per-token wall and process-CPU
times, medians over the rounds, and each decoder's ratio to the peer. At 60 ms a step the prompt's prefill and the
host work are a few percent: this compares the one-token steps.

With --processes each decoder runs alone in a fresh process per round (5 timed runs after a warm one, their median),
the decoders alternating: no other decoder's thread pool shares the process. In one process, a runtime or peer whose
threads spin on after a call slows the runs after it, and the figures depend on which decoders are open.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--peer-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--processes", action="store_true", help="each decoder alone in a fresh process per round")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: "peer" or "ARTIFACT|SPIN"
    ap.add_argument("--spin", default="target=run,draft=off",
                    help="our runtimes' spin policies, ';'-separated (each artifact with each). A runtime with 'on' "
                         "keeps its threads spinning after its calls, and the runs after it (the peer's too) slow "
                         "down: compare such a run with the others only where its neighbours are unchanged")
    a = ap.parse_args(argv)

    import onnxruntime_genai as og

    from eagle_export.runtime import EagleRuntime

    cfg_path = a.peer_dir / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = a.threads
    vocab = int(cfg["model"]["vocab_size"])
    cfg["model"]["eos_token_id"] = vocab - 1  # an id a 16-token run from this prompt does not reach: EOS ignored
    cfg_path.write_text(json.dumps(cfg, indent=2))
    prompt = [(7 * i + 3) % (vocab - 1) for i in range(12)]
    if a.processes and a.one is None:
        return _in_processes(a)
    loaded: dict[str, object] = {}  # the peer's model, loaded on its first run (a child running ours never loads it)

    def peer() -> None:
        if "model" not in loaded:
            loaded["model"] = og.Model(str(a.peer_dir))
        model = loaded["model"]
        p = og.GeneratorParams(model)
        p.set_search_options(do_sample=False, max_length=len(prompt) + a.tokens)
        g = og.Generator(model, p)
        g.append_tokens(prompt)
        while not g.is_done():
            g.generate_next_token()

    def ours(rt):
        return lambda: rt.generate(prompt_ids=prompt, max_new_tokens=a.tokens, use_draft=False, stop_on_eos=False)

    if a.one is not None:  # a child of --processes: one decoder, its median ms/token on stdout
        if a.one == "peer":
            run = peer
        else:
            path, spin = a.one.split("|")
            run = ours(EagleRuntime.open(path, threads=a.threads, guard=False, spin=spin))
        run()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / a.tokens)
        print(statistics.median(times))
        return 0
    runs = {f"{p} (spin {s})": ours(EagleRuntime.open(p, threads=a.threads, guard=False, spin=s))
            for p in a.artifacts for s in a.spin.split(";")}
    runs["onnxruntime-genai"] = peer
    for f in runs.values():
        f()  # warm
    names = list(runs)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            runs[k]()
            wall[k].append((time.perf_counter() - t0) / a.tokens)
            cpu[k].append((time.process_time() - c0) / a.tokens)
            time.sleep(0.05)
    ref = statistics.median(wall["onnxruntime-genai"])
    for k in names:
        w, c = statistics.median(wall[k]), statistics.median(cpu[k])
        print(f"{k}: {w * 1e3:.1f} ms/token wall ({w / ref:.2f}x the peer), {c * 1e3:.1f} ms CPU")
    return 0


def _in_processes(a: argparse.Namespace) -> int:
    """--processes: every decoder in a child process of its own, per round, the order rotated every round."""
    decoders = {f"{p} (spin {s})": f"{p}|{s}" for p in a.artifacts for s in a.spin.split(";")}
    decoders["onnxruntime-genai"] = "peer"
    names = list(decoders)
    got: dict[str, list[float]] = {k: [] for k in names}
    base = [sys.executable, __file__, *map(str, a.artifacts), "--peer-dir", str(a.peer_dir), "--tokens",
            str(a.tokens), "--threads", str(a.threads)]
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out = subprocess.run([*base, "--one", decoders[k]], capture_output=True, text=True, check=True)
            got[k].append(float(out.stdout.strip().splitlines()[-1]))
    ref = statistics.median(got["onnxruntime-genai"])
    for k in names:
        w = statistics.median(got[k])
        print(f"{k}: {w * 1e3:.1f} ms/token wall ({w / ref:.2f}x the peer), alone in its process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ORT GenAI peer of `bench --peer ort-genai`: the decoder a CPU user would otherwise pick, on our ONNX Runtime.

    peer = OrtGenaiPeer.prepare(target_dir, precision="fp32", cache=artifact / "peers", threads=2)
    peer.set_eos(None)                # ignore EOS: an id the model never generates (see choose_unused_id)
    run = peer.generate(prompt_ids, 64)

It builds the artifact's target with onnxruntime-genai's own model builder (``python -m
onnxruntime_genai.models.builder``, run offline in a subprocess, so its memory never stays in the bench's process),
caches the built model under a key of the target's files, the precision and the package version, and edits the
built model's ``genai_config.json`` for the run: ``intra_op_num_threads`` (our thread count) and ``eos_token_id``.
docs/bench.md says how it is measured; ../shared/docs/peers.md how the peer was first tried.

The parts that need no peer (precision choice, the unused id, the token comparison) are plain functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle_export.errors import EagleExportError

PEERS = ("ort-genai",)
PRECISIONS = ("fp32", "int4")
INSTALL_HINT = "pip install 'eagle-export[peers]' (onnxruntime-genai and onnx-ir)"


class PeerError(EagleExportError):
    """The peer cannot run: not installed, no target to build from, its builder failed, or a run came up short."""


# ---- pure parts ----------------------------------------------------------------------------------


def artifact_precision(manifest_raw: dict) -> str:
    """The peer precision that matches an artifact: "int4" when its manifest's quantization record
    (``eagle_export.manifest.QuantizationInfo``, written by `export --quantize int4`) says its target has 4 bits,
    else "fp32" (fp32, fp16 and int8 artifacts, and float targets with a quantized draft, compare with ORT GenAI's
    fp32 build)."""
    from eagle_export.manifest import QUANTIZATION_KEY

    q = manifest_raw.get(QUANTIZATION_KEY)
    return "int4" if isinstance(q, dict) and q.get("bits") == 4 and q.get("target", True) else "fp32"


def choose_precision(manifest_raw: dict, override: str | None) -> str:
    """``--peer-precision`` when given (fp32 or int4), else the artifact's (``artifact_precision``)."""
    if override is None:
        return artifact_precision(manifest_raw)
    if override not in PRECISIONS:
        raise PeerError(f"--peer-precision must be one of {', '.join(PRECISIONS)}, got {override!r}")
    return override


def choose_unused_id(vocab_size: int, generated: set[int], avoid: set[int] = frozenset()) -> int:
    """The largest id in [0, vocab_size) that is neither in ``generated`` nor in ``avoid``: the EOS id given to the
    peer so that it never stops early when EOS is ignored (its config needs an id inside the vocabulary)."""
    for i in range(vocab_size - 1, -1, -1):
        if i not in generated and i not in avoid:
            return i
    raise PeerError("every id of the vocabulary was generated: no id is left to stand for a never-generated EOS")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts at the shorter one's end), or None
    when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cache_key(target_dir: Path, precision: str, version: str) -> str:
    """A key of what the built model depends on: the target's files (names, sizes, modification times), the precision
    and the onnxruntime-genai version. Content hashes of multi-GB weights would cost more than a build."""
    h = hashlib.sha256(f"{precision}|{version}".encode())
    for p in sorted(target_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: a tokenizer transformers loads


def resolve_target(manifest_source: str | None, peer_target: str | Path | None) -> Path:
    """The Hugging Face folder to build the peer from: ``--peer-target`` when given, else the target the artifact was
    exported from (``manifest.target.source``). It must be a folder with a config.json: the build is offline."""
    given = peer_target is not None
    d = Path(peer_target if given else (manifest_source or ""))
    if not (d / "config.json").is_file():
        where = "--peer-target" if given else "the artifact's target source (manifest target.source)"
        raise PeerError(f"{where} {str(d) or '(none)'} is not a Hugging Face model folder with a config.json: "
                        "give the target's folder with --peer-target DIR (the peer is built offline from it)")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        # Its builder loads the tokenizer to save it with the model, and fails deep in transformers without one.
        raise PeerError(f"{d} has no tokenizer ({', '.join(TOKENIZER_FILES)}): onnxruntime-genai's builder needs the "
                        "target's tokenizer; copy its tokenizer files there or give a folder with them as "
                        "--peer-target DIR")
    return d.resolve()


# ---- the peer --------------------------------------------------------------------------------------


def import_genai():
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise PeerError(f"--peer ort-genai needs onnxruntime-genai, which is not installed: {INSTALL_HINT}") from None
    return og


@dataclass
class PeerRun:
    tokens: list[int]
    seconds: float  # from creating the generator (its cache) through the last token: prefill included
    # Set when it stopped at an EOS before the length: ORT GenAI generated one of these ids but does not return it.
    stopped_at: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Tokens it generated: the returned ones, and the EOS it stopped at."""
        return len(self.tokens) + (1 if self.stopped_at else 0)

    @property
    def tok_s(self) -> float:
        return self.count / max(self.seconds, 1e-12)

    def as_ours(self, ours: list[int]) -> list[int]:
        """Its tokens the way our runtime reports them (EOS included): the EOS it stopped at is the one our tokens
        hold at that place, when it is one of the ids it was given."""
        if self.stopped_at and len(ours) == len(self.tokens) + 1 and ours[-1] in self.stopped_at:
            return [*self.tokens, ours[-1]]
        return list(self.tokens)


def build(target_dir: Path, precision: str, cache: Path, log=None) -> tuple[Path, float | None]:
    """Build (or reuse) ORT GenAI's model of TARGET_DIR at PRECISION under CACHE. Returns (model folder, build
    seconds, None when it came from the cache)."""
    og = import_genai()
    out = cache / f"ort-genai-{precision}-{cache_key(target_dir, precision, og.__version__)}"
    if (out / "genai_config.json").is_file():
        return out, None
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{out.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target_dir), "-o", str(tmp / "model"),
           "-p", precision, "-e", "cpu", "-c", str(tmp / "hf-cache")]
    if log:
        log(f"building the ORT GenAI {precision} model of {target_dir} (its builder, offline)")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not (tmp / "model" / "genai_config.json").is_file():
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        shutil.rmtree(tmp, ignore_errors=True)
        raise PeerError(f"onnxruntime-genai's builder failed on {target_dir} ({precision}): {tail}")
    seconds = time.perf_counter() - t0
    os.replace(tmp / "model", out)  # complete models only: a killed build leaves no cache entry
    shutil.rmtree(tmp, ignore_errors=True)
    return out, seconds


class OrtGenaiPeer:
    """An opened ORT GenAI model: greedy generation of a prompt's ids, EOS as set by ``set_eos``."""

    name = "ort-genai"

    def __init__(self, model_dir: Path, precision: str, threads: int | None, build_s: float | None):
        self.model_dir, self.precision, self.threads, self.build_s = model_dir, precision, threads, build_s
        self._og = import_genai()
        self._model = None
        self.eos: list[int] = []

    @classmethod
    def prepare(cls, target_dir: Path, *, precision: str, cache: Path, threads: int | None,
                log=None) -> OrtGenaiPeer:
        model_dir, build_s = build(target_dir, precision, cache, log)
        return cls(model_dir, precision, threads, build_s)

    @property
    def version(self) -> str:
        return self._og.__version__

    def set_eos(self, eos_ids: list[int]) -> None:
        """Write the run's settings into genai_config.json and (re)open the model: EOS ids (the artifact's for
        --stop-at-eos, else one never-generated id) and intra_op_num_threads (ours; ORT GenAI's default otherwise)."""
        self.write_config(eos_ids)
        self._model = self._og.Model(str(self.model_dir))

    def write_config(self, eos_ids: list[int]) -> None:
        """``set_eos``'s edit of genai_config.json, without opening the model."""
        path = self.model_dir / "genai_config.json"
        cfg = json.loads(path.read_text())
        m = cfg["model"]
        m["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
        opts = m["decoder"].setdefault("session_options", {})
        if self.threads:
            opts["intra_op_num_threads"] = self.threads
        else:
            opts.pop("intra_op_num_threads", None)
        path.write_text(json.dumps(cfg, indent=4))
        self.eos = list(eos_ids)

    def generate(self, ids: list[int], max_new: int) -> PeerRun:
        tokens, seconds = _greedy(self._og, self._model, ids, max_new)
        return PeerRun(tokens, seconds, tuple(self.eos) if len(tokens) < max_new else ())

    def close(self) -> None:
        self._model = None


def _greedy(og, model, ids: list[int], max_new: int) -> tuple[list[int], float]:
    """The peer's own loop: greedy generation of up to max_new tokens after ``ids``, timed from the generator's
    creation (prefill included) to its last token."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + max_new)
    t0 = time.perf_counter()
    gen = og.Generator(model, params)
    gen.append_tokens(ids)  # the prefill
    while not gen.is_done():
        gen.generate_next_token()
    seconds = time.perf_counter() - t0
    return [int(t) for t in gen.get_sequence(0)[len(ids):]], seconds


class ChildPeer:
    """The peer in a process of its own (``python -m`` this module), driven over its stdin and stdout, one JSON line
    each way: ``bench`` runs it there. In one process with our runtime the peer lost speed to the shared process (at
    the 1B shape 8.4 tok/s against 13.9-14.8 alone; on the fixture within the machine's run-to-run spread), which
    flattered our ratios. Same interface as the peer it wraps; the child times each generation itself, so the
    pipe's cost is outside the figure."""

    def __init__(self, inner: OrtGenaiPeer):
        self.inner = inner
        self.name, self.precision, self.threads = inner.name, inner.precision, inner.threads
        self.build_s, self.model_dir = inner.build_s, inner.model_dir
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(inner.model_dir)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    @property
    def version(self) -> str:
        return self.inner.version

    @property
    def eos(self) -> list[int]:
        return self.inner.eos

    def _ask(self, *msg):
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except OSError as e:
            line, err = "", e
        else:
            err = None
        if not line:
            raise PeerError(f"the {self.name} peer's process ended unexpectedly (exit code {self._proc.poll()}; its "
                            "messages are above)") from err
        ok, value = json.loads(line)
        if not ok:
            raise PeerError(f"{self.name} failed in its process: {value}")
        return value

    def set_eos(self, eos_ids: list[int]) -> None:
        self.inner.write_config(eos_ids)
        self._ask("open")

    def generate(self, ids: list[int], max_new: int) -> PeerRun:
        tokens, seconds = self._ask("generate", [int(i) for i in ids], max_new)
        return PeerRun(tokens, seconds, tuple(self.eos) if len(tokens) < max_new else ())

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # the child's read ends: it exits
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _serve(model_dir: str) -> None:
    """The child of ``ChildPeer``: opens the model when asked (after the parent wrote its config) and generates.
    Replies go to the stdout it started with; anything the libraries print goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    og = import_genai()
    model = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg[0] == "open":
                model = None
                model = og.Model(model_dir)
                reply = [True, None]
            else:
                reply = [True, list(_greedy(og, model, msg[1], msg[2]))]
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it as a PeerError
            reply = [False, f"{type(e).__name__}: {e}"]
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])

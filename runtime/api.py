"""The embedding API: open an artifact directory once, generate many times, stream committed tokens.

    from eagle_export.runtime import EagleRuntime
    rt = EagleRuntime.open("artifacts/tiny")
    print(rt.generate("Hello", max_new_tokens=32).text)
    rt.generate(messages=[{"role": "user", "content": "Hello"}])   # through the tokenizer's chat template
    stream = rt.stream(prompt_ids=[1, 2, 3], max_new_tokens=32)
    for tokens in stream:          # lists of token ids, as each round commits them
        ...
    print(stream.result.stats.tau)

One runtime object owns one set of preallocated buffers, so generations on it run one at a
time: concurrent calls from several threads are serialised by a lock (open one runtime per
thread to run them in parallel).

Opened with ``max_batch=B`` (B > 1, at most the artifact's ``export --max-batch``), one runtime serves up to B
sequences at once on one set of weights: ``submit(...)`` (thread-safe) returns a ``RequestStream`` per request,
one scheduler thread runs batched rounds (runtime/generator.py), and ``stream``/``generate`` go through it too.

    rt = EagleRuntime.open("artifacts/tiny", max_batch=4)
    streams = [rt.submit(prompt_ids=p, max_new_tokens=32) for p in prompts]
    results = [s.wait() for s in streams]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from eagle_export.errors import GenerationError, ManifestError
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.tree_params import TreeParams

from .backend import Backend
from .chat import chat_prompt_ids
from .embedding import TokenEmbedding
from .generator import GenerationResult, Generator
from .sampling import SamplingParams
from .scheduler import RequestStream, Scheduler

log = logging.getLogger(__name__)
BACKENDS = ("ort", "tensorrt")


def _load_tokenizer(directory: Path):
    """The artifact's tokenizer; missing or unreadable files are a ManifestError, not a transformers traceback."""
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise ManifestError(
            f"{directory}: the manifest lists a tokenizer but tokenizer.json / tokenizer.model is missing: copy the "
            "target's tokenizer files back into the artifact, or re-export"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many types; name the directory and its message
        raise ManifestError(f"{directory}: could not load the tokenizer ({type(e).__name__}: {e}): re-export") from e


class _OwnedLock:
    """A lock that knows its holder, so a thread that re-enters (a stream left open) gets an error, not a hang."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self):
        if self._owner == threading.get_ident():
            raise GenerationError(
                "this thread already has a generation open on this runtime (an unfinished stream): "
                "finish or close it first, or open a second runtime"
            )
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self._owner = None
        self._lock.release()


class GenerationStream:
    """Iterate once to receive token lists as they are committed; ``result`` is set when iteration ends."""

    def __init__(self, runtime: EagleRuntime, gen, lock: _OwnedLock):
        self._rt, self._gen, self._lock = runtime, gen, lock
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            raise GenerationError("a GenerationStream can be iterated only once")
        self._started = True
        return self._iterate()

    def _iterate(self) -> Iterator[list[int]]:
        with self._lock:
            try:
                while True:
                    yield next(self._gen)
            except StopIteration as stop:
                self.result = stop.value
                self.result.text = self._rt.decode(self.result.tokens)
            finally:
                self._gen.close()


class EagleRuntime:
    def __init__(self, directory: Path, manifest: Manifest, backend: Backend, tokenizer=None,
                 prefill_chunk: int = 256, max_batch: int = 1):
        self.directory = directory
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self._scheduler: Scheduler | None = None
        self._sched_lock = threading.Lock()
        # One set of buffers for max_batch sequences. With max_batch 1, stream/generate run a sequence on it in
        # the caller's thread, under the lock; submit's scheduler thread takes the same lock while it has work.
        self.generator = Generator(manifest, backend, TokenEmbedding.open(directory, manifest), prefill_chunk,
                                   slots=max_batch)
        self._lock = _OwnedLock()
        self.open_s: float | None = None  # set by open(): seconds it took

    @property
    def scheduler(self) -> Scheduler:
        """The batched scheduler (its generator's buffers, rounds and padding figures); made on first use."""
        return self._batched()

    def _batched(self) -> Scheduler:
        """The scheduler of this runtime's generator, made on first use (its thread starts at the first submit)."""
        with self._sched_lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self.generator, self._lock if self.max_batch == 1 else None)
            return self._scheduler

    @classmethod
    def open(cls, directory: str | Path, backend: str = "ort", providers: list[str] | None = None,
             threads: int | None = None, prefill_chunk: int = 256, max_batch: int = 1,
             fused: bool = True, spin: str | None = None) -> EagleRuntime:
        """Check the manifest, load the graphs on the backend and allocate every buffer once.

        backend: "ort" (ONNX Runtime on the ONNX graphs) or "tensorrt" (the engines of `eagle-export build`,
        on a CUDA GPU). threads: intra-op threads per graph (ort; None: its default); prefill_chunk: prompt
        tokens per prefill forward (bounds the prefill's scratch memory; tensorrt caps it at --max-prefill).
        max_batch: sequences decoded at once (1: one at a time, as before; B > 1: continuous batching through
        ``submit``, at most the artifact's ``export --max-batch``). fused: on ONNX Runtime, run the fused target
        graph where the artifact has one (the default; False runs the standard graph, e.g. to compare the two). spin:
        ONNX Runtime's thread spin policy, "off", "run" or "on" (None: the backend's default, "run"; docs/runtime.md).
        """
        t0 = time.perf_counter()
        directory = Path(directory)
        manifest = load_manifest(directory)
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= manifest.max_batch:
            raise GenerationError(f"max_batch must be an integer in [1, {manifest.max_batch}] (the artifact's batch "
                                  f"range, `export --max-batch`), got {max_batch!r}")
        if backend == "ort":
            from .ort_backend import DEFAULT_SPIN, OrtBackend

            be = OrtBackend(directory, manifest, providers, threads, fused=fused, spin=spin or DEFAULT_SPIN)
        elif backend == "tensorrt":
            from .trt_backend import TrtBackend

            be = TrtBackend(directory, manifest)
        else:
            raise GenerationError(f"backend {backend!r} is not one of: {', '.join(BACKENDS)}")
        if be.max_prefill is not None:  # prefill chunks must fit the engines' prefill profile
            prefill_chunk = min(prefill_chunk, be.max_prefill)
        if backend == "tensorrt" and manifest.engines is not None:
            built = int(manifest.engines.options.get("max_batch") or 1)
            if max_batch > built:
                raise GenerationError(f"max_batch {max_batch} is above the engines' --max-batch {built}: rebuild "
                                      f"with `eagle-export build {directory} --max-batch {max_batch}`")
        tokenizer = _load_tokenizer(directory) if manifest.has_tokenizer else None
        rt = cls(directory, manifest, be, tokenizer, prefill_chunk, max_batch)
        rt.open_s = time.perf_counter() - t0  # load time: graphs on the backend, buffers, tokenizer
        log.info("opened %s in %.1f s", directory, rt.open_s)
        return rt

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError(
                f"{self.directory} has no tokenizer (the target had none at export): pass token ids instead"
            )
        if not text:
            raise GenerationError("the prompt is empty: give at least one token")
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return list(ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a conversation under the tokenizer's chat template, ending with the generation prompt."""
        return chat_prompt_ids(self.tokenizer, messages, str(self.directory))

    def decode(self, tokens: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- generation --------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_new_tokens: int = 64,
               tree: TreeParams | None = None, use_draft: bool = True, stop_on_eos: bool = True,
               sampling: SamplingParams | None = None, on_round=None) -> GenerationStream:
        """The prompt is one of: ``prompt`` (text, encoded with the tokenizer's special tokens), ``prompt_ids``,
        or ``messages`` (a list of ``{"role", "content"}``, through the tokenizer's chat template with the
        generation prompt appended).
        sampling: None (or temperature 0) = greedy; otherwise sample with these settings, from a
        random source of this request's own, seeded with ``sampling.seed``.
        on_round: optional per-round trace hook (see ``Generator.run``)."""
        if self.max_batch > 1:
            if on_round is not None:
                raise GenerationError("on_round traces a single sequence: open the runtime with max_batch=1")
            return self.submit(prompt, prompt_ids=prompt_ids, messages=messages, max_new_tokens=max_new_tokens,
                               tree=tree, use_draft=use_draft, stop_on_eos=stop_on_eos, sampling=sampling)
        ids = self._resolve_prompt(prompt, prompt_ids, messages)
        gen = self.generator.run(ids, max_new_tokens, tree=tree, use_draft=use_draft, stop_on_eos=stop_on_eos,
                                 sampling=sampling, on_round=on_round)
        return GenerationStream(self, gen, self._lock)

    def _resolve_prompt(self, prompt, prompt_ids, messages):
        if sum(x is not None for x in (prompt, prompt_ids, messages)) != 1:
            raise GenerationError("give exactly one of prompt (text), prompt_ids or messages")
        if prompt is not None and not isinstance(prompt, str):
            raise GenerationError(f"prompt must be text, got a {type(prompt).__name__}: pass token ids as "
                                  "prompt_ids=[...] and a conversation as messages=[...]")
        if messages is not None:
            return self.encode_chat(messages)
        return self.encode(prompt) if prompt is not None else prompt_ids

    def submit(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_new_tokens: int = 64, tree: TreeParams | None = None,
               use_draft: bool = True, stop_on_eos: bool = True,
               sampling: SamplingParams | None = None) -> RequestStream:
        """Queue one generation for the batched scheduler (thread-safe) and return its stream at once.

        Arguments as ``stream``. The request joins the running batch at the next round boundary, when a slot is
        free. Its errors (a bad prompt, bad settings) fail this stream alone: they are raised when it is iterated
        or waited on. With max_batch 1 the scheduler serves one sequence at a time."""
        def make():
            ids = self._resolve_prompt(prompt, prompt_ids, messages)
            return sched.gen.check(ids, max_new_tokens, tree, use_draft, stop_on_eos, sampling)

        sched = self._batched()
        return sched.submit(make, RequestStream(self.decode))

    def close(self) -> None:
        """Stop the scheduler thread (after the requests already submitted); a no-op without one."""
        if self._scheduler is not None:
            self._scheduler.close()

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

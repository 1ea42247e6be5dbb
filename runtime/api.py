"""The embedding API: open an artifact directory once, generate many times, stream committed tokens and text.

    from eagle_export.runtime import EagleRuntime
    with EagleRuntime.open("demo/eagle1") as rt:          # closed (buffers and graphs released) at the end
        print(rt.generate("def f():", max_new_tokens=32).text)
        stream = rt.stream(prompt_ids=[1, 2, 3], max_new_tokens=32)
        for chunk in stream.chunks():                      # StreamChunk(tokens, text) as each round commits
            print(chunk.text, end="")
        print(stream.result.stats.tau)                     # result: None until the stream ends

One runtime object owns one set of preallocated buffers, so generations on it run one at a time: concurrent calls
from several threads are serialised by a lock (open one runtime per thread to run them in parallel).

Opened with ``max_batch=B`` (B > 1, at most the artifact's ``export --max-batch``), one runtime serves up to B
sequences at once on one set of weights: ``submit(...)`` (thread-safe) returns a ``RequestStream`` per request,
one scheduler thread runs batched rounds (runtime/generator.py), and ``stream``/``generate`` go through it too.
A ``RequestStream`` can also be consumed with ``async for`` (see scheduler.py).

    rt = EagleRuntime.open("demo/eagle1", max_batch=4)
    streams = [rt.submit(prompt_ids=p, max_new_tokens=32) for p in prompts]
    results = [s.wait() for s in streams]

docs/runtime.md ("Python API") has a complete example for each use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle_export.errors import GenerationError, ManifestError
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.tree_params import TreeParams

from . import stream_text
from .backend import Backend
from .chat import chat_prompt_ids
from .embedding import TokenEmbedding
from .generator import Generator
from .guard import DEFAULT_POLICY, GuardPolicy
from .logprobs import check_top
from .results import GenerationResult
from .sampling import SamplingParams
from .scheduler import RequestStream, Scheduler
from .stream_text import StreamChunk

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
    """One generation, consumed once: ``for tokens in stream`` gives the token ids each round commits,
    ``for chunk in stream.chunks()`` gives ``StreamChunk(tokens, text)`` (the text those tokens add, a character
    split across tokens held back until it completes; text None without a tokenizer).

    ``result`` is None until the iteration ends, then the ``GenerationResult`` (tokens, text, finish reason,
    stats). The generation runs in the iterating thread, holding the runtime's lock until the iteration ends."""

    def __init__(self, runtime: EagleRuntime, gen, lock: _OwnedLock):
        self._rt, self._gen, self._lock = runtime, gen, lock
        self._started = False
        #: None until the iteration ends, then the GenerationResult.
        self.result: GenerationResult | None = None

    def chunks(self) -> Iterator[StreamChunk]:
        """Iterate once: each round's ``StreamChunk(tokens, text)``."""
        return stream_text.chunks(self, self._rt._decode)

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
                self.result.text = self._rt._decode(self.result.tokens)
            finally:
                self._gen.close()


class EagleRuntime:
    def __init__(self, directory: Path, manifest: Manifest, backend: Backend, tokenizer=None,
                 prefill_chunk: int = 256, max_batch: int = 1, guard: GuardPolicy | None = DEFAULT_POLICY):
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
                                   slots=max_batch, guard=guard)
        self._lock = _OwnedLock()
        self._closed = False
        self.open_s: float | None = None  # set by open(): seconds it took

    def __enter__(self) -> EagleRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationError(f"this EagleRuntime ({self.directory}) is closed: open a new one with "
                                  "EagleRuntime.open(...)")

    @property
    def scheduler(self) -> Scheduler:
        """The batched scheduler (its generator's buffers, rounds and padding figures); made on first use."""
        return self._batched()

    def _batched(self) -> Scheduler:
        """The scheduler of this runtime's generator, made on first use (its thread starts at the first submit)."""
        self._check_open()
        with self._sched_lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self.generator, self._lock if self.max_batch == 1 else None)
            return self._scheduler

    @classmethod
    def open(cls, directory: str | Path, backend: str = "ort", providers: list[str] | None = None,
             threads: int | None = None, prefill_chunk: int = 256, max_batch: int = 1,
             fused: bool = True, spin: str | None = None, draft_tree: bool = True,
             guard: bool | GuardPolicy = True) -> EagleRuntime:
        """Check the manifest, load the graphs on the backend and allocate every buffer once.

        backend: "ort" (ONNX Runtime on the ONNX graphs) or "tensorrt" (the engines of `eagle-export build`,
        on a CUDA GPU). threads: intra-op threads per graph (ort; None: its default); prefill_chunk: prompt
        tokens per prefill forward (bounds the prefill's scratch memory; tensorrt caps it at --max-prefill).
        max_batch: sequences decoded at once (1: one at a time, as before; B > 1: continuous batching through
        ``submit``, at most the artifact's ``export --max-batch``). fused: on ONNX Runtime, run the fused target
        graph where the artifact has one (the default; False runs the standard graph, e.g. to compare the two). spin:
        ONNX Runtime's thread spin policy, "off", "run" or "on", or one per phase, "target=run,draft=off" (None: the
        one `eagle-export tune` chose for the artifact on ONNX Runtime, else the backend's default; docs/runtime.md,
        Threading).
        draft_tree: on ONNX Runtime, draft with the draft tree graph where the artifact has one and the round's tree
        fits it (the default: one draft call a round; False drafts level by level with the step graph).
        guard: the speculation guard (docs/runtime.md, "The speculation guard"): True (the default) runs a drafting
        request's rounds plain while speculation loses against the plain steps this runtime measures, and probes back
        at growing intervals; False drafts every round; a ``GuardPolicy`` sets its thresholds. Lossless either way.
        """
        t0 = time.perf_counter()
        policy = guard_policy(guard)
        directory = Path(directory)
        manifest = load_manifest(directory)
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= manifest.max_batch:
            raise GenerationError(f"max_batch must be an integer in [1, {manifest.max_batch}] (the artifact's batch "
                                  f"range, `export --max-batch`), got {max_batch!r}")
        if backend == "ort":
            from .ort_backend import DEFAULT_SPIN, OrtBackend

            be = OrtBackend(directory, manifest, providers, threads, fused=fused,
                            spin=spin or tuned_spin(manifest) or DEFAULT_SPIN, draft_tree=draft_tree)
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
        rt = cls(directory, manifest, be, tokenizer, prefill_chunk, max_batch, guard=policy)
        rt.open_s = time.perf_counter() - t0  # load time: graphs on the backend, buffers, tokenizer
        log.info("opened %s in %.1f s", directory, rt.open_s)
        return rt

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Prompt ids of ``text`` (with the tokenizer's special tokens, as ``generate(prompt)`` encodes it)."""
        self._check_open()
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
        self._check_open()
        return chat_prompt_ids(self.tokenizer, messages, str(self.directory))

    def decode(self, tokens: list[int]) -> str | None:
        """Text of ``tokens`` (special tokens skipped), or None when the artifact has no tokenizer."""
        self._check_open()
        return self._decode(tokens)

    def _decode(self, tokens: list[int]) -> str | None:  # streams finishing after close() still decode
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- generation --------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               messages: list[dict[str, Any]] | None = None, max_new_tokens: int = 64,
               tree: TreeParams | None = None, use_draft: bool = True, stop_on_eos: bool = True,
               sampling: SamplingParams | None = None,
               on_round: Callable[[Any, Any], None] | None = None) -> GenerationStream | RequestStream:
        """Start one generation and return its stream (see ``generate`` for the arguments); iterate it once.

        With ``max_batch`` 1 the generation runs in the iterating thread (a ``GenerationStream``); with more, it is
        ``submit``'s ``RequestStream``. Both give token lists when iterated, ``StreamChunk``s from ``chunks()``, and
        ``result`` once they end."""
        self._check_open()
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

    def submit(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
               messages: list[dict[str, Any]] | None = None, max_new_tokens: int = 64, tree: TreeParams | None = None,
               use_draft: bool = True, stop_on_eos: bool = True,
               sampling: SamplingParams | None = None, logprobs: int | None = None) -> RequestStream:
        """Queue one generation for the batched scheduler (thread-safe) and return its stream at once.

        Arguments as ``generate`` (no ``on_round``). The request joins the running batch at the next round
        boundary, when a slot is free. Its errors (a bad prompt, bad settings) fail this stream alone: they are
        raised when it is iterated or waited on. With max_batch 1 the scheduler serves one sequence at a time.
        Consume the stream with ``for``, ``chunks()``, ``wait()``, or in asyncio with ``async for``, ``achunks()``,
        ``await stream.aresult()``.

        logprobs: None (no cost), or N in [0, 20]: ``stream.logprobs`` gets each committed token's log-probability
        under the target's raw distribution (the verify step's logits, before temperature and top-p) and its N
        most likely alternatives (runtime/logprobs.py)."""
        def make():
            ids = self._resolve_prompt(prompt, prompt_ids, messages)
            req = sched.gen.check(ids, max_new_tokens, tree, use_draft, stop_on_eos, sampling)
            if logprobs is not None:
                req.logprobs = check_top(logprobs)
            return req

        sched = self._batched()
        return sched.submit(make, RequestStream(self._decode))

    def close(self) -> None:
        """Finish the requests already submitted, stop the scheduler thread and release the graphs and buffers.
        Every later call on this runtime raises a GenerationError saying it is closed; closing twice is a no-op.
        ``with EagleRuntime.open(...) as rt:`` closes it at the end of the block."""
        if self._closed:
            return
        with self._sched_lock:
            sched = self._scheduler
        if sched is not None:
            sched.close()
        self._closed = True
        self._scheduler = None
        self.generator = None  # the buffers and graph sessions go with the last reference (a stream may hold one)
        self.backend = None

    def generate(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                 messages: list[dict[str, Any]] | None = None, max_new_tokens: int = 64,
                 tree: TreeParams | None = None, use_draft: bool = True, stop_on_eos: bool = True,
                 sampling: SamplingParams | None = None,
                 on_round: Callable[[Any, Any], None] | None = None) -> GenerationResult:
        """Generate from one prompt and return the ``GenerationResult`` (``tokens``, ``text``, ``finish_reason``,
        ``prompt_len``, ``stats`` with ``tau``).

        The prompt is exactly one of:
          prompt: text, encoded with the tokenizer's special tokens (needs the artifact's tokenizer);
          prompt_ids: token ids;
          messages: a conversation ``[{"role": "user", "content": "..."}, ...]``, rendered with the tokenizer's
            chat template with the generation prompt appended (needs a tokenizer that has one).
        max_new_tokens: most tokens to generate (the artifact's capacity may end it sooner: finish "capacity").
        tree: the draft tree (``TreeParams(top_k, depth, total_tokens, threshold)``); None: the artifact's default
          decoding: its ``tree_defaults``, or each round's tree from its per-batch table (manifest ``batch_trees``)
          where it has one, which may say no draft (``eagle-export tune`` writes that where no tree paid).
        use_draft: False for plain autoregressive decoding on the same target graph.
        stop_on_eos: False to keep generating past end-of-sequence tokens.
        sampling: None (or temperature 0) for greedy; else ``SamplingParams(temperature, top_p, top_k, seed)``,
          sampled from a random source of this request's own (same seed, same tokens).
        on_round: called as ``on_round(verify_tree, accepted)`` after every round, for tracing (max_batch 1 only).

        Errors in what you pass are a GenerationError (an EagleExportError) with a one-line message."""
        stream = self.stream(prompt, prompt_ids=prompt_ids, messages=messages, max_new_tokens=max_new_tokens,
                             tree=tree, use_draft=use_draft, stop_on_eos=stop_on_eos, sampling=sampling,
                             on_round=on_round)
        if isinstance(stream, RequestStream):
            return stream.wait()
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result


def guard_policy(guard: bool | GuardPolicy) -> GuardPolicy | None:
    """``open``'s guard argument as the generator's policy (None: off); anything else is a GenerationError."""
    if isinstance(guard, GuardPolicy):
        return guard.validate()
    if guard is True:
        return DEFAULT_POLICY
    if guard is False:
        return None
    raise GenerationError(f"guard must be True, False or a GuardPolicy, got {guard!r}")


def tuned_spin(manifest) -> str | None:
    """The spin policy `eagle-export tune` measured fastest for this artifact on ONNX Runtime (None: not tuned so)."""
    t = manifest.tuned
    return t.spin if t is not None and t.backend == "ort" else None

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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from eagle_export.errors import GenerationError, ManifestError
from eagle_export.manifest import Manifest, load_manifest
from eagle_export.tree_params import TreeParams

from .backend import Backend
from .chat import chat_prompt_ids
from .generator import GenerationResult, Generator
from .sampling import SamplingParams

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
                 prefill_chunk: int = 256):
        self.directory = directory
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.generator = Generator(manifest, backend, prefill_chunk)
        self._lock = _OwnedLock()

    @classmethod
    def open(cls, directory: str | Path, backend: str = "ort", providers: list[str] | None = None,
             threads: int | None = None, prefill_chunk: int = 256) -> EagleRuntime:
        """Check the manifest, load the graphs on the backend and allocate every buffer once.

        backend: "ort" (ONNX Runtime on the ONNX graphs) or "tensorrt" (the engines of `eagle-export build`,
        on a CUDA GPU). threads: intra-op threads per graph (ort; None: its default); prefill_chunk: prompt
        tokens per prefill forward (bounds the prefill's scratch memory; tensorrt caps it at --max-prefill).
        """
        directory = Path(directory)
        manifest = load_manifest(directory)
        if backend == "ort":
            from .ort_backend import OrtBackend

            be = OrtBackend(directory, manifest, providers, threads)
        elif backend == "tensorrt":
            from .trt_backend import TrtBackend

            be = TrtBackend(directory, manifest)
        else:
            raise GenerationError(f"backend {backend!r} is not one of: {', '.join(BACKENDS)}")
        if be.max_prefill is not None:  # prefill chunks must fit the engines' prefill profile
            prefill_chunk = min(prefill_chunk, be.max_prefill)
        tokenizer = _load_tokenizer(directory) if manifest.has_tokenizer else None
        return cls(directory, manifest, be, tokenizer, prefill_chunk)

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
        if sum(x is not None for x in (prompt, prompt_ids, messages)) != 1:
            raise GenerationError("give exactly one of prompt (text), prompt_ids or messages")
        if prompt is not None and not isinstance(prompt, str):
            raise GenerationError(f"prompt must be text, got a {type(prompt).__name__}: pass token ids as "
                                  "prompt_ids=[...] and a conversation as messages=[...]")
        if messages is not None:
            ids = self.encode_chat(messages)
        else:
            ids = self.encode(prompt) if prompt is not None else prompt_ids
        gen = self.generator.run(ids, max_new_tokens, tree=tree, use_draft=use_draft, stop_on_eos=stop_on_eos,
                                 sampling=sampling, on_round=on_round)
        return GenerationStream(self, gen, self._lock)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

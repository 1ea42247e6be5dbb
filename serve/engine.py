"""The server's side of the batched runtime: admission (a bounded queue), one job per HTTP request, and the bridge
from the runtime's blocking ``RequestStream`` to asyncio.

Each accepted choice is one ``EagleRuntime.submit``; a small daemon thread iterates its stream and hands every
committed round to the event loop, so the loop never blocks on the runtime. At most ``max_batch + max_queue``
choices are in flight; past that a request is refused at once (``QueueFull``, HTTP 429) instead of piling up.
Cancelling a job (client gone, timeout, stop string) cancels its streams: the scheduler frees their slots at the
next round boundary.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export.errors import GenerationError
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.sampling import SamplingParams
from eagle_export.tree_params import TreeParams, tree_over_defaults

from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot and every queue place is taken: answer 429 now."""


class RequestTimeout(Exception):
    """The request ran past the server's per-request timeout."""


@dataclass
class ServeOptions:
    """Everything ``eagle-export serve`` takes besides host and port (also what a Ray replica is built from)."""

    artifact: str
    backend: str = "ort"
    max_batch: int | None = None  # None: the artifact's export --max-batch
    max_queue: int = 64
    timeout_s: float = 300.0
    max_prompt_tokens: int | None = None  # None: the capacity minus one (room for one generated token)
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    model_name: str | None = None  # None: the artifact directory's name
    threads: int | None = None
    drain_timeout_s: float | None = None  # on shutdown, how long accepted requests may run on (None: timeout_s)
    header_timeout_s: float = 10.0  # a request's head must arrive within this (408 and the connection closed)
    body_timeout_s: float = 30.0  # its body within this, from the end of its head (408)
    replica_header: bool = False  # name the replica (host:pid) in x-eagle-replica and /health
    replica_label: str | None = None  # a `replica` label on every metric (Ray Serve: the replica's id)
    guard: bool = True  # the speculation guard (docs/runtime.md); serve --no-guard drafts every round

    @property
    def drain_s(self) -> float:
        return self.timeout_s if self.drain_timeout_s is None else self.drain_timeout_s


@dataclass(eq=False)
class Job:
    """One HTTP request: its n streams and the asyncio queue their pump threads feed with (index, tokens|end)."""

    streams: list
    prompt_tokens: int
    queue: asyncio.Queue
    seeds: list[int | None]
    tree: TreeParams | None
    per_round: bool = True  # hand over every round (streams, stop strings); else only the end (fewer wake-ups)
    endpoint: str = "/v1/completions"  # the route (the latency histograms' label)
    t0: float = field(default_factory=time.perf_counter)  # arrival (perf_counter), for the latency histograms
    first_token_s: float | None = None  # seconds from t0 to the first token of any choice

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()


class ServeEngine:
    """One runtime (``max_batch`` slots) and the bookkeeping of a server in front of it."""

    def __init__(self, rt: EagleRuntime, opts: ServeOptions):
        self.rt = rt
        self.opts = opts
        m = rt.manifest
        self.model_name = opts.model_name or Path(opts.artifact).resolve().name
        self.capacity = m.max_seq_len
        self.max_prompt_tokens = min(opts.max_prompt_tokens or self.capacity - 1, self.capacity - 1)
        self.limit = rt.max_batch + max(opts.max_queue, 0)
        self.metrics = ServerMetrics(m.tree_limits.max_depth, opts.replica_label)
        self.replica = f"{os.uname().nodename}:{os.getpid()}"  # shown only with opts.replica_header
        self._lock = threading.Lock()
        self._in_flight = 0
        self._active = 0  # sequences in the last batched round
        self._token_texts: dict[int, str] = {}  # token_text's cache
        rt.scheduler.on_round = self._on_round

    @classmethod
    def open(cls, opts: ServeOptions) -> ServeEngine:
        from eagle_export.manifest import load_manifest

        max_batch = opts.max_batch if opts.max_batch is not None else load_manifest(opts.artifact).max_batch
        rt = EagleRuntime.open(opts.artifact, backend=opts.backend, threads=opts.threads, max_batch=max_batch,
                               guard=opts.guard)
        return cls(rt, opts)

    def close(self) -> None:
        self.rt.close()

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included), as log-probabilities name it; ``token_id:N`` without a
        tokenizer."""
        text = self._token_texts.get(token)
        if text is None:
            tok = self.rt.tokenizer
            text = tok.decode([token], skip_special_tokens=False) if tok is not None else f"token_id:{token}"
            if len(self._token_texts) < 1 << 16:
                self._token_texts[token] = text
        return text

    def public(self, message: str) -> str:
        """A runtime message fit for a client: the artifact's path on this server becomes the model's name."""
        given = [Path(self.opts.artifact), Path(str(getattr(self.rt, "directory", "") or self.opts.artifact))]
        # the resolved forms, and a given form only when it is a path (not a bare name that words could contain)
        paths = {str(p.resolve()) for p in given} | {str(p) for p in given if os.sep in str(p)}
        for path in sorted(paths, key=len, reverse=True):
            message = message.replace(path, self.model_name)
        return message

    # ---- prompts and settings -----------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt, ids, or a conversation; GenerationError if empty or over the cap."""
        if messages is not None:
            ids = self.rt.encode_chat(messages)
        elif isinstance(prompt, str):
            ids = self.rt.encode(prompt)
        else:
            ids = list(prompt or [])
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens; this server takes at most "
                                f"{self.max_prompt_tokens} (capacity {self.capacity} = prompt + generated tokens)")
        return ids

    def tree(self, top_k: int | None, depth: int | None, total_tokens: int | None,
             threshold: float | None = None) -> TreeParams | None:
        """The request's tree: its fields over tree_defaults; None when it gives none: the artifact's default
        decoding (tree_defaults, or each round's tree from its per-batch table, manifest batch_trees, which may say no
        draft)."""
        if (top_k, depth, total_tokens, threshold) == (None, None, None, None):
            return None
        t = tree_over_defaults(self.rt.manifest.tree_defaults, top_k, depth, total_tokens, threshold)
        return t.validate(self.rt.manifest.tree_limits)

    # ---- admission and submission -------------------------------------------------------------
    def submit(self, ids: list[int], *, n: int, max_new_tokens: int, tree: TreeParams | None, use_draft: bool,
               stop_on_eos: bool, temperature: float, top_p: float, seed: int | None, per_round: bool = True,
               endpoint: str = "/v1/completions", t0: float | None = None, logprobs: int | None = None) -> Job:
        """Admit n choices (or raise QueueFull), submit them, and start their pumps. A request the runtime refuses
        (capacity, ids, settings) raises its GenerationError here, before any response is sent. per_round: hand
        over every committed round (streaming, stop strings); False: only each choice's end, so the scheduler
        thread is not woken up for a consumer thread every round. logprobs: None, or N alternatives per token (each
        stream's ``logprobs`` then holds one entry per committed token)."""
        sampling = SamplingParams(float(temperature), float(top_p), 0, seed).validate()
        if sampling.is_greedy:
            samplings, seeds = [None] * n, [None] * n
        else:
            base = seed if seed is not None else secrets.randbelow(2**31)
            seeds = [base + i for i in range(n)]
            samplings = [sampling.with_seed(s) for s in seeds]
        if n > self.limit:
            raise GenerationError(f"n={n} is more choices than this server runs at once ({self.limit}: "
                                  f"{self.rt.max_batch} slots + a queue of {self.opts.max_queue})")
        with self._lock:
            if self._in_flight + n > self.limit:
                raise QueueFull(f"the server is at capacity ({self.limit} requests in flight: {self.rt.max_batch} "
                                f"batch slots + a queue of {self.opts.max_queue}); retry later")
            self._in_flight += n
        self._gauges()
        streams = []
        try:
            for sp in samplings:
                streams.append(self.rt.submit(prompt_ids=ids, max_new_tokens=max_new_tokens, tree=tree,
                                              use_draft=use_draft, stop_on_eos=stop_on_eos, sampling=sp,
                                              logprobs=logprobs))
            bad = next((s.error for s in streams if s.error is not None), None)
            if bad is not None:
                raise bad
        except BaseException:
            for s in streams:
                s.cancel()
            with self._lock:
                self._in_flight -= n
            self._gauges()
            raise
        shown = (tree or self.rt.manifest.default_tree(self.rt.max_batch)) if use_draft else None  # None: no draft
        job = Job(streams, len(ids), asyncio.Queue(), seeds, shown, per_round, endpoint,
                  t0 if t0 is not None else time.perf_counter())
        loop = asyncio.get_running_loop()
        for i, s in enumerate(streams):
            threading.Thread(target=self._pump, args=(s, i, job, loop), name=f"eagle-pump-{i}", daemon=True).start()
        return job

    def _pump(self, stream, index: int, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        """Thread: the stream's rounds (or, without ``per_round``, its tokens at the end) into the job's queue, then
        its end (a result or an exception)."""

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(job.queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        first = last = None
        try:
            if job.per_round:
                for tokens in stream:
                    last = time.perf_counter()
                    first = first or self._first_token(job, last)
                    self.metrics.generation_tokens.inc(len(tokens))
                    put((index, tokens))
                result = stream.result
            else:
                if next(iter(stream), None) is not None:  # one wake-up for the first token's time, then the end
                    first = self._first_token(job, time.perf_counter())
                result = stream.wait()
                last = time.perf_counter()
                self.metrics.generation_tokens.inc(len(result.tokens))
                put((index, list(result.tokens)))
            self.metrics.observe_result(job.prompt_tokens, result.stats, drafted=job.tree is not None)
            if first is not None and len(result.tokens) >= 2:
                self.metrics.tpot.labels(job.endpoint).observe((last - first) / (len(result.tokens) - 1))
            put((index, result))
        except BaseException as e:  # noqa: BLE001 - handed to the request's coroutine
            put((index, e))
        finally:
            with self._lock:
                self._in_flight -= 1
            self._gauges()

    def _first_token(self, job: Job, now: float) -> float:
        """A choice's first token at ``now``: the request's time to first token is its earliest choice's."""
        with self._lock:
            first = job.first_token_s is None
            if first:
                job.first_token_s = now - job.t0
        if first:
            self.metrics.ttft.labels(job.endpoint).observe(now - job.t0)
        return now

    def _on_round(self, seconds: float, active: int) -> None:
        self.metrics.observe_round(seconds, active)
        self._active = active
        self._gauges()

    def _gauges(self) -> None:
        with self._lock:
            self.metrics.in_flight.set(self._in_flight)
            self.metrics.queue_depth.set(max(self._in_flight - self._active, 0) if self._in_flight else 0)

    @property
    def in_flight(self) -> int:
        return self._in_flight


class PromptTooLong(GenerationError):
    """The prompt is over the server's prompt cap (``--max-prompt-tokens``, at most the capacity - 1)."""


"""Continuous batching: thread-safe ``submit`` returns a stream per request; one scheduler thread drives rounds.

Between rounds the scheduler admits waiting requests into free slots (each is prefilled, then joins the next
verify), runs one batched round over every active sequence, and hands each request's committed tokens to its
stream. Each round's tree for the requests without an explicit tree comes from the artifact's per-batch table
(manifest ``batch_trees``, written by ``eagle-export tune --batch-sizes``) at that round's number of active
sequences: a tree, or no draft (plain one-token rounds) where batched plain decoding was measured faster.
A request that fails (bad prompt ids, a sampling error on its own logits) fails its own stream only; a
failed graph call fails the requests that were in it, and the scheduler goes on with the next ones.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from eagle_export.errors import GenerationError

from . import stream_text
from .generator import KEEP, Generator
from .logprobs import TokenLogprob
from .results import GenerationResult
from .slots import Request
from .stream_text import StreamChunk

log = logging.getLogger(__name__)
_END = object()


class RequestStream:
    """One request's output, consumed once, in one of these ways:

    - ``for tokens in stream``: the token ids each round commits (lists of ints);
    - ``for chunk in stream.chunks()``: ``StreamChunk(tokens, text)``, the text those tokens add (a character split
      across tokens held back until it completes);
    - ``async for tokens in stream`` / ``async for chunk in stream.achunks()`` / ``await stream.aresult()``: the same
      in asyncio, without a thread (the scheduler thread hands each round to the event loop);
    - ``stream.wait()``: block until it ends and return the result.

    ``result`` is None until the request ends, then its ``GenerationResult`` (tokens, text, finish reason, stats).
    An error of this request is raised from the iteration (or from ``wait``), in the consumer's thread.

    ``logprobs`` (a request submitted with ``logprobs=N``): one ``TokenLogprob`` per committed token, in order,
    each appended before its round's tokens are handed over (so a consumer holding k tokens finds k entries).
    """

    def __init__(self, decode: Callable[[list[int]], str | None] | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._decode = decode
        self._started = False
        self._put_lock = threading.Lock()
        self._loop_queue: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None  # set by async iteration
        #: None until the request ends, then its GenerationResult (the text decoded when there is a tokenizer).
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancelled = False  # set by ``cancel``; the scheduler reads it at round boundaries
        self.logprobs: list[TokenLogprob] = []  # filled only for a request submitted with logprobs=N

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at the next round boundary (thread-safe; a no-op once it ended).

        Its slot is freed before the next round (a waiting request may take it there), and the stream then fails
        with a GenerationError saying it was cancelled. A server calls this when its client disconnects."""
        self.cancelled = True

    # called from the scheduler thread
    def push(self, tokens: list[int]) -> None:
        self._put(tokens)

    def push_logprobs(self, entries: list[TokenLogprob]) -> None:
        self.logprobs.extend(entries)

    def finish(self, result: GenerationResult) -> None:
        if self._decode is not None:
            result.text = self._decode(result.tokens)
        self.result = result
        self.done.set()
        self._put(_END)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()
        self._put(_END)

    def _put(self, item) -> None:
        with self._put_lock:
            target = self._loop_queue
            if target is None:
                self._q.put(item)
                return
        loop, aq = target
        try:
            loop.call_soon_threadsafe(aq.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    # called by the consumer
    def _start(self) -> None:
        if self._started:
            raise GenerationError("a RequestStream can be iterated only once")
        self._started = True

    def __iter__(self) -> Iterator[list[int]]:
        self._start()
        return self._iterate()

    def chunks(self) -> Iterator[StreamChunk]:
        """Iterate once: each round's ``StreamChunk(tokens, text)`` (text None without a tokenizer)."""
        return stream_text.chunks(self, self._decode)

    def __aiter__(self) -> AsyncIterator[list[int]]:
        self._start()
        return self._aiterate()

    def achunks(self) -> AsyncIterator[StreamChunk]:
        """``chunks`` for ``async for``."""
        return stream_text.achunks(self.__aiter__(), self._decode)

    async def aresult(self) -> GenerationResult:
        """Await the end of the request (consuming the stream if nobody iterates it) and return its result."""
        if not self._started:
            async for _ in self:
                pass
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.done.wait)
        return self.wait(0)

    async def _aiterate(self) -> AsyncIterator[list[int]]:
        aq: asyncio.Queue = asyncio.Queue()
        with self._put_lock:  # what the scheduler pushed before now, then everything through the event loop
            while True:
                try:
                    aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
            self._loop_queue = (asyncio.get_running_loop(), aq)
        while True:
            item = await aq.get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def _iterate(self) -> Iterator[list[int]]:
        while True:
            item = self._q.get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def wait(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request ends; its result, or its error raised here."""
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class Scheduler:
    """Owns a Generator and the one thread that drives it; ``submit`` may be called from any thread."""

    def __init__(self, gen: Generator, lock=None):
        """lock: a context manager held while the batch has work (the runtime's, so that a single-sequence
        ``stream`` on the same generator never runs at the same time); None for none."""
        self.gen = gen
        self._lock = lock
        self._pending: collections.deque[tuple[Request, RequestStream]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.rounds = 0  # batched rounds run (bench: rounds x graph calls shared by the batch)
        self.active_per_round: list[int] = []  # sequences in each round
        self.join_rounds: list[int] = []  # for each admitted request, the round count when it joined
        self.table = gen.m.batch_trees  # the tree per number of active sequences (None: each request's own)
        # called after each batched round with (seconds, sequences in it), from the scheduler thread (a server's
        # metrics); an exception in it is logged, never fails a request
        self.on_round: Callable[[float, int], None] | None = None

    def submit(self, make_request: Callable[[], Request], stream: RequestStream) -> RequestStream:
        """Check the request here (an error fails this stream only) and queue it for the next round boundary."""
        try:
            req = make_request()
        except GenerationError as e:
            stream.fail(e)
            return stream
        with self._cv:
            if self._closed:
                stream.fail(GenerationError("the runtime is closed"))
                return stream
            self._pending.append((req, stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="eagle-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return stream

    def close(self) -> None:
        """Stop the thread once the requests already submitted have finished."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    if self._closed:
                        return
                    self._cv.wait()
            if self._lock is None:
                self._serve()
            else:
                with self._lock:
                    self._serve()

    def _serve(self) -> None:
        """Rounds until no request is active or waiting."""
        gen = self.gen
        while True:
            self._drop_cancelled()
            with self._cv:
                joining = [self._pending.popleft() for _ in range(min(gen.free, len(self._pending)))]
            if not joining and not gen.active:
                return
            for req, stream in joining:
                try:
                    gen.join(req, stream)
                    self.join_rounds.append(self.rounds)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    log.debug("request failed at prefill", exc_info=True)
                    stream.fail(e if isinstance(e, GenerationError) else GenerationError(f"{type(e).__name__}: {e}"))
            if gen.active:
                self.active_per_round.append(len(gen.active))
                try:
                    t0 = time.perf_counter()
                    n = len(gen.active)
                    gen.round(self.table.pick(n) if self.table is not None else KEEP)
                    self.rounds += 1
                    self._report_round(time.perf_counter() - t0, n)
                except Exception as e:  # noqa: BLE001 - a graph call failed: its requests fail, others go on
                    log.debug("round failed", exc_info=True)
                    gen.fail_all(e if isinstance(e, GenerationError) else GenerationError(f"{type(e).__name__}: {e}"))

    def _drop_cancelled(self) -> None:
        """Free the slots of cancelled active requests (before the next round) and drop cancelled waiting ones."""
        gen = self.gen
        gone = GenerationError("the request was cancelled")
        hit = False
        for s in gen.active:
            if getattr(s.sink, "cancelled", False) and s.error is None and s.reason is None:
                s.error, hit = gone, True
        if hit:
            gen._retire()  # the generator's own removal of finished slots (it fails their streams)
        with self._cv:
            keep = [(r, st) for r, st in self._pending if not st.cancelled]
            dropped = [st for _, st in self._pending if st.cancelled]
            self._pending = collections.deque(keep)
        for st in dropped:
            st.fail(gone)

    def _report_round(self, seconds: float, active: int) -> None:
        if self.on_round is not None:
            try:
                self.on_round(seconds, active)
            except Exception:  # noqa: BLE001 - a metrics hook never fails a request
                log.warning("Scheduler.on_round failed", exc_info=True)

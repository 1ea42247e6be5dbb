"""Continuous batching: thread-safe ``submit`` returns a stream per request; one scheduler thread drives rounds.

Between rounds the scheduler admits waiting requests into free slots (each is prefilled, then joins the next
verify), runs one batched round over every active sequence, and hands each request's committed tokens to its
stream. A request that fails (bad prompt ids, a sampling error on its own logits) fails its own stream only; a
failed graph call fails the requests that were in it, and the scheduler goes on with the next ones.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from eagle_export.errors import GenerationError

from .generator import GenerationResult, Generator
from .slots import Request

log = logging.getLogger(__name__)
_END = object()


class RequestStream:
    """One request's output: iterate once for token lists as rounds commit them; ``result`` when it ends.

    An error of this request is raised from the iteration (or from ``wait``), in the consumer's thread.
    """

    def __init__(self, decode: Callable[[list[int]], str | None] | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._decode = decode
        self._started = False
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancelled = False  # set by ``cancel``; the scheduler reads it at round boundaries

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at the next round boundary (thread-safe; a no-op once it ended).

        Its slot is freed before the next round (a waiting request may take it there), and the stream then fails
        with a GenerationError saying it was cancelled. A server calls this when its client disconnects."""
        self.cancelled = True

    # called from the scheduler thread
    def push(self, tokens: list[int]) -> None:
        self._q.put(tokens)

    def finish(self, result: GenerationResult) -> None:
        if self._decode is not None:
            result.text = self._decode(result.tokens)
        self.result = result
        self.done.set()
        self._q.put(_END)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()
        self._q.put(_END)

    # called by the consumer
    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            raise GenerationError("a RequestStream can be iterated only once")
        self._started = True
        return self._iterate()

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
                    gen.round()
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

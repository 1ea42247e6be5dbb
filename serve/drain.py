"""Graceful shutdown: the accepted requests may run on for a deadline, then each one that has not finished is told
so (an SSE error event, or a 503), never cut off.

``Drain.start(seconds)`` is called when the server stops accepting connections (``serve/server.py``). New requests
on connections still open get 503 from then on; when the deadline passes, a marker goes into the queue of every
job still running, and its response coroutine answers with the error and cancels the job.
"""

from __future__ import annotations

import asyncio


class ShuttingDown(Exception):
    """The drain deadline passed before this request finished."""


class Drain:
    """The jobs of the responses in progress, and the shutdown state (one per app, used on its event loop)."""

    def __init__(self):
        self.jobs: set = set()
        self.started = False
        self.expired = False

    def add(self, job) -> None:
        self.jobs.add(job)
        if self.expired:
            self._tell(job)

    def discard(self, job) -> None:
        self.jobs.discard(job)

    def start(self, seconds: float) -> None:
        """Stop taking requests; ``seconds`` from now, end the ones still running."""
        if self.started:
            return
        self.started = True
        asyncio.get_running_loop().call_later(max(seconds, 0.0), self._expire)

    def _expire(self) -> None:
        self.expired = True
        for job in list(self.jobs):
            self._tell(job)

    @staticmethod
    def _tell(job) -> None:
        job.queue.put_nowait((None, ShuttingDown()))

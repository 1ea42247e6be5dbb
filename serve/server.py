"""The uvicorn server of ``eagle-export serve`` (also what the tests run): graceful shutdown that drains the
accepted requests (``serve/drain.py``), and a timeout for a request's head, which uvicorn does not have.

A connection that opens and sends no complete request head within ``header_timeout_s`` (a slow or stalled client,
or one holding connections open on purpose) gets 408 and is closed; an idle keep-alive connection between requests
is left to uvicorn's keep-alive timeout. The body's own timeout is ``middleware.ReadBody``'s.
"""

from __future__ import annotations

import json

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .engine import ServeEngine
from .protocol import error_body

_BACKSTOP_S = 5.0  # uvicorn's own graceful-shutdown timeout = the drain + this (it cancels what is left)


def _timeout_response(message: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", code="request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def header_timeout_protocol(base: type, seconds: float) -> type:
    """uvicorn's HTTP protocol class ``base`` with a timer from the connection's start (and from each response's
    end once bytes of a next request arrive) to the end of a request head."""
    response = _timeout_response(f"the request head did not arrive within {seconds:g} s")

    class HeaderTimeout(base):
        _timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._bytes = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._cycle, self._bytes = self.cycle, False
            self._timer = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._timer = None
            if self.cycle is not self._cycle or self.transport.is_closing():
                return  # a request head arrived (its cycle began)
            if self._cycle is not None and not self._bytes:
                return  # idle between requests: the keep-alive timeout's business
            self.transport.write(response)
            self.transport.close()

    return HeaderTimeout


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown (SIGTERM, SIGINT, ``should_exit``) first starts the app's drain."""

    def __init__(self, config: uvicorn.Config, drain, drain_s: float):
        super().__init__(config)
        self.drain, self.drain_s = drain, drain_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.start(self.drain_s)
        await super().shutdown(sockets)


def make_server(engine: ServeEngine, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> DrainingServer:
    """The app over ``engine`` in a uvicorn server with the options' drain and header timeout."""
    from .app import build_app

    opts = engine.opts
    app = build_app(engine, opts.api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=header_timeout_protocol(AutoHTTPProtocol, opts.header_timeout_s),
                            timeout_graceful_shutdown=int(opts.drain_s + _BACKSTOP_S + 0.999))
    return DrainingServer(config, app.state.drain, opts.drain_s)

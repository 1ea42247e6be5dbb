"""ASGI middleware in front of the app: the API key (checked first, before any body byte is read), then the body,
read whole under a size cap (413) and a read timeout (408) before the app sees it.

Reading the body here, not in FastAPI, is what makes an oversized chunked body (no Content-Length) a 413: a limit
that raised from inside FastAPI's body parsing came out as its generic 400 "error parsing the body".
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi.responses import JSONResponse

from .protocol import error_body

_PROTECTED = ("/v1/", "/metrics")


def json_error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of ``Authorization: Bearer TOKEN`` (scheme case-insensitive, RFC 7235), None for any other
    scheme or shape."""
    scheme, sep, rest = header.partition(b" ")
    token = rest.strip(b" ")
    if not sep or scheme.lower() != b"bearer" or not token or b" " in token:
        return None
    return token


class ApiKey:
    """With a key, /v1/* and /metrics need ``Authorization: Bearer KEY`` (401 otherwise). ``on_reject(path)``
    counts a refusal (under a bounded label: the path is the client's)."""

    def __init__(self, app, key: str | None, on_reject=None):
        self.app, self.key = app, key.encode() if key else None
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key is not None and scope["path"].startswith(_PROTECTED):
            token = bearer_token(dict(scope.get("headers") or []).get(b"authorization", b""))
            if token is None or not secrets.compare_digest(token, self.key):
                if self.on_reject is not None:
                    self.on_reject(scope["path"])
                return await json_error(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                        code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


class ReadBody:
    """Reads a request's whole body before the app runs: over ``limit`` bytes is 413 (from Content-Length before
    reading, else as soon as the count passes it), not all there within ``timeout_s`` is 408. The app then gets
    the body in one message, and later ``receive`` calls go to the client (disconnects)."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = json_error(413, f"the request body is over this server's limit of {self.limit} bytes",
                               code="request_too_large", headers={"connection": "close"})
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_large(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return await json_error(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                        code="request_timeout", headers={"connection": "close"})(scope, receive, send)
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

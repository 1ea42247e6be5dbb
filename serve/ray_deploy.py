"""The Ray Serve deployment: one runtime per model replica, behind a small ingress of our own. Imported only for
``serve --ray`` (it imports ray).

Ray's HTTP proxy sends every request to the ingress (``EagleIngress``, no CPU reserved), which hands it whole to a
model replica (``EagleReplica``) over a streaming deployment handle; the replica runs the same FastAPI app as
``serve`` in-process and streams back its ASGI messages. The ingress exists for one reason: a replica that dies (a
crash, the OOM killer, SIGKILL) cannot answer for itself, and Ray's proxy then answers a plain-text 500 or cuts the
stream. The ingress sees the handle fail and answers with OpenAI's error object instead: a 503
``replica_unavailable`` (``Retry-After: 1``) when no byte was sent yet, else, in a stream, an error event and
``[DONE]``. The cost is one more hop inside Ray per request.

Ray's proxy sends each /metrics scrape to one replica, so each replica labels its samples with its own Ray replica
id (``replica``): a scrape that lands elsewhere reads other series, and no series ever goes backwards. A replica
that Ray stops (scale down, redeploy, ``serve.shutdown``) gets ``graceful_shutdown_timeout_s`` = the drain to
finish its requests. docs/serve.md says what a client should retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from eagle_export.manifest import load_manifest
from eagle_export.serve.engine import ServeEngine, ServeOptions
from eagle_export.serve.protocol import error_body

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
_GONE = ("the replica serving this request stopped before it finished; retry (with a seed, or greedy decoding, the "
         "same tokens come back)")
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers",
               "client", "server")

# a replica that died (ActorDiedError) or cannot be reached now (ActorUnavailableError): both are RayActorErrors
_REPLICA_GONE = RayActorError


class EagleReplica:
    """One model replica: opens its own runtime and app; ``asgi`` runs one HTTP request through the app."""

    def __init__(self, options: ServeOptions):
        if options.replica_label is None:
            options = dataclasses.replace(options, replica_label=serve.get_replica_context().replica_id.unique_id)
        from eagle_export.serve.app import build_app

        self.engine = ServeEngine.open(options)
        self.app = build_app(self.engine, options.api_key)

    async def asgi(self, scope: dict, body: bytes) -> AsyncIterator[dict]:
        """The app's ASGI messages for one request whose body is ``body``; the caller going away (the client
        disconnected) cancels this generator, which cancels the request as a disconnect does under ``serve``."""
        given = False

        async def receive() -> dict:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Future()  # never: a disconnect arrives as this generator's cancellation
            return {"type": "http.disconnect"}  # pragma: no cover

        out: asyncio.Queue = asyncio.Queue()

        async def send(message: dict) -> None:
            out.put_nowait(message)

        task = asyncio.ensure_future(self.app(dict(scope, state={}), receive, send))
        try:
            while True:
                get = asyncio.ensure_future(out.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    while not out.empty():
                        yield out.get_nowait()
                    task.result()  # an exception of the app (it answers its own errors, so none is expected)
                    return
                message = get.result()
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            if not task.done():
                task.cancel()


class EagleIngress:
    """Ray's proxy -> here -> a model replica; a replica that dies mid-request gets an OpenAI error body."""

    def __init__(self, replicas, max_body_bytes: int, body_timeout_s: float):
        self.replicas = replicas.options(stream=True)
        self.limit, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, request: Request) -> Response:
        try:
            body = await asyncio.wait_for(self._body(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            return JSONResponse(error_body(f"the request body did not arrive within {self.body_timeout_s:g} s",
                                           code="request_timeout"), status_code=408)
        scope = {k: request.scope[k] for k in _SCOPE_KEYS if k in request.scope}
        scope["root_path"] = ""
        gen = self.replicas.asgi.remote(scope, body)
        try:
            start = await gen.__anext__()
        except _REPLICA_GONE as e:
            log.warning("a replica failed before answering: %s", e)
            return _gone()
        except Exception:  # noqa: BLE001 - whatever went wrong inside Ray: an OpenAI error body, details logged
            log.exception("the replica call failed")
            return JSONResponse(error_body("internal error (the server's log has the details)", "server_error"),
                                status_code=500)
        except BaseException:  # cancelled (the client went away): so is the replica's work
            gen.cancel()
            raise
        return _Relay(start, gen)

    async def _body(self, request: Request) -> bytes:
        """The body, up to one byte over the cap (the replica's app answers 413 for it)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > self.limit:
                break
        return b"".join(chunks)


def _gone() -> JSONResponse:
    return JSONResponse(error_body(_GONE, "server_error", code="replica_unavailable"), status_code=503,
                        headers={"retry-after": str(RETRY_AFTER_S)})


class _Relay(Response):
    """The replica's response, message by message; if the replica dies mid-body, a stream ends with an OpenAI error
    event and ``[DONE]`` (never a cut connection)."""

    def __init__(self, start: dict, gen):
        self.start, self.gen = start, gen
        self.status_code = start.get("status", 200)
        self.background = None
        self.raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]

    async def __call__(self, scope, receive, send) -> None:
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        try:
            while not ended:
                try:
                    message = await self.gen.__anext__()
                except StopAsyncIteration:
                    break
                except _REPLICA_GONE as e:
                    log.warning("a replica failed mid-response: %s", e)
                    break
                except Exception:  # noqa: BLE001
                    log.exception("the replica call failed mid-response")
                    break
                if message["type"] == "http.response.body":
                    ended = not message.get("more_body", False)
                    await send(message)
        finally:
            if not ended:  # the replica failed, or this side did (the client went away): stop the replica's work
                self.gen.cancel()
        if not ended:
            tail = b""
            if sse:
                tail = f"data: {json.dumps(error_body(_GONE, 'server_error', code='replica_unavailable'))}\n\n" \
                       "data: [DONE]\n\n"
                tail = tail.encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})


def ray_app(opts: ServeOptions, replicas: int, replica_cpus: float = 1.0):
    """The bound application: the ingress over ``replicas`` model replicas, each taking up to its slots plus its
    queue at once (Ray Serve's default of 5 ongoing requests per replica would starve the batch)."""
    max_batch = opts.max_batch if opts.max_batch is not None else load_manifest(opts.artifact).max_batch
    per_replica = max_batch + max(opts.max_queue, 0) + 1
    model = serve.deployment(EagleReplica, name="eagle", num_replicas=replicas,
                             ray_actor_options={"num_cpus": replica_cpus}, max_ongoing_requests=per_replica,
                             graceful_shutdown_timeout_s=opts.drain_s)
    ingress = serve.deployment(EagleIngress, name="eagle-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=replicas * per_replica + 16,
                               graceful_shutdown_timeout_s=opts.drain_s + 5)
    return ingress.bind(model.bind(opts), opts.max_body_bytes, opts.body_timeout_s)

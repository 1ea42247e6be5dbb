"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events, one chunk per
committed round, or whole), /v1/models, /health and /metrics, over one ``ServeEngine``.

Every refusal is OpenAI's JSON error object with a 4xx status: 400 for a bad body (unknown field, wrong type, bad
value, prompt over the cap or the capacity), 401 without the API key, 404 for another model's name, 413 for a body
over the size cap, 429 when the queue is full. A client that goes away, a stop string and the per-request timeout
cancel the request's streams, which frees their batch slots at the next round.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from eagle_export.errors import EagleExportError

from .choices import ChoiceText
from .engine import PromptTooLong, QueueFull, RequestTimeout, ServeEngine
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest, error_body, validation_message

_PROTECTED = ("/v1/", "/metrics")
_POLL_S = 0.05  # how often a whole (non-streamed) response checks that its client is still there


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class _ClientGone(Exception):
    pass


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 before the app reads it all."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        msg = f"the request body is over this server's limit of {self.limit} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error(413, msg, code="request_too_large")(scope, receive, send)
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyLimit._TooLarge()
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyLimit._TooLarge:
            if not started:
                await _error(413, msg, code="request_too_large")(scope, receive, send)


class ApiKey:
    """ASGI middleware: with a key, /v1/* and /metrics need ``Authorization: Bearer KEY`` (401 otherwise); every
    response names the replica that answered (``x-eagle-replica``)."""

    def __init__(self, app, key: str | None, replica: str, on_reject=None):
        self.app, self.key = app, key.encode() if key else None
        self.replica = replica.encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-eagle-replica", self.replica)]}
            await send(message)

        if self.key is not None and scope["path"].startswith(_PROTECTED):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not secrets.compare_digest(token, self.key):
                if self.on_reject is not None:
                    self.on_reject(scope["path"])
                return await _error(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                    code="invalid_api_key")(scope, receive, tagged)
        await self.app(scope, receive, tagged)


def build_app(engine: ServeEngine, api_key: str | None = None) -> FastAPI:
    """The server's app over ``engine``; with ``api_key``, /v1/* and /metrics need ``Authorization: Bearer KEY``."""
    app = FastAPI(title="eagle-export serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    m = engine.metrics
    app.add_middleware(ApiKey, key=api_key, replica=engine.replica,
                       on_reject=lambda path: m.requests.labels(path, "unauthorized").inc())
    app.add_middleware(BodyLimit, limit=engine.opts.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        m.requests.labels(request.url.path, "bad_request").inc()
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), code=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        m.requests.labels(request.url.path, "error").inc()
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name, "replica": engine.replica,
                "in_flight": engine.in_flight, "max_batch": engine.rt.max_batch}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        man = engine.rt.manifest
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": 0, "owned_by": "eagle-export",
            "eagle": {"variant": man.variant, "capacity": engine.capacity, "max_batch": engine.rt.max_batch,
                      "vocab_size": man.target.vocab_size, "has_tokenizer": engine.rt.tokenizer is not None,
                      "tree_defaults": man.tree_defaults.to_dict(), "max_prompt_tokens": engine.max_prompt_tokens}}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(engine, body, request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(engine, body, request, "/v1/chat/completions", chat=True)

    return app


async def _generate(engine: ServeEngine, body, request: Request, endpoint: str, chat: bool):
    m = engine.metrics
    try:
        job, max_new = _start(engine, body, chat)
    except ApiError as e:
        m.requests.labels(endpoint, "rejected_queue_full" if e.status == 429 else "bad_request").inc()
        raise
    deadline = asyncio.get_running_loop().time() + engine.opts.timeout_s
    choices = [ChoiceText(engine.rt.decode, body.stop_strings()) for _ in job.streams]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion.chunk" if body.stream and chat else
            "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": engine.model_name}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _CancellingStream(job, _sse(engine, job, choices, head, chat, usage, deadline, endpoint),
                                 media_type="text/event-stream")
    try:
        async for _ in _rounds(job, choices, deadline, request):
            pass
    except asyncio.CancelledError:  # the server is shutting down
        job.cancel()
        raise
    except (RequestTimeout, _ClientGone) as e:
        job.cancel()
        timeout = isinstance(e, RequestTimeout)
        m.requests.labels(endpoint, "timeout" if timeout else "cancelled").inc()
        if timeout:
            raise ApiError(504, f"the request ran past this server's timeout of {engine.opts.timeout_s:g} s",
                           type_="timeout", code="timeout") from None
        return Response(status_code=499)
    except _Failed as e:
        job.cancel()  # the other choices of this request
        m.requests.labels(endpoint, "error").inc()
        raise ApiError(500, f"generation failed: {e}", type_="server_error") from None
    m.requests.labels(endpoint, "ok").inc()
    out = dict(head)
    out["choices"] = [_choice(i, c, c.text, chat, whole=True) for i, c in enumerate(choices)]
    out["usage"] = _usage(job, choices)
    out["eagle"] = _eagle(job, choices)
    return out


def _start(engine: ServeEngine, body, chat: bool):
    """Check the request against the model and the server, and submit it: (job, max_new_tokens)."""
    if body.model != engine.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves "
                       f"{engine.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
    opts = body.eagle
    try:
        if chat:
            ids = engine.prompt_ids(messages=[{"role": mm.role, "content": mm.text()} for mm in body.messages])
        else:
            ids = engine.prompt_ids(body.prompt)
        tree = None if opts is not None and opts.no_draft else engine.tree(
            *((opts.top_k, opts.depth, opts.total_tokens) if opts is not None else (None, None, None)))
        max_new = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if max_new is None:
            max_new = max(engine.capacity - len(ids), 1) if chat else 16
        job = engine.submit(ids, n=body.n, max_new_tokens=max_new, tree=tree,
                            use_draft=tree is not None, stop_on_eos=not (opts is not None and opts.ignore_eos),
                            temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            per_round=body.stream or bool(body.stop_strings()))
    except QueueFull as e:
        raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
    except PromptTooLong as e:
        raise ApiError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None
    except EagleExportError as e:
        raise ApiError(400, str(e)) from None
    return job, max_new


class _Failed(Exception):
    pass


async def _rounds(job, choices: list[ChoiceText], deadline: float, request: Request | None = None
                  ) -> AsyncIterator[tuple[int, str]]:
    """(choice index, text delta) as rounds arrive, until every stream has ended; a stream that hits a stop string
    is cancelled at once. ``request`` (whole responses): poll for a client that went away."""
    loop = asyncio.get_running_loop()
    ended = [False] * len(job.streams)
    polled = loop.time()
    while not all(ended):
        now = loop.time()
        remaining = deadline - now
        if remaining <= 0:
            raise RequestTimeout()
        # every _POLL_S, whether or not rounds keep arriving (a fast batch would otherwise never be interrupted)
        if request is not None and now - polled >= _POLL_S:
            polled = now
            if await request.is_disconnected():
                raise _ClientGone()
        try:
            i, item = await asyncio.wait_for(job.queue.get(), min(remaining, _POLL_S) if request else remaining)
        except asyncio.TimeoutError:
            continue
        c = choices[i]
        if isinstance(item, list):
            delta = c.feed(item)
            if c.stopped:
                job.streams[i].cancel()
            yield i, delta
        elif isinstance(item, BaseException):
            ended[i] = True
            if c.finish_reason is None:  # not a stop string's cancellation: a real failure
                raise _Failed(str(item))
        else:
            ended[i] = True
            yield i, c.end(item)


async def _sse(engine: ServeEngine, job, choices, head: dict, chat: bool, usage: bool, deadline: float,
               endpoint: str) -> AsyncIterator[str]:
    """Server-sent events: one chunk per committed round per choice (tokens and text delta), a closing chunk per
    choice with its finish reason, then usage (if asked) and the EAGLE figures, then ``[DONE]``."""
    m = engine.metrics

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    if chat:
        yield event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None} for i in range(len(choices))]})
    status = "ok"
    try:
        sent = [0] * len(choices)
        closed = [False] * len(choices)
        async for i, delta in _rounds(job, choices, deadline):
            c = choices[i]
            if closed[i]:  # a round that landed between a stop string and its cancellation
                continue
            new = c.tokens[sent[i]:]
            sent[i] = len(c.tokens)
            closed[i] = c.finish_reason is not None
            if delta or new or closed[i]:
                yield event({**head, "choices": [_choice(i, c, delta, chat, whole=False, token_ids=new)]})
        tail = {**head, "choices": [], "eagle": _eagle(job, choices)}
        if usage:
            tail["usage"] = _usage(job, choices)
        yield event(tail)
    except RequestTimeout:
        status = "timeout"
        job.cancel()
        yield event(error_body(f"the request ran past this server's timeout of {engine.opts.timeout_s:g} s",
                               "timeout", code="timeout"))
    except _Failed as e:
        status = "error"
        job.cancel()
        yield event(error_body(f"generation failed: {e}", "server_error"))
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        if status == "ok" and not all(c.finish_reason is not None for c in choices):
            status = "cancelled"
        m.requests.labels(endpoint, status).inc()
    yield "data: [DONE]\n\n"


class _CancellingStream(StreamingResponse):
    """A streamed response that cancels its job whenever it ends without finishing (client gone, error)."""

    def __init__(self, job, content, **kw):
        super().__init__(content, **kw)
        self._job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client went away mid-stream: not a server error
            pass
        finally:
            self._job.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _choice(i: int, c: ChoiceText, text: str, chat: bool, whole: bool, token_ids: list[int] | None = None) -> dict:
    out: dict = {"index": i}
    if chat:
        out["message" if whole else "delta"] = {"role": "assistant", "content": text} if whole else {"content": text}
    else:
        out["text"] = text
        out["logprobs"] = None
    out["finish_reason"] = c.finish_reason
    out["token_ids"] = list(c.tokens) if whole else list(token_ids or [])
    return out


def _usage(job, choices: list[ChoiceText]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


def _eagle(job, choices: list[ChoiceText]) -> dict:
    """The EAGLE extension: tau over all choices, and per choice its accepted lengths, rounds and seed."""
    per = []
    rounds = committed = 0
    for c, seed in zip(choices, job.seeds, strict=True):
        s = c.result.stats if c.result is not None else None
        acc = list(s.accept_lengths) if s is not None else []
        r = s.rounds if s is not None else 0
        rounds += r
        committed += r + sum(acc)
        per.append({"rounds": r, "accept_lengths": acc, "tau": (r + sum(acc)) / r if r else None, "seed": seed,
                    "runtime_finish_reason": c.result.finish_reason if c.result is not None else None})
    return {"tau": committed / rounds if rounds else None, "tree": job.tree.to_dict() if job.tree else None,
            "choices": per}

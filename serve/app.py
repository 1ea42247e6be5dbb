"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events, one chunk per
committed round, or whole), /v1/models, /health and /metrics, over one ``ServeEngine``.

Every refusal is OpenAI's JSON error object with a 4xx status: 400 for a bad body (unknown field, wrong type, bad
value, prompt over the cap or the capacity), 401 without the API key, 404 for another model's name, 408 for a body
that does not arrive in time, 413 for a body over the size cap, 429 (with ``Retry-After``) when the queue is full,
503 while the server shuts down. A client that goes away, a stop string and the per-request timeout cancel the
request's streams, which frees their batch slots at the next round. Messages never carry a path of this server or
an exception's text (those go to the log).

Streams follow OpenAI's chunk rules: every chunk has at least one choice, except the final usage chunk that
``stream_options.include_usage`` asks for (then every other chunk carries ``"usage": null``); the ``eagle``
extension rides on the last choice chunk, or on the usage chunk when there is one.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from .drain import Drain, ShuttingDown
from .engine import PromptTooLong, QueueFull, RequestTimeout, ServeEngine
from .logprobs import chat_logprobs, completion_logprobs, text_length
from .metrics import CONTENT_TYPE
from .middleware import ApiKey, ReadBody, json_error
from .protocol import ChatCompletionRequest, CompletionRequest, error_body, validation_message

log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often a whole (non-streamed) response checks that its client is still there
RETRY_AFTER_S = 1  # what a 429 / 503 tells the client to wait (RFC 6585 section 4, RFC 9110 section 10.2.3)
_SHUTTING_DOWN = "the server is shutting down; retry on another replica or later"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


class _ClientGone(Exception):
    pass


class _Replica:
    """ASGI middleware: names the replica that answered in ``x-eagle-replica`` (only with ``replica_header``)."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-eagle-replica", self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


def build_app(engine: ServeEngine, api_key: str | None = None) -> FastAPI:
    """The server's app over ``engine``; with ``api_key``, /v1/* and /metrics need ``Authorization: Bearer KEY``.
    ``app.state.drain`` is its shutdown state (``Drain.start`` when the server stops accepting)."""
    app = FastAPI(title="eagle-export serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.drain = drain = Drain()
    opts = engine.opts
    m = engine.metrics
    # the last added runs first: replica tag (outermost), API key, then the body
    app.add_middleware(ReadBody, limit=opts.max_body_bytes, timeout_s=opts.body_timeout_s)
    app.add_middleware(ApiKey, key=api_key, on_reject=lambda path: m.request(path, "unauthorized"))
    if opts.replica_header:
        app.add_middleware(_Replica, replica=engine.replica)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        m.request(request.url.path, "bad_request")
        return json_error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return json_error(exc.status_code, str(exc.detail), code=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.error("internal error on %s", request.url.path, exc_info=exc)
        m.request(request.url.path, "error")
        return json_error(500, "internal error (the server's log has the details)", type_="server_error")

    @app.get("/health")
    async def health():
        out = {"status": "draining" if drain.started else "ok", "model": engine.model_name,
               "in_flight": engine.in_flight, "max_batch": engine.rt.max_batch}
        if opts.replica_header:
            out["replica"] = engine.replica
        return JSONResponse(out, status_code=503 if drain.started else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        man = engine.rt.manifest
        return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "eagle-export",
                "eagle": {"variant": man.variant, "capacity": engine.capacity, "max_batch": engine.rt.max_batch,
                          "vocab_size": man.target.vocab_size, "has_tokenizer": engine.rt.tokenizer is not None,
                          "tree_defaults": man.tree_defaults.to_dict(),
                          "default_tree": None if (d := man.default_tree(engine.rt.max_batch)) is None else d.to_dict(),
                          "max_prompt_tokens": engine.max_prompt_tokens}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist here; this server serves "
                           f"{engine.model_name!r}", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(engine, drain, body, request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(engine, drain, body, request, "/v1/chat/completions", chat=True)

    return app


async def _generate(engine: ServeEngine, drain: Drain, body, request: Request, endpoint: str, chat: bool):
    m = engine.metrics
    t0 = time.perf_counter()
    try:
        if drain.started:
            raise ApiError(503, _SHUTTING_DOWN, type_="server_error", code="shutting_down",
                           headers={"retry-after": str(RETRY_AFTER_S)})
        job = _start(engine, body, chat, endpoint, t0)
    except ApiError as e:
        m.request(endpoint, {429: "rejected_queue_full", 503: "shutdown"}.get(e.status, "bad_request"))
        raise
    drain.add(job)  # no await since _start: a drain that expires from here on reaches this job
    deadline = asyncio.get_running_loop().time() + engine.opts.timeout_s
    choices = [ChoiceText(engine.rt.decode, body.stop_strings()) for _ in job.streams]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion.chunk" if body.stream and chat else
            "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": engine.model_name}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _CancellingStream(job, drain, _sse(engine, job, choices, head, chat, usage, deadline, endpoint,
                                                  body.top_logprobs_asked()), media_type="text/event-stream")
    try:
        async for _ in _rounds(job, choices, deadline, request):
            pass
    except asyncio.CancelledError:  # the server's last resort on shutdown (past the drain)
        job.cancel()
        raise
    except (RequestTimeout, _ClientGone, ShuttingDown) as e:
        job.cancel()
        if isinstance(e, RequestTimeout):
            m.request(endpoint, "timeout")
            raise ApiError(504, f"the request ran past this server's timeout of {engine.opts.timeout_s:g} s",
                           type_="timeout", code="timeout") from None
        if isinstance(e, ShuttingDown):
            m.request(endpoint, "shutdown")
            raise ApiError(503, _SHUTTING_DOWN, type_="server_error", code="shutting_down",
                           headers={"retry-after": str(RETRY_AFTER_S)}) from None
        m.request(endpoint, "cancelled")
        return Response(status_code=499)
    except _Failed:
        job.cancel()  # the other choices of this request
        m.request(endpoint, "error")
        raise ApiError(500, "generation failed (the server's log has the details)", type_="server_error") from None
    finally:
        drain.discard(job)
    m.request(endpoint, "ok")
    out = dict(head)
    want = body.top_logprobs_asked()
    out["choices"] = [_choice(i, c, c.text, chat, whole=True,
                              logprobs=None if want is None else _logprobs(engine, job, i, 0, len(c.tokens), chat))
                      for i, c in enumerate(choices)]
    out["usage"] = _usage(job, choices)
    out["eagle"] = _eagle(job, choices)
    m.e2e.labels(endpoint).observe(time.perf_counter() - t0)
    return out


def _start(engine: ServeEngine, body, chat: bool, endpoint: str, t0: float):
    """Check the request against the model and the server, and submit it: its job."""
    if body.model != engine.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves "
                       f"{engine.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
    opts = body.eagle
    try:
        if chat:
            ids = engine.prompt_ids(messages=[{"role": mm.role, "content": mm.text()} for mm in body.messages])
        else:
            ids = engine.prompt_ids(body.prompt)
        no_draft = opts is not None and opts.no_draft
        tree = None if no_draft else engine.tree(
            *((opts.top_k, opts.depth, opts.total_tokens, opts.threshold) if opts is not None else (None,) * 4))
        max_new = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if max_new is None:
            max_new = max(engine.capacity - len(ids), 1) if chat else 16
        return engine.submit(ids, n=body.n, max_new_tokens=max_new, tree=tree,
                             use_draft=not no_draft, stop_on_eos=not (opts is not None and opts.ignore_eos),
                             temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                             per_round=body.stream or bool(body.stop_strings()), endpoint=endpoint, t0=t0,
                             logprobs=body.top_logprobs_asked())
    except QueueFull as e:
        raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full",
                       headers={"retry-after": str(RETRY_AFTER_S)}) from None
    except PromptTooLong as e:
        raise ApiError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None
    except EagleExportError as e:
        raise ApiError(400, engine.public(str(e))) from None


class _Failed(Exception):
    pass


async def _rounds(job, choices: list[ChoiceText], deadline: float, request: Request | None = None
                  ) -> AsyncIterator[tuple[int, str]]:
    """(choice index, text delta) as rounds arrive, until every stream has ended; a stream that hits a stop string
    is cancelled at once. ``request`` (whole responses): poll for a client that went away. ShuttingDown when the
    server's drain runs out (``Drain`` puts its marker in the job's queue)."""
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
        if i is None:
            raise ShuttingDown()
        c = choices[i]
        if isinstance(item, list):
            delta = c.feed(item)
            if c.stopped:
                job.streams[i].cancel()
            yield i, delta
        elif isinstance(item, BaseException):
            ended[i] = True
            if c.finish_reason is None:  # not a stop string's cancellation: a real failure
                log.error("generation failed: %s", item)
                raise _Failed(str(item))
        else:
            ended[i] = True
            yield i, c.end(item)


async def _sse(engine: ServeEngine, job, choices, head: dict, chat: bool, usage: bool, deadline: float,
               endpoint: str, want_logprobs: int | None = None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per committed round per choice (tokens and text delta), a closing chunk per
    choice with its finish reason (the last of them with ``eagle``), then the usage chunk (if asked: empty
    ``choices``, ``usage`` and ``eagle``), then ``[DONE]``. With log-probabilities, a chunk's are those of its
    ``token_ids`` (null when it has none)."""
    m = engine.metrics

    def event(choice_list: list, **extra) -> str:
        obj = {**head, "choices": choice_list}
        if usage:
            obj["usage"] = None
        obj.update(extra)
        return f"data: {json.dumps(obj)}\n\n"

    if chat:
        for i in range(len(choices)):
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
    status = "ok"
    try:
        sent = [0] * len(choices)
        offsets = [0] * len(choices)  # completions' text_offset: characters of the tokens sent so far
        closed = [False] * len(choices)
        async for i, delta in _rounds(job, choices, deadline):
            c = choices[i]
            if closed[i]:  # a round that landed between a stop string and its cancellation
                continue
            new = c.tokens[sent[i]:]
            lp = None
            if want_logprobs is not None and new:
                lp = _logprobs(engine, job, i, sent[i], len(c.tokens), chat, offsets[i])
                offsets[i] += text_length(job.streams[i].logprobs[sent[i]:len(c.tokens)], engine.token_text)
            sent[i] = len(c.tokens)
            closed[i] = c.finish_reason is not None
            if delta or new or closed[i]:
                extra = {"eagle": _eagle(job, choices)} if all(closed) and not usage else {}
                yield event([_choice(i, c, delta, chat, whole=False, token_ids=new, logprobs=lp)], **extra)
        if usage:
            yield event([], usage=_usage(job, choices), eagle=_eagle(job, choices))
    except RequestTimeout:
        status = "timeout"
        job.cancel()
        yield _error_event(f"the request ran past this server's timeout of {engine.opts.timeout_s:g} s", "timeout",
                           "timeout")
    except ShuttingDown:
        status = "shutdown"
        job.cancel()
        yield _error_event(_SHUTTING_DOWN, "server_error", "shutting_down")
    except _Failed:
        status = "error"
        job.cancel()
        yield _error_event("generation failed (the server's log has the details)", "server_error", None)
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        if status == "ok" and not all(c.finish_reason is not None for c in choices):
            status = "cancelled"
        m.request(endpoint, status)
        if status == "ok":
            m.e2e.labels(endpoint).observe(time.perf_counter() - job.t0)
    yield "data: [DONE]\n\n"


def _error_event(message: str, type_: str, code: str | None) -> str:
    return f"data: {json.dumps(error_body(message, type_, code=code))}\n\n"


class _CancellingStream(StreamingResponse):
    """A streamed response that cancels its job whenever it ends without finishing (client gone, error)."""

    def __init__(self, job, drain: Drain, content, **kw):
        super().__init__(content, **kw)
        self._job, self._drain = job, drain

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client went away mid-stream: not a server error
            pass
        finally:
            self._job.cancel()
            self._drain.discard(self._job)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _logprobs(engine: ServeEngine, job, i: int, start: int, end: int, chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for tokens [start, end) of choice i (the runtime's entries, one per token)."""
    entries = job.streams[i].logprobs[start:end]
    if chat:
        return chat_logprobs(entries, engine.token_text)
    return completion_logprobs(entries, engine.token_text, offset)


def _choice(i: int, c: ChoiceText, text: str, chat: bool, whole: bool, token_ids: list[int] | None = None,
            logprobs: dict | None = None) -> dict:
    out: dict = {"index": i}
    if chat and whole:
        out["message"] = {"role": "assistant", "content": text}
    elif chat:  # OpenAI's closing chunk carries an empty delta
        out["delta"] = {"content": text} if text or c.finish_reason is None else {}
    else:
        out["text"] = text
    out["logprobs"] = logprobs
    out["finish_reason"] = c.finish_reason
    out["token_ids"] = list(c.tokens) if whole else list(token_ids or [])
    return out


def _usage(job, choices: list[ChoiceText]) -> dict:
    """Usage over every choice: the tokens returned (a stop string's round is cut at the token that completed it)."""
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


# the speculation metrics the extension adds up over the choices
SUMMED = ("spec_rounds", "plain_rounds", "drafted_tokens", "accepted_tokens", "verified_tokens", "draft_s",
          "target_s", "host_s", "guard_switches", "short_rounds")


def _eagle(job, choices: list[ChoiceText]) -> dict:
    """The EAGLE extension: tau over all choices and their speculation metrics added up, and per choice its accepted
    lengths, rounds, seed and speculation metrics (``GenerationStats.speculation``)."""
    per = []
    rounds = committed = 0
    total = dict.fromkeys(SUMMED, 0)
    for c, seed in zip(choices, job.seeds, strict=True):
        s = c.result.stats if c.result is not None else None
        acc = list(s.accept_lengths) if s is not None else []
        r = s.rounds if s is not None else 0
        rounds += r
        committed += r + sum(acc)
        spec = s.speculation() if s is not None else None
        if spec is not None:
            for k in SUMMED:
                total[k] += spec[k]
        per.append({"rounds": r, "accept_lengths": acc, "tau": (r + sum(acc)) / r if r else None, "seed": seed,
                    "runtime_finish_reason": c.result.finish_reason if c.result is not None else None,
                    "speculation": spec})
    done = total["spec_rounds"] + total["plain_rounds"]
    total["spec_share"] = total["spec_rounds"] / done if done else None
    total["acceptance_rate"] = total["accepted_tokens"] / total["drafted_tokens"] if total["drafted_tokens"] else None
    return {"tau": committed / rounds if rounds else None, "tree": job.tree.to_dict() if job.tree else None,
            "speculation": total, "choices": per}

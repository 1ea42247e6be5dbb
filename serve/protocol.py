"""The OpenAI request bodies the server accepts, and its OpenAI-style error bodies.

Requests are validated strictly (pydantic, ``extra="forbid"``, no string-to-number coercion): an unknown field or a
field of the wrong type is a 400 ``invalid_request_error`` naming the field, never a silent default. EAGLE's tree
settings ride in the extension field ``eagle``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from eagle_export.runtime.logprobs import MAX_TOP_LOGPROBS

# OpenAI's own bounds (temperature 0..2, n and stop lists); the runtime checks the rest (tree limits, capacity).
MAX_N = 16
MAX_STOP = 4


def _unicode(v: str) -> str:
    """JSON may carry a lone surrogate (``"\\ud800"``): no tokenizer can encode it, so it is a bad request."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (it holds a lone surrogate code point)") from None
    return v


# every string the server hands to the tokenizer or compares with generated text
Text = Annotated[StrictStr, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EagleOptions(_Strict):
    """Extension field ``eagle``: the tree of this request (defaults: the artifact's), plain decoding, EOS."""

    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    depth: Annotated[StrictInt, Field(ge=0)] | None = None
    total_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    threshold: Annotated[StrictFloat | StrictInt, Field(ge=0, le=1)] | None = None
    no_draft: StrictBool = False
    ignore_eos: StrictBool = False


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Generation(_Strict):
    model: Text
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1)] = 1.0
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    eagle: EagleOptions | None = None
    # OpenAI fields this server does not implement, accepted only at their neutral value (many clients send them
    # that way); any other value is a 400 naming the field, never silently ignored
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, v):
        if v not in (None, 0, {}):
            raise ValueError("not supported by this server (only its neutral value: 0, null or {})")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream", False):  # OpenAI answers 400 too
            raise ValueError("only allowed when stream is true")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


# top alternatives per token (OpenAI caps chat's top_logprobs at 20 and the legacy logprobs at 5; both take 20 here)
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class CompletionRequest(_Generation):
    """POST /v1/completions: ``prompt`` is text, or token ids (a list of integers)."""

    prompt: Text | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
    # N (0 included): each generated token's log-probability and its N most likely alternatives
    logprobs: TopLogprobs | None = None

    def top_logprobs_asked(self) -> int | None:
        """None: no log-probabilities; N: with N alternatives per token."""
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """A message's content is text, or a list of text parts (joined); other part types are refused."""

    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: ``messages`` go through the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):  # OpenAI answers 400 too
            raise ValueError("only allowed when logprobs is true")
        return v

    def top_logprobs_asked(self) -> int | None:
        """None: no log-probabilities; N: with N alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line (and the offending parameter) from pydantic/FastAPI validation errors."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # a union's member name (e.g. 'str', 'list[int]') is noise in the path the client sees
    path = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool",
                                                                                   "function-after"))
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        msg = "unknown field (not supported by this server)"
    elif e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{path}: {msg}{more}" if path else f"{msg}{more}"), (path or None)

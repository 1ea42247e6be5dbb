"""The OpenAI request bodies the server accepts, and its OpenAI-style error bodies.

Requests are validated strictly (pydantic, ``extra="forbid"``, no string-to-number coercion): an unknown field or a
field of the wrong type is a 400 ``invalid_request_error`` naming the field, never a silent default. EAGLE's tree
settings ride in the extension field ``eagle``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

# OpenAI's own bounds (temperature 0..2, n and stop lists); the runtime checks the rest (tree limits, capacity).
MAX_N = 16
MAX_STOP = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EagleOptions(_Strict):
    """Extension field ``eagle``: the tree of this request (defaults: the artifact's), plain decoding, EOS."""

    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    depth: Annotated[StrictInt, Field(ge=0)] | None = None
    total_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    no_draft: StrictBool = False
    ignore_eos: StrictBool = False


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Generation(_Strict):
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1)] = 1.0
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    eagle: EagleOptions | None = None
    # OpenAI fields this server does not implement, accepted only at their neutral value (many clients send them
    # that way); any other value is a 400 naming the field, never silently ignored
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict | None = None
    logprobs: StrictBool | StrictInt | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
    @classmethod
    def _neutral(cls, v):
        if v not in (None, 0, False, {}):
            raise ValueError("not supported by this server (only its neutral value: 0, false, null or {})")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class CompletionRequest(_Generation):
    """POST /v1/completions: ``prompt`` is text, or token ids (a list of integers)."""

    prompt: StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    """A message's content is text, or a list of text parts (joined); other part types are refused."""

    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: ``messages`` go through the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


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

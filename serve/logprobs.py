"""OpenAI's two ``logprobs`` shapes from the runtime's ``TokenLogprob`` entries (one per generated token).

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps token text to log-prob for the N most likely tokens plus the chosen one (so up to N + 1
keys, as OpenAI's). Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [N x {"token", "logprob",
"bytes"}]}], "refusal": null}``. A token's text is its own decoding (special tokens included); a token that holds
part of a multi-byte character decodes to U+FFFD, and its ``bytes`` are those of that text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eagle_export.runtime.logprobs import TokenLogprob

_FLOOR = -9999.0  # JSON has no -inf: a log-prob that underflowed reads as this (vLLM's convention)


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], text_of: Callable[[int], str], offset: int = 0) -> dict:
    """The legacy shape; ``offset`` is the character offset of the first token in the choice's text."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        t = text_of(e.token)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
        top: dict[str, float] = {}
        for tok, lp in e.top:
            top.setdefault(text_of(tok), _lp(lp))
        top.setdefault(t, _lp(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: Callable[[int], str]) -> dict:
    def one(tok: int, lp: float) -> dict:
        t = text_of(tok)
        return {"token": t, "logprob": _lp(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def text_length(entries: Sequence[TokenLogprob], text_of: Callable[[int], str]) -> int:
    """Characters the tokens' own texts add (the next chunk's ``text_offset``)."""
    return sum(len(text_of(e.token)) for e in entries)

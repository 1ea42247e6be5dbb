"""Streamed text: each new piece printed once, an incomplete trailing character held back until it completes.

Byte-level BPE (and SentencePiece's byte fallback) can split one multi-byte UTF-8 character across tokens;
decoding a prefix that ends inside it gives U+FFFD (byte-level BPE: one for the unfinished character; byte
fallback: one for every byte of the trailing run of byte tokens, finished characters included). Printing that
and moving on would leave replacement characters in the output for good; like transformers' ``TextStreamer``,
this holds the trailing U+FFFD run back and prints it with the token that completes it (or at the end, as
decoded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns committed token ids into the text to print next, decoding the whole output each time."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._tokens: list[int] = []
        self._printed = 0  # characters of the decoded text already returned

    def push(self, tokens: Iterable[int]) -> str:
        """The printable text the new tokens add (possibly empty)."""
        self._tokens.extend(int(t) for t in tokens)
        text = self._decode(self._tokens)
        return self._take(text, len(text.rstrip(REPLACEMENT)))

    def flush(self) -> str:
        """Everything not printed yet, at the end of the generation (a character that never completed stays
        U+FFFD: the output really ends inside it)."""
        text = self._decode(self._tokens)
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        piece = text[self._printed:end]
        self._printed = max(self._printed, end)
        return piece

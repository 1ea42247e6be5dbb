"""Text beside token ids for the runtime's streams: each committed round as a ``StreamChunk``.

The text is cut as the CLI prints it (eagle_export/text_stream.py): a character split across tokens is held back
until the token that completes it, so printing every chunk's ``text`` in order gives the result's text, never a
stray U+FFFD.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from eagle_export.text_stream import TextStream


@dataclass(frozen=True)
class StreamChunk:
    """One round's output: the token ids it committed, and the text they add (``""`` while a character is
    incomplete; None when the artifact has no tokenizer). A last chunk with no tokens may carry text held back."""

    tokens: list[int]
    text: str | None


Decode = Callable[[list[int]], "str | None"]


class _Texts:
    """Turns successive token lists into chunks (one per stream, in order)."""

    def __init__(self, decode: Decode | None):
        has_text = decode is not None and decode([]) is not None
        self._text = TextStream(lambda ids: decode(ids) or "") if has_text else None

    def chunk(self, tokens: list[int]) -> StreamChunk:
        return StreamChunk(tokens, None if self._text is None else self._text.push(tokens))

    def last(self) -> StreamChunk | None:
        rest = None if self._text is None else self._text.flush()
        return StreamChunk([], rest) if rest else None


def chunks(token_lists: Iterable[list[int]], decode: Decode | None) -> Iterator[StreamChunk]:
    texts = _Texts(decode)
    for tokens in token_lists:
        yield texts.chunk(tokens)
    last = texts.last()
    if last is not None:
        yield last


async def achunks(token_lists: AsyncIterator[list[int]], decode: Decode | None) -> AsyncIterator[StreamChunk]:
    texts = _Texts(decode)
    async for tokens in token_lists:
        yield texts.chunk(tokens)
    last = texts.last()
    if last is not None:
        yield last

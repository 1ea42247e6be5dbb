"""Text of one choice as its rounds arrive: incremental deltas, stop strings, and OpenAI's finish reasons.

Pure bookkeeping (no I/O), shared by streamed and whole responses so both say exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

from eagle_export.text_stream import REPLACEMENT

# the runtime's finish reasons -> OpenAI's
FINISH = {"eos": "stop", "length": "length", "capacity": "length"}


class ChoiceText:
    """Token ids and decoded text of one choice; ``feed`` returns the text that may be sent now.

    A delta never ends in a half-decoded character (U+FFFD at the end waits for the next round), and with stop
    strings the last ``len(longest stop) - 1`` characters wait too, so a stop string split across rounds is never
    sent. When a stop string appears, the text ends before it and ``stopped`` is set."""

    def __init__(self, decode: Callable[[list[int]], str | None], stop: list[str]):
        self._decode = decode
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the choice's text so far (up to a stop string)
        self.sent = 0  # characters of text already handed out
        self.stopped = False
        self.finish_reason: str | None = None
        self.result = None  # the runtime's GenerationResult, when it ended normally

    def _full(self) -> str:
        return self._decode(self.tokens) or ""

    def feed(self, tokens: list[int]) -> str:
        """Take one round's tokens; the delta of text to send now ('' if nothing yet)."""
        if self.finish_reason is not None:
            return ""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._full()
        if self.stop:
            start = max(self.sent - self._hold, 0)
            hits = [(p, s) for s in self.stop if (p := text.find(s, start)) >= 0]
            if hits:
                p = min(hits)[0]
                self.text = text[:p]
                self.stopped, self.finish_reason = True, "stop"
                self.tokens = self.tokens[:self._through_stop(before, start)]
                return self._take(len(self.text))
        self.text = text
        ready = len(text) - self._hold
        while ready > self.sent and text[ready - 1] == REPLACEMENT:  # the rule of eagle_export.text_stream
            ready -= 1
        return self._take(ready)

    def _through_stop(self, before: int, start: int) -> int:
        """Tokens kept when a stop string appeared in this round: up to the one that completes it. A round commits
        several tokens at once, and how many depends on the tree; what is returned and counted must not."""
        for k in range(before + 1, len(self.tokens)):
            text = self._decode(self.tokens[:k]) or ""
            if any(text.find(s, start) >= 0 for s in self.stop):
                return k
        return len(self.tokens)

    def end(self, result) -> str:
        """The runtime's result: the rest of the text, and the finish reason (unless a stop string ended it)."""
        if self.finish_reason is not None:
            return ""
        self.result = result
        if list(result.tokens) != self.tokens:  # the result is the truth (it never differs from the rounds)
            self.tokens = []
            delta = self.feed(list(result.tokens))
            if self.stopped:
                return delta
        self.finish_reason = FINISH.get(result.finish_reason, "stop")
        self.text = self._full() if not self.stop else self.text
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out

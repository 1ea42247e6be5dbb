"""serve/choices.py on a byte-level stand-in tokenizer (each token is some UTF-8 bytes, decoded with errors="replace"
as byte-level BPE decoders do): deltas never carry a half character, a stop string split across rounds is never
sent and cuts the text, finish reasons map to OpenAI's."""

from __future__ import annotations

from types import SimpleNamespace

from eagle_export.serve.choices import ChoiceText

# "naïve 你好": ï and 你 split across tokens
PIECES = [b"na", b"\xc3", b"\xafve ", b"\xe4\xbd", b"\xa0", b"\xe5\xa5\xbd", b" END", b" tail"]


def decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def result(ids, reason="length"):
    return SimpleNamespace(tokens=list(ids), finish_reason=reason)


def test_deltas_hold_back_half_characters_and_add_up():
    c = ChoiceText(decode, [])
    deltas = [c.feed([i]) for i in range(len(PIECES))]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "ïve "  # the lone 0xC3 waited for its second byte
    deltas.append(c.end(result(range(len(PIECES)), "eos")))
    assert "".join(deltas) == decode(list(range(len(PIECES))))
    assert c.finish_reason == "stop" and c.tokens == list(range(len(PIECES)))


def test_stop_string_across_rounds_is_never_sent():
    c = ChoiceText(decode, ["你好 E"])
    out = ""
    for i in range(len(PIECES)):
        out += c.feed([i])
        if c.stopped:
            break
    assert c.stopped and c.finish_reason == "stop"
    assert out == c.text == "naïve "
    assert c.end(result(range(len(PIECES)))) == ""  # the cancelled request's end changes nothing


def test_finish_reasons():
    for reason, want in (("eos", "stop"), ("length", "length"), ("capacity", "length")):
        c = ChoiceText(decode, [])
        c.feed([0])
        c.end(result([0], reason))
        assert c.finish_reason == want


class _Stream:
    """Stands in for a RequestStream: only ``cancel`` is used once the rounds are in the job's queue."""

    cancelled = False

    def cancel(self):
        self.cancelled = True


def test_sse_sends_one_closing_chunk_when_rounds_land_after_a_stop_string():
    """A round committed between the stop string and its cancellation must not reopen or re-close the choice."""
    import asyncio
    import json

    from eagle_export.errors import GenerationError
    from eagle_export.serve.app import _sse
    from eagle_export.serve.engine import Job
    from eagle_export.serve.metrics import ServerMetrics

    async def run():
        stream = _Stream()
        job = Job([stream], 1, asyncio.Queue(), [None], None)
        for item in ([0, 1, 2], [3, 4, 5, 6], [7], GenerationError("the request was cancelled")):
            job.queue.put_nowait((0, item))
        engine = SimpleNamespace(metrics=ServerMetrics(), opts=SimpleNamespace(timeout_s=5))
        loop = asyncio.get_running_loop()
        events = [e async for e in _sse(engine, job, [ChoiceText(decode, ["你好 E"])], {}, False, False,
                                        loop.time() + 5, "/v1/completions")]
        return stream, events

    stream, events = asyncio.run(run())
    assert stream.cancelled and events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    closing = [c for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(closing) == 1 and closing[0]["choices"][0]["finish_reason"] == "stop"
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "naïve "


def test_a_stop_string_keeps_the_tokens_up_to_the_one_that_completes_it():
    """A round commits several tokens; the choice keeps (returns, counts) only those up to the stop string's last
    token, so usage does not depend on how many tokens the tree accepted in that round."""
    whole_round = ChoiceText(decode, ["你好"])
    assert whole_round.feed([0, 1, 2, 3, 4, 5, 6, 7]) == "naïve "
    assert whole_round.stopped and whole_round.tokens == [0, 1, 2, 3, 4, 5]  # 5 completes 好
    one_by_one = ChoiceText(decode, ["你好"])
    for i in range(8):
        one_by_one.feed([i])
        if one_by_one.stopped:
            break
    assert one_by_one.tokens == whole_round.tokens and one_by_one.text == whole_round.text


def _splits(n: int):
    """Every way to cut tokens 0..n-1 into consecutive rounds (2^(n-1) of them)."""
    for cuts in range(2 ** (n - 1)):
        rounds, start = [], 0
        for i in range(1, n):
            if cuts >> (i - 1) & 1:
                rounds.append(list(range(start, i)))
                start = i
        yield [*rounds, list(range(start, n))]


def test_a_stop_string_cuts_at_its_last_token_whatever_the_rounds():
    """Every way the tree could have cut the same tokens into rounds (128 of them), among them the stop string
    completed by the first token of a multi-token round ([.., 4], [5, 6, 7]) and by a round's last one: the
    choice keeps the tokens up to the one that completes it (they are what ``token_ids`` and ``usage`` report),
    the same text, sent once."""
    completes = {"你好": 5, "ïve": 2, "na": 0, "好 END": 6}  # stop string -> the token that completes it
    for stop, last in completes.items():
        seen_first_of_round = False
        for rounds in _splits(len(PIECES)):
            c = ChoiceText(decode, [stop])
            sent = ""
            for r in rounds:
                sent += c.feed(r)
                if c.stopped:
                    seen_first_of_round |= r[0] == last and len(r) > 1
                    break
            sent += c.end(result(range(len(PIECES))))
            assert c.stopped and c.finish_reason == "stop", (stop, rounds)
            assert c.tokens == list(range(last + 1)), (stop, rounds)
            assert sent == c.text == decode(c.tokens).split(stop)[0], (stop, rounds)
        assert seen_first_of_round, stop

"""Streaming text with characters split across tokens: `generate` prints each character once, whole.

Unit: TextStream over the fixture's byte-level BPE and over a SentencePiece-style byte-fallback tokenizer, tokens
pushed one by one and in round-sized chunks. Through the CLI: the bigram pair (tests/bigram.py), whose greedy
output cycles "naïve 你" (both non-ASCII characters split across tokens, several tokens committed per round),
from an ASCII and from a non-ASCII prompt: the streamed stdout must equal the decoded text of `--json`'s tokens.
"""

from __future__ import annotations

import json

import pytest
from cli_run import ok
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer

from eagle_export.text_stream import REPLACEMENT, TextStream
from eagle_export.tools.commands.demo import FIXTURE

TEXT = "naïve 你好 café, Grüße ⚡ 🙂!"


def streamed(decode, ids: list[int], chunk: int) -> list[str]:
    ts = TextStream(decode)
    pieces = [ts.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [ts.flush()]


def byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece's layout (Llama 2, Mistral): '▁' for spaces, <0xNN> byte tokens for what the vocabulary lacks."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ("▁", "n", "a", "v", "e", "▁c", "f", ",", "G", "r", "!"):
        vocab.setdefault(piece, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk


@pytest.fixture(scope="module")
def byte_level():
    return AutoTokenizer.from_pretrained(FIXTURE / "target")


def test_byte_level_bpe_splits_characters_and_the_stream_keeps_them_whole(byte_level):
    ids = byte_level(TEXT, add_special_tokens=False)["input_ids"]
    decode = byte_level.decode
    assert decode(ids) == TEXT
    prefixes = [decode(ids[:i]) for i in range(1, len(ids))]
    split = sum(p.endswith(REPLACEMENT) for p in prefixes)
    assert split >= 5, "the test text must split characters across tokens"
    for chunk in (1, 2, 3, 5):  # one token at a time, and rounds of several accepted tokens
        pieces = streamed(decode, ids, chunk)
        assert "".join(pieces) == TEXT, (chunk, pieces)
        assert not any(REPLACEMENT in p for p in pieces), (chunk, pieces)


def test_byte_fallback_runs_are_held_until_they_decode():
    tk = byte_fallback_tokenizer()
    ids = tk.encode(TEXT.replace(" ", "▁")).ids
    assert tk.decode(ids) == TEXT
    # Byte fallback turns the whole trailing run of byte tokens into U+FFFD, finished characters included.
    assert any(tk.decode(ids[:i]).endswith(REPLACEMENT * 4) for i in range(len(ids)))  # "你" + 1 byte of "好"
    for chunk in (1, 2, 4):
        pieces = streamed(tk.decode, ids, chunk)
        assert "".join(pieces) == TEXT and not any(REPLACEMENT in p for p in pieces), (chunk, pieces)


def test_an_unfinished_character_at_the_end_is_flushed_as_decoded(byte_level):
    ids = byte_level("ok 你", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # the output really ends inside the character
    ts = TextStream(byte_level.decode)
    assert ts.push(cut) == "ok "
    assert ts.flush() == byte_level.decode(cut)[len("ok "):] and ts.flush() == ""
    # A replacement character followed by valid text is printed: only a trailing run is held back.
    ts = TextStream(lambda ids: "".join(map(chr, ids)))
    assert ts.push([0xFFFD]) == "" and ts.push([0x61]) == REPLACEMENT + "a"


@pytest.mark.parametrize("prompt", ["n", "naïve 你na"])
def test_generate_streams_split_characters_whole(bigram, prompt):
    _, art, _ = bigram["text"]
    args = ("generate", art, "--prompt", prompt, "--max-new-tokens", 29, "--ignore-eos")
    out = json.loads(ok(*args, "--json").stdout)
    want = AutoTokenizer.from_pretrained(art).decode(out["tokens"], skip_special_tokens=True)
    assert want.count("你") >= 3 and want.count("ï") >= 3, want  # the cycle's split characters are generated
    assert max(out["stats"]["accept_lengths"]) >= 3  # rounds commit several tokens (chunks of the stream)
    r = ok(*args)
    assert REPLACEMENT not in r.stdout
    assert r.stdout == want + "\n"

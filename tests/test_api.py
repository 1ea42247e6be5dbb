"""The embedding API as a library user meets it: typed keywords, a context manager, a runtime that refuses work
once closed, streams of text beside token ids (sync, and async over the same scheduler), the type marker."""

from __future__ import annotations

import asyncio
import inspect
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle_export.errors import GenerationError
from eagle_export.runtime import EagleRuntime, GenerationStream, RequestStream, SamplingParams, StreamChunk
from eagle_export.text_stream import REPLACEMENT

ROOT = Path(__file__).resolve().parent.parent


def test_a_misspelt_keyword_is_a_type_error_from_generate_itself(tiny):
    with EagleRuntime.open(tiny[2]) as rt:
        for method in (rt.generate, rt.stream, rt.submit):
            with pytest.raises(TypeError, match=rf"{method.__name__}\(\) got an unexpected keyword .*'max_tokens'"):
                method("Hello", max_tokens=8)
        assert rt.generate("Hello", max_new_tokens=3, stop_on_eos=False).text is not None


def test_generate_stream_and_submit_take_the_same_documented_keywords():
    params = {name: inspect.signature(getattr(EagleRuntime, name)).parameters
              for name in ("generate", "stream", "submit")}
    keywords = ["prompt_ids", "messages", "max_new_tokens", "tree", "use_draft", "stop_on_eos", "sampling"]
    doc = inspect.getdoc(EagleRuntime.generate)
    for name, p in params.items():
        assert list(p)[1] == "prompt" and all(p[k].kind is inspect.Parameter.KEYWORD_ONLY for k in keywords), name
        assert all(p[k].annotation != inspect.Parameter.empty for k in ["prompt", *keywords]), name
        assert p["max_new_tokens"].default == 64 and p["use_draft"].default is True, name
    for k in [*keywords, "on_round"]:
        assert f"{k}:" in doc, k  # each one explained in the docstring


def test_with_closes_and_a_closed_runtime_refuses_every_call(tiny):
    with EagleRuntime.open(tiny[2]) as rt:
        assert rt.generate("def f():", max_new_tokens=8).finish_reason in ("eos", "length")
        done = rt.submit("Hello", max_new_tokens=4, stop_on_eos=False)  # finished by close(), not dropped
    assert len(done.wait(0).tokens) == 4
    calls = [lambda: rt.generate("Hello"), lambda: rt.stream(prompt_ids=[1, 2]), lambda: rt.submit("Hello"),
             lambda: rt.encode("Hello"), lambda: rt.decode([1, 2]), lambda: rt.encode_chat([]),
             lambda: rt.scheduler]
    for call in calls:
        with pytest.raises(GenerationError, match="is closed: open a new one"):
            call()
    rt.close()  # twice: a no-op
    assert rt.generator is None and rt.backend is None  # the graphs and buffers are released


def _check_chunks(chunks: list[StreamChunk], result):
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert [t for c in chunks for t in c.tokens] == result.tokens
    assert "".join(c.text for c in chunks) == result.text
    assert all(REPLACEMENT not in c.text for c in chunks)  # a character split across tokens comes out whole
    assert sum(bool(c.text) for c in chunks) > 1  # streamed, not all at the end


def test_chunks_give_text_beside_ids_with_split_characters_whole(bigram):
    _, art, _ = bigram["text"]  # its output cycles "naïve 你", two characters split across tokens
    kw = dict(max_new_tokens=29, stop_on_eos=False)
    with EagleRuntime.open(art) as rt:
        want = rt.generate("n", **kw)
        assert want.text.count("你") >= 3 and want.text.count("ï") >= 3
        stream = rt.stream("n", **kw)
        assert isinstance(stream, GenerationStream) and stream.result is None  # None until the stream ends
        chunks = list(stream.chunks())
        assert stream.result.tokens == want.tokens
        _check_chunks(chunks, want)
        sub = rt.submit("n", **kw)
        assert isinstance(sub, RequestStream)
        _check_chunks(list(sub.chunks()), sub.result)
        assert sub.result.tokens == want.tokens


def test_async_streams_over_the_scheduler(bigram):
    _, art, _ = bigram["text"]
    kw = dict(max_new_tokens=29, stop_on_eos=False)

    async def consume(rt):
        a, b, c = (rt.submit("n", **kw) for _ in range(3))
        await asyncio.sleep(0.3)  # rounds may be pushed before the loop starts listening: none may be lost
        chunks = [ch async for ch in a.achunks()]
        ids = [t async for tokens in b for t in tokens]
        return chunks, a.result, ids, await c.aresult()

    with EagleRuntime.open(art, max_batch=1) as rt:
        want = rt.generate("n", **kw)
        chunks, a_result, b_ids, c_result = asyncio.run(asyncio.wait_for(consume(rt), 120))  # lost: no hang
    _check_chunks(chunks, want)
    assert a_result.tokens == want.tokens and b_ids == want.tokens and c_result.tokens == want.tokens


def test_chunks_hand_over_the_text_held_back_when_the_stream_ends(bigram):
    """A stream cut inside a character: after the prompt "na" (its two tokens, no BOS) the bigram pair writes
    "ïve 你naïve 你...", so 11 tokens end on the first byte of the second "ï", and the capacity (128: 126 tokens
    after the prompt) ends on the first of the three bytes of a "你". The text held back (the unfinished
    character, as decoded) is handed over in a last chunk without tokens, by ``chunks()`` (``stream`` and
    ``submit``) and ``achunks()``."""
    _, art, cycle = bigram["text"]
    na = cycle[:2]
    with EagleRuntime.open(art) as rt:
        for n, reason in ((11, "length"), (200, "capacity")):
            kw = dict(prompt_ids=na, max_new_tokens=n, stop_on_eos=False)
            want = rt.generate(**kw)
            assert want.finish_reason == reason and want.text.endswith(REPLACEMENT), want.text
            assert not rt.decode(want.tokens[:-1]).endswith(REPLACEMENT)  # one character left unfinished

            async def consume(kw=kw):
                return [ch async for ch in rt.submit(**kw).achunks()]

            for how, chunks in (("stream", list(rt.stream(**kw).chunks())), ("submit", list(rt.submit(**kw).chunks())),
                                ("achunks", asyncio.run(asyncio.wait_for(consume(), 120)))):
                assert [t for c in chunks for t in c.tokens] == want.tokens, how
                assert "".join(c.text for c in chunks) == want.text, how
                assert chunks[-1].tokens == [] and chunks[-1].text.endswith(REPLACEMENT), how


def test_async_stream_raises_the_requests_error(plain_runtime):
    async def run():
        s = plain_runtime.submit(prompt_ids=[10_000])  # outside the vocabulary: this request fails alone
        return [t async for t in s]

    with pytest.raises(GenerationError, match="vocabulary"):
        asyncio.run(run())


@pytest.fixture
def plain_runtime(models):
    with EagleRuntime.open(models("mha")[2]) as rt:
        yield rt


def test_chunks_without_a_tokenizer_have_no_text(plain_runtime):
    sp = SamplingParams(temperature=0.8, seed=3)
    chunks = list(plain_runtime.stream(prompt_ids=[1, 2, 3], max_new_tokens=8, stop_on_eos=False,
                                       sampling=sp).chunks())
    assert chunks and all(c.text is None for c in chunks)
    assert [t for c in chunks for t in c.tokens] == plain_runtime.generate(
        prompt_ids=[1, 2, 3], max_new_tokens=8, stop_on_eos=False, sampling=sp).tokens


def test_the_wheel_ships_the_type_marker(tmp_path):
    """PEP 561: a type checker uses the package's hints only when ``eagle_export/py.typed`` is installed."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "fixture", "tests", "docs", "build",
                                                             "*.egg-info", "__pycache__", "demo", "artifacts"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("eagle_export-*.whl")
    assert "eagle_export/py.typed" in zipfile.ZipFile(wheel).namelist()

"""Log-probabilities: the runtime's per-token entries and the server's two OpenAI shapes (legacy completions
``logprobs: N``; chat ``logprobs: true`` + ``top_logprobs: N``), whole and streamed, read with the official
``openai`` client.

Every value is checked against transformers on the original checkpoint: the log-softmax of the target's logits at
the position before each generated token, for the very tokens the runtime committed. A draft's log-probs, a verify
row off by one (the accepted node instead of its parent), another slot's rows or the processed (temperature /
top-p) distribution all fail here: the requests run two at a time (slot 1's rows start past slot 0's), accept
draft tokens (several rows per round), and one of them samples.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from live_server import LiveServer, sse_events
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoModelForCausalLM

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.sampling import SamplingParams
from eagle_export.serve import ServeOptions
from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE

MODEL = "tiny"
TOL = 2e-4  # ONNX Runtime's fp32 graph against transformers' eager fp32 forward


@pytest.fixture(scope="module")
def pair(models):
    """(target checkpoint, artifact): the serve tests' tiny model (batch range 4, capacity 512)."""
    target, _, art = models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE, max_batch=4,
                            max_seq_len=512)
    return target, art


@pytest.fixture(scope="module")
def reference(pair):
    """prompt ids, generated ids -> [len(generated), V] float64 log-softmax of the target's logits (transformers)."""
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32, attn_implementation="eager").eval()

    @torch.no_grad()
    def logprobs(prompt: list[int], tokens: list[int]) -> np.ndarray:
        logits = model(torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0, len(prompt) - 1:]
        return torch.log_softmax(logits.double(), -1).numpy()

    return logprobs


def _check_entries(entries, tokens: list[int], ref: np.ndarray, top: int) -> None:
    assert [e.token for e in entries] == tokens
    for i, e in enumerate(entries):
        assert abs(e.logprob - ref[i, e.token]) < TOL, (i, e.logprob, ref[i, e.token])
        assert len(e.top) == top
        want = np.sort(ref[i])[::-1][:top]
        assert np.allclose([lp for _, lp in e.top], want, atol=TOL), (i, e.top, want)
        assert all(abs(lp - ref[i, t]) < TOL for t, lp in e.top)


def test_runtime_logprobs_are_the_targets_verify_distribution(pair, reference):
    rt = EagleRuntime.open(pair[1], max_batch=2, guard=False)  # every round drafts: rounds of several rows
    try:
        prompts = [rt.encode(p) for p in ("def main():", "class A:", "import os")]
        cases = [  # (prompt, top N, use_draft, sampling): two at a time, so slot 1 reads rows past slot 0's
            (prompts[0], 3, True, None),
            (prompts[1], 0, True, SamplingParams(0.8, 0.9, 0, 14)),  # raw distribution, not the processed one
            (prompts[2], 2, False, None),  # plain decoding: the root's row each step
        ]
        streams = [rt.submit(prompt_ids=p, max_new_tokens=40, stop_on_eos=False, use_draft=d, sampling=sp,
                             logprobs=n) for p, n, d, sp in cases]
        plain = rt.submit(prompt_ids=prompts[0], max_new_tokens=8, stop_on_eos=False)  # did not ask: nothing kept
        results = [s.wait() for s in streams]
        assert plain.wait().tokens and plain.logprobs == []
        for (p, n, _, _), s, r in zip(cases, streams, results, strict=True):
            _check_entries(s.logprobs, r.tokens, reference(list(p), r.tokens), n)
        # the drafted requests accepted draft tokens: rounds of several rows each were read
        assert sum(results[0].stats.accept_lengths) > 0 and sum(results[1].stats.accept_lengths) > 0
    finally:
        rt.close()


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(ServeOptions(str(pair[1]), model_name=MODEL, max_queue=16, timeout_s=60, guard=False)) as s:
        yield s


def _client(s: LiveServer) -> OpenAI:
    return OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"eagle": {"ignore_eos": True}})


def test_completions_logprobs_whole_and_streamed(server, reference):
    client = _client(server)
    rt = server.engine.rt
    prompt = "def main():"
    whole = client.completions.create(prompt=prompt, logprobs=3, **GREEDY).choices[0]
    ids = whole.model_extra["token_ids"]
    ref = reference(rt.encode(prompt), ids)
    lp = whole.logprobs
    texts = [server.engine.token_text(t) for t in ids]
    assert lp.tokens == texts  # each token's own text, special tokens included
    assert np.allclose(lp.token_logprobs, [ref[i, t] for i, t in enumerate(ids)], atol=TOL)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in texts[:-1]]))
    for i, top in enumerate(lp.top_logprobs):  # the 3 most likely, plus the chosen token when not among them
        best = np.argsort(ref[i])[::-1][:3]
        assert set(top) == {texts[i]} | {server.engine.token_text(int(t)) for t in best}, (i, top)
        assert top[texts[i]] == pytest.approx(ref[i, ids[i]], abs=TOL)
    # streamed: each chunk's logprobs are its token_ids', and they add up to the whole response's
    tokens, values, offsets, n_chunks = [], [], [], 0
    for c in client.completions.create(prompt=prompt, logprobs=3, stream=True, **GREEDY):
        ch = c.choices[0]
        ids_c = ch.model_extra.get("token_ids") or []
        if not ids_c:
            assert ch.logprobs is None
            continue
        n_chunks += 1
        assert len(ch.logprobs.tokens) == len(ids_c)
        tokens += ch.logprobs.tokens
        values += ch.logprobs.token_logprobs
        offsets += ch.logprobs.text_offset
    assert n_chunks > 1 and tokens == lp.tokens and offsets == lp.text_offset
    assert np.allclose(values, lp.token_logprobs, atol=1e-9)
    # logprobs 0: the chosen tokens' own log-probabilities (not null)
    zero = client.completions.create(prompt=prompt, logprobs=0, **GREEDY).choices[0].logprobs
    assert zero.token_logprobs == pytest.approx(lp.token_logprobs) and all(len(t) == 1 for t in zero.top_logprobs)


def test_chat_logprobs_whole_and_streamed(server, reference):
    client = _client(server)
    rt = server.engine.rt
    msgs = [{"role": "user", "content": "class A:"}]
    whole = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=4, **GREEDY).choices[0]
    ids = whole.model_extra["token_ids"]
    ref = reference(rt.encode_chat(msgs), ids)
    content = whole.logprobs.content
    assert [e.token for e in content] == [server.engine.token_text(t) for t in ids]
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(ref[i, ids[i]], abs=TOL)
        assert e.bytes == list(e.token.encode())
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(np.sort(ref[i])[::-1][:4], abs=TOL)
    streamed = []
    for c in client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=4, stream=True, **GREEDY):
        ch = c.choices[0]
        if ch.logprobs is not None:
            assert len(ch.logprobs.content) == len(ch.model_extra["token_ids"])
            streamed += ch.logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # logprobs without top_logprobs: the chosen tokens only; without logprobs: null
    bare = client.chat.completions.create(messages=msgs, logprobs=True, **GREEDY).choices[0].logprobs.content
    assert [e.logprob for e in bare] == [e.logprob for e in content] and all(e.top_logprobs == [] for e in bare)
    assert client.chat.completions.create(messages=msgs, **GREEDY).choices[0].logprobs is None
    # the raw bodies against the client's own types, validated (the client itself builds them without checking)
    with server.client() as h:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        ChatCompletion.model_validate(h.post("/v1/chat/completions", json={**body, "messages": msgs}).json())
        with h.stream("POST", "/v1/chat/completions", json={**body, "messages": msgs, "stream": True}) as r:
            for e in sse_events(r.iter_lines())[:-1]:
                ChatCompletionChunk.model_validate(e)
        Completion.model_validate(h.post("/v1/completions", json={
            "model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": 2, "prompt": "hi"}).json())


def test_logprobs_with_n_and_bad_values(server, reference):
    rt = server.engine.rt
    with server.client() as h:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 12, "n": 2, "temperature": 0.9, "seed": 3,
                "logprobs": 1}
        r = h.post("/v1/completions", json=body).json()
        for ch in r["choices"]:  # each choice's own sampled tokens, under the raw distribution
            ref = reference(rt.encode("hello there"), ch["token_ids"])
            assert np.allclose(ch["logprobs"]["token_logprobs"], [ref[i, t] for i, t in enumerate(ch["token_ids"])],
                               atol=TOL)
        # a streamed n=2 request through plain SSE: each chunk's entries belong to its own choice
        got: dict[int, list[float]] = {0: [], 1: []}
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for e in sse_events(s.iter_lines())[:-1]:
                for ch in e["choices"]:
                    if ch["logprobs"] is not None:
                        got[ch["index"]] += ch["logprobs"]["token_logprobs"]
        assert got == {i: r["choices"][i]["logprobs"]["token_logprobs"] for i in (0, 1)}
        for bad, param in (({"prompt": "hi", "logprobs": 21}, "logprobs"),
                           ({"prompt": "hi", "logprobs": -1}, "logprobs"),
                           ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
                           ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                            "top_logprobs")):
            path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
            r = h.post(path, json={"model": MODEL, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_concurrent_logprob_requests_keep_their_own_rows(server, reference):
    """Four greedy requests at once (a batch of four): each one's entries match its own prompt's reference."""
    rt = server.engine.rt
    client = _client(server)
    prompts = ["def main():", "import os", "hello there", "class A:"]
    out: dict[str, object] = {}

    def run(p: str) -> None:
        out[p] = client.completions.create(prompt=p, logprobs=2, **GREEDY).choices[0]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in prompts:
        ids = out[p].model_extra["token_ids"]
        ref = reference(rt.encode(p), ids)
        assert np.allclose(out[p].logprobs.token_logprobs, [ref[i, t] for i, t in enumerate(ids)], atol=TOL), p

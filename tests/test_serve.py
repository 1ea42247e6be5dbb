"""`eagle-export serve`: a real server on 127.0.0.1 (uvicorn thread, ephemeral port) talked to with the official
`openai` client and plain HTTP (httpx). Tokens equal the runtime's own `generate` (greedy and seeded sampling,
streamed and whole, completions and chat); 16 concurrent streams stay lossless while /health answers; every bad
request is a 4xx JSON error and the server survives; a client that disconnects frees its slot; API key and the
bounded queue; the CLI command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cli_run import fail, ok
from live_server import LiveServer, metric, sse_events
from openai import OpenAI

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.sampling import SamplingParams
from eagle_export.serve import ServeOptions
from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE

MODEL = "tiny"
PROMPTS = ["def main():", "import os", "hello there", "class A:"]
SEEDED = dict(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def art(models):
    """The conftest tiny model with a chat template, batch range 4, capacity 512."""
    return models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE, max_batch=4,
                  max_seq_len=512)[2]


# The speculation guard is off in the server and the reference alike: its choice of plain or drafting rounds follows
# the round times each runtime measures, so on a loaded machine the two can choose differently (the tokens stay equal,
# the rounds' accept lengths and tau do not), and the tests below compare those too.
@pytest.fixture(scope="module")
def ref(art):
    """The single-sequence runtime (max_batch 1): what the server must reproduce."""
    rt = EagleRuntime.open(art, guard=False)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def server(art):
    with LiveServer(ServeOptions(str(art), model_name=MODEL, max_queue=64, timeout_s=60, guard=False)) as s:
        yield s


def _ref(rt, prompt=None, messages=None, max_tokens=24, sampling=None, ignore_eos=False, seed_offset=0):
    sp = None
    if sampling:
        sp = SamplingParams(sampling["temperature"], sampling["top_p"], 0, sampling["seed"] + seed_offset)
    return rt.generate(prompt, messages=messages, max_new_tokens=max_tokens, sampling=sp, stop_on_eos=not ignore_eos)


def _openai(server, **kw) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=60, **kw)


def _settings(sampling):
    return dict(SEEDED) if sampling else dict(temperature=0)


# ---- exactly generate's tokens -----------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_client_equals_generate(server, ref, chat, stream, sampled):
    client = _openai(server)
    for prompt in PROMPTS[:2]:
        msgs = [{"role": "user", "content": prompt}]
        want = _ref(ref, None if chat else prompt, msgs if chat else None, 24, SEEDED if sampled else None)
        kw = dict(model=MODEL, max_tokens=24, **_settings(sampled))
        kw.update(messages=msgs) if chat else kw.update(prompt=prompt)
        create = client.chat.completions.create if chat else client.completions.create

        def call(**k):
            return create(**kw, **k)  # noqa: B023 - called within this iteration
        if not stream:
            r = call()
            c = r.choices[0]
            text = c.message.content if chat else c.text
            ids = c.model_extra["token_ids"]
            usage = r.usage
            eagle = r.model_extra["eagle"]
        else:
            text, ids, usage, eagle, rounds = "", [], None, None, 0
            for ch in call(stream=True, stream_options={"include_usage": True}):
                if ch.choices:
                    c = ch.choices[0]
                    part = c.delta.content if chat else c.text
                    text += part or ""
                    ids += c.model_extra.get("token_ids") or []
                    rounds += bool(c.model_extra.get("token_ids"))
                else:
                    usage, eagle = ch.usage, ch.model_extra["eagle"]
            # one chunk per committed round: prefill's first token, then one per EAGLE round
            assert rounds == want.stats.rounds + 1
        assert ids == want.tokens, (chat, stream, sampled, prompt)
        assert text == want.text
        assert usage.prompt_tokens == want.prompt_len and usage.completion_tokens == len(want.tokens)
        assert eagle["choices"][0]["accept_lengths"] == want.stats.accept_lengths
        assert eagle["tau"] == pytest.approx(want.stats.tau)


def test_n_choices_take_consecutive_seeds_and_stop_strings_cut_text(server, ref):
    client = _openai(server)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, n=3, **SEEDED)
    for i, c in enumerate(r.choices):
        assert c.index == i
        assert c.model_extra["token_ids"] == _ref(ref, PROMPTS[2], max_tokens=16, sampling=SEEDED, seed_offset=i).tokens
    assert [c["seed"] for c in r.model_extra["eagle"]["choices"]] == [7, 8, 9]
    full = _ref(ref, PROMPTS[3], max_tokens=40, ignore_eos=True).text
    stop = full[12:15]
    cut = full[:full.find(stop)]
    body = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0, stop=[stop],
                extra_body={"eagle": {"ignore_eos": True}})
    whole = client.completions.create(**body)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["stop"]
    # chat content as a list of text parts is the joined text
    msgs = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "main():"}]}]
    parts = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    plain = _ref(ref, messages=[{"role": "user", "content": "def main():"}], max_tokens=8)
    assert parts.choices[0].model_extra["token_ids"] == plain.tokens


def test_models_health_metrics(server):
    with server.client() as h:
        models = h.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert h.get("/health").json()["status"] == "ok"
        before = h.get("/metrics").text
        _openai(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                           extra_body={"eagle": {"ignore_eos": True}})
        r = h.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        after = r.text
    for name in ("eagle_generation_tokens_total", "eagle_rounds_total", "eagle_round_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "eagle_generation_tokens_total") - metric(before, "eagle_generation_tokens_total") == 10
    assert metric(after, "eagle_requests_total", endpoint="/v1/completions", status="ok") == \
        metric(before, "eagle_requests_total", endpoint="/v1/completions", status="ok") + 1
    # tau is the bonus-inclusive count over every finished drafting generation, from the same counters it reports
    rounds, accepted = metric(after, "eagle_rounds_total"), metric(after, "eagle_accepted_draft_tokens_total")
    assert metric(after, "eagle_tau") == pytest.approx((accepted + rounds) / rounds)
    assert (metric(after, "eagle_accept_length_count"), metric(after, "eagle_accept_length_sum")) == (rounds, accepted)
    new_rounds = rounds - metric(before, "eagle_rounds_total")
    committed = new_rounds + accepted - metric(before, "eagle_accepted_draft_tokens_total")
    assert 10 - 1 <= committed < 10 - 1 + 8  # this request's 9 tokens after the prefill's, the last round whole
    assert "eagle_queue_depth" in after and "eagle_accept_length_bucket" in after


# ---- many clients at once ------------------------------------------------------------------------


def _stream_ids(h: httpx.Client, prompt: str, max_tokens: int, headers=None, chat=False,
                gate: threading.Barrier | None = None) -> tuple[int, list[int], float]:
    """(status, token ids, seconds to the status line) of one streamed request over plain HTTP (after ``gate``)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "eagle": {"ignore_eos": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if gate is not None:
        gate.wait()
    t0 = time.perf_counter()
    with h.stream("POST", path, json=body, headers=headers) as r:
        first = time.perf_counter() - t0
        if r.status_code != 200:
            r.read()
            return r.status_code, [], first
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
    return 200, ids, first


def test_16_concurrent_streams_lossless_while_health_answers(server, ref):
    want = {p: _ref(ref, p, max_tokens=32, ignore_eos=True).tokens for p in PROMPTS}
    got: list = [None] * 16
    health: list[float] = []

    def client(i):
        with server.client() as h:
            got[i] = _stream_ids(h, PROMPTS[i % 4], 32)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    depth: list[float] = []
    with server.client() as h:
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert h.get("/health", timeout=5).status_code == 200
            health.append(time.perf_counter() - t0)
            depth.append(metric(h.get("/metrics").text, "eagle_queue_depth"))
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        after = h.get("/metrics").text
    assert 0 < max(depth) <= 12, depth  # 16 streams on 4 slots: some waited, never more than 12
    assert metric(after, "eagle_queue_depth") == 0 and metric(after, "eagle_requests_in_flight") == 0
    assert all(g is not None and g[0] == 200 for g in got), got
    assert [g[1] for g in got] == [want[PROMPTS[i % 4]] for i in range(16)]
    assert health and max(health) < 1.0, f"/health took {max(health):.2f} s"
    print(f"\n16 streams: /health answered {len(health)} times while they ran, worst {max(health) * 1e3:.0f} ms")


# ---- bad requests ---------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    ("/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK, "stop": 3}, 400, "stop"),
    ("/v1/completions", {**OK, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {**OK, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {**OK, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {**OK, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [1, 999]}, 400, None),  # an id outside the vocabulary (the runtime)
    ("/v1/completions", {**OK, "prompt": list(range(1, 200)) * 3}, 400, "prompt"),  # 597 tokens > capacity 512
    ("/v1/completions", {**OK, "eagle": {"top_k": 99}}, 400, None),  # over the artifact's tree limits
    ("/v1/completions", {**OK, "eagle": {"top_k": "4"}}, 400, "eagle.top_k"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                    "image_url": "x"}]}]}, 400, None),
    ("/v1/chat/completions", {**CHAT_OK, "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
]


def test_bad_requests_are_4xx_json_and_the_server_survives(server):
    with server.client() as h:
        before = metric(h.get("/metrics").text, "eagle_requests_total", endpoint="/v1/completions",
                        status="bad_request")
        for path, body, status, param in BAD:
            r = h.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        for raw in (b"{not json", b"[1, 2]", b""):
            r = h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"], (raw, r.text)
        stream_bad = h.post("/v1/completions", json={**OK, "stream": True, "max_tokens": 0})
        assert stream_bad.status_code == 400 and "max_tokens" in stream_bad.json()["error"]["message"]
        assert h.get("/v1/nowhere").status_code == 404
        assert h.get("/v1/completions").status_code == 405
        # still serving, and the refusals were counted
        assert h.get("/health").json()["status"] == "ok"
        assert h.post("/v1/completions", json={**OK, "temperature": 0}).status_code == 200
        neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None, "user": "u"}
        assert h.post("/v1/completions", json={**OK, **neutral}).status_code == 200
        after = metric(h.get("/metrics").text, "eagle_requests_total", endpoint="/v1/completions",
                       status="bad_request")
    assert after - before >= sum(1 for p, *_ in BAD if p == "/v1/completions")


def _metrics_when_idle(h, wait_s: float = 10) -> str:
    """/metrics once no request is in flight (or after wait_s): the text to read the counters from."""
    deadline = time.monotonic() + wait_s
    while True:
        text = h.get("/metrics").text
        if metric(text, "eagle_requests_in_flight") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def test_a_client_that_disconnects_frees_its_slot(art):
    """One slot, no queue: a 480-token stream is dropped after two chunks; its slot is free within a few rounds
    (counted as cancelled, far fewer than 480 tokens made) and the next request is served, not refused. The guard is
    off: every round drafts with this random head, so 480 tokens take far longer than the 0.1 s client below (with
    the guard, plain rounds of this tiny model could finish them within it)."""
    with LiveServer(ServeOptions(str(art), model_name=MODEL, max_batch=1, max_queue=0, timeout_s=60,
                                 guard=False)) as s:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "temperature": 0, "stream": True,
                "eagle": {"ignore_eos": True}}
        with s.client() as h:
            with h.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                for line in r.iter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break
            # the connection is closed here
            busy = h.post("/v1/completions", json={**OK, "temperature": 0})
            text = _metrics_when_idle(h)
            assert metric(text, "eagle_requests_in_flight") == 0
            assert metric(text, "eagle_requests_total", endpoint="/v1/completions", status="cancelled") == 1
            made = metric(text, "eagle_generation_tokens_total") - (4 if busy.status_code == 200 else 0)
            assert made < 240, f"{made} tokens made after the client left"
            assert h.post("/v1/completions", json={**OK, "temperature": 0}).status_code == 200
            assert h.get("/health").status_code == 200
            # a whole (non-streamed) request whose client gives up after 0.1 s is cancelled too
            before = metric(h.get("/metrics").text, "eagle_generation_tokens_total")
            with pytest.raises(httpx.ReadTimeout):
                h.post("/v1/completions", json={**body, "stream": False}, timeout=0.1)
            text = _metrics_when_idle(h)
            assert metric(text, "eagle_requests_total", endpoint="/v1/completions", status="cancelled") == 2
            assert metric(text, "eagle_generation_tokens_total") - before < 240


def test_per_request_timeout_cancels_and_answers(art):
    """A 0.3 s timeout: a whole 480-token request gets a 504 JSON error, a streamed one an error event and [DONE];
    both are cancelled (in-flight back to 0) and the server goes on serving. The guard is off: with it, the random
    head's rounds run plain and 480 tokens can finish inside the 0.3 s."""
    with LiveServer(ServeOptions(str(art), model_name=MODEL, max_batch=2, timeout_s=0.3, guard=False)) as s, \
            s.client() as h:
        long = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "temperature": 0, "eagle": {"ignore_eos": True}}
        t0 = time.perf_counter()
        r = h.post("/v1/completions", json=long)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert time.perf_counter() - t0 < 3
        with h.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "timeout"
        deadline = time.monotonic() + 10
        while metric(h.get("/metrics").text, "eagle_requests_in_flight") and time.monotonic() < deadline:
            time.sleep(0.02)
        text = h.get("/metrics").text
        assert metric(text, "eagle_requests_in_flight") == 0
        assert metric(text, "eagle_requests_total", endpoint="/v1/completions", status="timeout") == 2
        assert metric(text, "eagle_generation_tokens_total") < 2 * 480
        assert h.post("/v1/completions", json={**OK, "temperature": 0}).status_code == 200


# ---- safe defaults: API key, bounded queue, body size --------------------------------------------------


def test_api_key_queue_full_and_body_cap(art, ref):
    key = "s3cret"
    opts = ServeOptions(str(art), model_name=MODEL, max_batch=2, max_queue=2, api_key=key, max_body_bytes=4096,
                        timeout_s=60)
    auth = {"authorization": f"Bearer {key}"}
    with LiveServer(opts) as s:
        with s.client() as h:
            assert h.post("/v1/completions", json=OK).status_code == 401
            assert h.post("/v1/completions", json=OK, headers={"authorization": "Bearer nope"}).status_code == 401
            r = h.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert h.get("/metrics").status_code == 401
            assert h.get("/health").status_code == 200
            assert h.get("/v1/models", headers=auth).status_code == 200
            many = h.post("/v1/completions", json={**OK, "n": 5}, headers=auth)  # more than 2 slots + 2 queued
            assert many.status_code == 400 and "n=5" in many.json()["error"]["message"]
            big = h.post("/v1/completions", json={**OK, "prompt": "x" * 5000}, headers=auth)
            assert big.status_code == 413 and big.json()["error"]["message"]
        with pytest.raises(Exception) as e:  # the official client without the key
            _openai(s, api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert getattr(e.value, "status_code", None) == 401
        # 16 clients at once against 2 slots + a queue of 2
        want = {p: _ref(ref, p, max_tokens=48, ignore_eos=True).tokens for p in PROMPTS}
        results: list = [None] * 16
        gate = threading.Barrier(16)

        def client(i):
            with s.client() as h:  # made before the gate: its setup is not part of the 429's time
                results[i] = _stream_ids(h, PROMPTS[i % 4], 48, headers=auth, gate=gate)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = [r[0] for r in results]
        assert set(codes) <= {200, 429}, codes
        assert 1 <= codes.count(200) <= 4 + 12 and codes.count(429) >= 1, codes
        refused = [r[2] for r in results if r[0] == 429]
        assert max(refused) < 1.0, f"a 429 took {max(refused):.2f} s"
        for i, (code, ids, _) in enumerate(results):
            if code == 200:
                assert ids == want[PROMPTS[i % 4]]
        with s.client(headers=auth) as h:
            text = h.get("/metrics").text
        assert metric(text, "eagle_requests_total", endpoint="/v1/completions", status="rejected_queue_full") == \
            codes.count(429)
        assert metric(text, "eagle_requests_in_flight") == 0
        print(f"\n--max-queue 2, 2 slots, 16 clients: {codes.count(200)} served, {codes.count(429)} refused "
              f"(slowest 429 {max(refused) * 1e3:.0f} ms)")


# ---- bench --url -------------------------------------------------------------------------------------


def test_bench_url_reports_the_in_process_figures(server, art):
    """bench --url against the server and bench --concurrency in-process, same prompts and lengths: the same JSON
    keys, the same tokens (lossless both), the same tau (acceptance does not depend on the batch)."""
    args = ["--concurrency", "2", "--requests", "4", "--max-new-tokens", "16", "--json"]
    remote = json.loads(ok("bench", "--url", server.url, *args).stdout)["aggregate"]
    local = json.loads(ok("bench", art, *args, "--no-guard").stdout)["aggregate"]  # as the server runs
    assert set(remote) >= set(local) - {"artifact", "backend", "threads", "peak_rss_mb", "batch_trees"}
    assert set(remote["eagle"]) == set(local["eagle"])
    assert remote["lossless"] and local["lossless"]
    assert remote["eagle"]["tokens"] == local["eagle"]["tokens"] == 4 * 16
    assert remote["tau"] == pytest.approx(local["tau"])
    assert remote["eagle"]["rounds"] > 0 and remote["eagle"]["mean_active"] >= 1
    assert remote["throughput_tokens_per_s"]["eagle"] > 0
    # what only a stream shows: time to first token and inter-token latency, p50 <= p95
    for mode in (remote, remote["no_draft_stream"]):
        for key in ("ttft_s", "inter_token_s"):
            assert 0 < mode[key]["p50"] <= mode[key]["p95"], (key, mode[key])
    assert remote["ttft_s"]["p95"] <= remote["latency_s"]["p95"]
    table = ok("bench", "--url", server.url, "--concurrency", "1", "--requests", "2", "--max-new-tokens", "8").stdout
    assert "TTFT p50/p95 ms" in table and "ITL p50/p95 ms" in table
    fail("bench", "--url", "http://127.0.0.1:9", *args, expect=("no server answers",))
    fail("bench", *args, expect=("give ARTIFACT, or --url",))


# ---- the command line ----------------------------------------------------------------------------------


def test_cli_serve_runs_and_refuses_bad_options(art, tmp_path):
    exe = [sys.executable, "-m", "eagle_export.cli"]
    bad = subprocess.run([*exe, "serve", str(art), "--max-batch", "9"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
    missing = subprocess.run([*exe, "serve", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    env = {**os.environ, "EAGLE_EXPORT_API_KEY": "k1"}
    proc = subprocess.Popen([*exe, "serve", str(art), "--port", "0", "--max-batch", "2"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited"
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert port, "no listening line"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          limits=httpx.Limits(max_connections=16)) as h:
            assert h.get("/v1/models").status_code == 401
            models = h.get("/v1/models", headers={"authorization": "Bearer k1"}).json()
            assert models["data"][0]["id"] == art.name and models["data"][0]["eagle"]["max_batch"] == 2
            auth = {"authorization": "Bearer k1"}
            for path, body, status, _ in BAD:  # the server process survives every bad request
                assert h.post(path, json={**body, "model": art.name} if "model" in body and body["model"] == MODEL
                              else body, headers=auth).status_code == status
            assert proc.poll() is None and h.get("/health").json()["status"] == "ok"
            # SIGTERM with 8 streams running (2 slots, 6 queued): the default drain (the timeout) finishes them all
            done: list = [None] * 8
            started = threading.Semaphore(0)

            def stream(i: int) -> None:
                body = {"model": art.name, "prompt": PROMPTS[i % 4], "max_tokens": 48, "temperature": 0,
                        "stream": True, "eagle": {"ignore_eos": True}}
                try:
                    with h.stream("POST", "/v1/completions", json=body, headers=auth) as r:
                        started.release()
                        done[i] = sse_events(r.iter_lines())
                except Exception as e:  # noqa: BLE001 - a reset is what this looks for
                    done[i] = repr(e)

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for _ in threads:
                assert started.acquire(timeout=60)
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(120)
            for events in done:
                assert isinstance(events, list) and events[-1] == "[DONE]", events
                assert [ch["finish_reason"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]] == \
                    ["length"], events[-3:]
            assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has stopped
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize("missing, extra, args", [("fastapi", "serve", []), ("ray", "ray", ["--ray"])])
def test_cli_serve_without_its_extra_is_one_line(art, missing, extra, args):
    code = (f"import sys; sys.modules[{missing!r}] = None; from eagle_export.cli import main; "
            f"main(['serve', {str(art)!r}, *{args!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error:") and f"pip install 'eagle-export[{extra}]'" in r.stderr


def test_cli_help_names_the_options():
    from click.testing import CliRunner

    from eagle_export.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"]).output
    for opt in ("--host", "--port", "--max-batch", "--max-queue", "--api-key", "--timeout", "--max-prompt-tokens",
                "--max-body-bytes", "--ray", "--replicas", "--backend", "--drain-timeout", "--header-timeout",
                "--body-timeout", "--replica-header"):
        assert opt in out, opt

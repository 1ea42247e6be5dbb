"""`eagle-export bench --url URL --concurrency N`: the concurrency bench against a running `eagle-export serve`.

    from eagle_export.tools.commands.bench.http import bench_http
    report = bench_http("http://127.0.0.1:8000", concurrency=[1, 4], requests=8)
    print(report.format())            # or json.dumps(report.to_dict())

The same closed loop as ``bench --concurrency`` (bench/concurrency.py), with HTTP clients: for each N, N
client threads send M greedy streamed requests (EOS ignored) one after another, first with EAGLE, then with the
``eagle.no_draft`` extension (batched plain decoding on the same server); one warm-up pass of each mode first.
The figures are computed the same way (its ``percentile``) from what the server returns and exports:

- throughput: generated tokens (``usage.completion_tokens``) / the pass's wall time;
- latency: per request, send to the end of the stream (``[DONE]``), p50 and p95;
- TTFT: per request, send to the first chunk with a token, p50 and p95;
- inter-token latency: per request, (time of its last token's chunk - its first's) / (tokens - 1), p50 and p95
  (EAGLE commits several tokens per round, so the gaps between single tokens are bursty; this is their mean);
- tau: from the ``eagle`` extension's accepted lengths of every request;
- rounds and sequences per round: from /metrics (``eagle_round_seconds_count``, ``eagle_round_sequences``) over
  the pass, so only exact when nothing else uses the server meanwhile;
- lossless: every request's EAGLE ``token_ids`` equal its no-draft ones.

What the server does not expose is reported as None: the draft / target / host split of the time and the padding
share (run ``bench --concurrency`` on the artifact for those). N is the client concurrency; the server's batch is
what it was started with (``serve --max-batch``), which /v1/models reports.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export.prompts import PromptSpec, read_prompts

from . import BenchError, builtin_prompts
from .concurrency import Level, ModeFigures, percentile, run_clients


@dataclass
class StreamTimes:
    """What only a streamed response shows: per request, time to first token and mean inter-token latency (s)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        def pq(v: list[float]) -> dict:
            return {"p50": percentile(v, 50) if v else None, "p95": percentile(v, 95) if v else None}

        return {"ttft_s": pq(self.ttft), "inter_token_s": pq(self.itl)}


def _ms(values: list[float], q: int) -> str:
    return f"{percentile(values, q) * 1e3:.1f}" if values else "-"


@dataclass
class HttpReport:
    url: str
    model: str
    server_max_batch: int
    max_new_tokens: int
    tree: dict | None  # the tree settings sent (the rest: the server's defaults)
    levels: list[Level] = field(default_factory=list)
    times: list[tuple[StreamTimes, StreamTimes]] = field(default_factory=list)  # per level: (EAGLE, no-draft)

    def _level(self, k: int) -> dict:
        out = self.levels[k].aggregate()
        e, n = self.times[k]
        out.update(e.to_dict())
        out["no_draft_stream"] = n.to_dict()
        return out

    def to_dict(self) -> dict:
        last = self._level(len(self.levels) - 1)
        last.update({"max_new_tokens": self.max_new_tokens, "tree": self.tree,
                     "url": self.url, "model": self.model, "server_max_batch": self.server_max_batch,
                     "greedy": True, "stop_on_eos": False})
        return {"aggregate": last, "levels": [self._level(k) for k in range(len(self.levels))]}

    def format(self) -> str:
        tree = ("tree " + " ".join(f"{k} {v}" for k, v in self.tree.items())) if self.tree else "the server's tree"
        head = (f"{'N':>3}  {'req':>4}  {'eagle tok/s':>11}  {'no-draft tok/s':>14}  {'p50 s':>6}  {'p95 s':>6}  "
                f"{'TTFT p50/p95 ms':>15}  {'ITL p50/p95 ms':>14}  {'tau':>5}  {'seq/round':>9}  lossless")
        lines = [f"bench --url {self.url} (model {self.model}, server max_batch {self.server_max_batch}; {tree}; "
                 f"{self.max_new_tokens} new tokens per request, greedy, EOS ignored)", "", head, "-" * len(head)]
        for lv, (st, _) in zip(self.levels, self.times, strict=True):
            e, n = lv.eagle, lv.no_draft
            act = f"{e.mean_active:>9.2f}" if e.mean_active is not None else f"{'-':>9}"
            ttft = f"{_ms(st.ttft, 50)}/{_ms(st.ttft, 95)}"
            itl = f"{_ms(st.itl, 50)}/{_ms(st.itl, 95)}"
            lines.append(f"{lv.concurrency:>3}  {lv.requests:>4}  {e.throughput:>11.1f}  {n.throughput:>14.1f}  "
                         f"{percentile(e.latencies, 50):>6.2f}  {percentile(e.latencies, 95):>6.2f}  {ttft:>15}  "
                         f"{itl:>14}  {e.tau:>5.2f}  {act}  {'yes' if lv.lossless else 'NO'}")
        lines += ["", "throughput: generated tokens / wall time of the pass; latency: send to the stream's end per "
                  "request; TTFT: send to the first token; ITL: mean time between tokens within a request (EAGLE "
                  "figures); seq/round from the server's /metrics (host/graph split and padding: not exposed over "
                  "HTTP, see bench --concurrency)"]
        return "\n".join(lines)


def _scrape(client, names: tuple[str, ...]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    if r.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in names and not s.labels:
                out[s.name] = s.value
    return out


_ROUND_NAMES = ("eagle_round_seconds_count", "eagle_round_sequences_sum", "eagle_round_sequences_count")


def _pass(url: str, headers: dict, model: str, work: list[PromptSpec], clients: int, max_new: int,
          eagle: dict) -> tuple[ModeFigures, list[list[int]], StreamTimes]:
    import httpx

    tokens: list[list[int] | None] = [None] * len(work)
    latencies = [0.0] * len(work)
    times = StreamTimes()
    accepts: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    todo = iter(range(len(work)))

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as h:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None or errors:
                    return
                spec = work[i]
                body = {"model": model, "max_tokens": max_new, "temperature": 0, "eagle": eagle, "stream": True,
                        "stream_options": {"include_usage": True}}
                if spec.messages is not None:
                    path, body["messages"] = "/v1/chat/completions", list(spec.messages)
                else:
                    path, body["prompt"] = "/v1/completions", spec.text if spec.text is not None else list(spec.ids)
                t0 = time.perf_counter()
                ids: list[int] = []
                first = last = None
                end = None
                with h.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        with lock:
                            errors.append(f"{spec.source}: HTTP {r.status_code}: {r.text[:300]}")
                        return
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            with lock:
                                errors.append(f"{spec.source}: {chunk['error'].get('message')}")
                            return
                        new = [t for c in chunk["choices"] for t in c.get("token_ids") or []]
                        if new:
                            last = time.perf_counter()
                            first = first or last
                            ids += new
                        if chunk.get("usage") is not None:
                            end = chunk
                latencies[i] = time.perf_counter() - t0
                tokens[i] = ids
                with lock:
                    if first is not None:
                        times.ttft.append(first - t0)
                        if len(ids) > 1:
                            times.itl.append((last - first) / (len(ids) - 1))
                    for c in (end or {}).get("eagle", {}).get("choices", []):
                        accepts.extend(c["accept_lengths"])

    with httpx.Client(base_url=url, headers=headers, timeout=60) as h:
        before = _scrape(h, _ROUND_NAMES)
        wall = run_clients(client, clients)
        after = _scrape(h, _ROUND_NAMES)
    if errors:
        raise BenchError(f"a request failed: {errors[0]}")
    rounds = mean_active = None
    if before and after:
        rounds = int(after["eagle_round_seconds_count"] - before["eagle_round_seconds_count"])
        n = after["eagle_round_sequences_count"] - before["eagle_round_sequences_count"]
        mean_active = (after["eagle_round_sequences_sum"] - before["eagle_round_sequences_sum"]) / n if n else None
    mode = ModeFigures(sum(len(t) for t in tokens), wall, latencies,
                       accepts if eagle.get("no_draft") is not True else [], None, None, rounds, mean_active, None)
    return mode, tokens, times


def bench_http(url: str, *, concurrency: list[int], requests: int | None = None,
               prompts: str | Path | list[PromptSpec] | None = None, max_new_tokens: int = 64,
               tree: dict | None = None, api_key: str | None = None, log=None) -> HttpReport:
    """See the module docstring. tree: ``top_k``/``depth``/``total_tokens`` sent in the ``eagle`` extension (those
    not given: the server's defaults)."""
    import httpx

    if not concurrency or any(not isinstance(n, int) or n < 1 for n in concurrency):
        raise BenchError(f"--concurrency must be integers >= 1, got {concurrency!r}")
    if requests is not None and requests < 1:
        raise BenchError(f"--requests must be >= 1, got {requests}")
    say = log or (lambda msg: None)
    url = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as h:
            r = h.get("/v1/models")
    except httpx.HTTPError as e:
        raise BenchError(f"--url {url}: no server answers there ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise BenchError(f"--url {url}: GET /v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    info = r.json()["data"][0]
    ext = info.get("eagle") or {}
    specs = read_prompts(prompts) if isinstance(prompts, (str, Path)) else prompts
    if specs is None:
        specs = builtin_prompts(ext.get("has_tokenizer", True), ext.get("vocab_size", 2))
    report = HttpReport(url, info["id"], ext.get("max_batch", 0), max_new_tokens, tree)
    eagle = {"ignore_eos": True, **(tree or {})}
    plain = {"ignore_eos": True, "no_draft": True}
    for n in concurrency:
        m = requests or max(2 * max(concurrency), len(specs))
        work = [specs[i % len(specs)] for i in range(m)]
        say(f"N={n}: warm-up")
        for mode in (eagle, plain):
            _pass(url, headers, info["id"], work[:n], n, max_new_tokens, mode)
        say(f"N={n}: {m} EAGLE requests from {n} clients")
        e, e_tokens, e_times = _pass(url, headers, info["id"], work, n, max_new_tokens, eagle)
        say(f"N={n}: {m} no-draft requests from {n} clients")
        nd, nd_tokens, nd_times = _pass(url, headers, info["id"], work, n, max_new_tokens, plain)
        report.levels.append(Level(n, m, e, nd, e_tokens == nd_tokens))
        report.times.append((e_times, nd_times))
        say(f"N={n}: EAGLE {e.throughput:.1f} tok/s, no-draft {nd.throughput:.1f} tok/s, tau {e.tau:.2f}, "
            f"TTFT p50 {_ms(e_times.ttft, 50)} ms, ITL p50 {_ms(e_times.itl, 50)} ms")
    return report

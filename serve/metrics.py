"""Prometheus metrics of one server (its own registry, so several apps in one process never share counters).

Every label value comes from a fixed set: ``endpoint`` is one of ``ROUTES`` or ``other`` (a client cannot create
series by inventing paths), ``status`` one of the outcomes below. Under Ray Serve every sample also carries
``replica`` (Ray's replica id), so a scrape that lands on another replica reads another series instead of a
counter that seems to go backwards.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
GENERATION_ROUTES = ROUTES[:2]

# Rounds of a tiny CPU model take about a millisecond, a large model's on a GPU tens of ms.
_ROUND_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)


def route_label(path: str) -> str:
    """The ``endpoint`` label of a request path: one of ROUTES (``/v1/models/ID`` is ``/v1/models``), else
    ``other``."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"


class ServerMetrics:
    """Requests by endpoint and outcome, tokens, acceptance (tau), queue depth, in-flight requests, round time, and
    per generation route the latency a client sees: time to first token, time per output token, end to end."""

    def __init__(self, max_depth: int = 8, replica: str | None = None):
        r = self.registry = CollectorRegistry()
        self.replica = replica
        self.requests = Counter("eagle_requests", "Requests by endpoint and outcome (ok, cancelled, timeout, "
                                "error, shutdown, rejected_queue_full, bad_request, unauthorized)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("eagle_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("eagle_generation_tokens", "Tokens generated (every choice, cancelled "
                                         "ones included)", registry=r)
        self.rounds = Counter("eagle_rounds", "EAGLE rounds (target forwards after prefill) of finished "
                              "generations that drafted (no_draft ones are not counted)", registry=r)
        self.accepted = Counter("eagle_accepted_draft_tokens", "Draft tokens accepted over those rounds; tau = "
                                "(accepted + rounds) / rounds", registry=r)
        self.accept_length = Histogram("eagle_accept_length", "Draft tokens accepted per round",
                                       buckets=tuple(range(0, max_depth + 2)), registry=r)
        self.tau = Gauge("eagle_tau", "Committed tokens per target forward over every finished generation "
                         "(bonus token included)", registry=r)
        self.queue_depth = Gauge("eagle_queue_depth", "Accepted requests waiting for a batch slot (in flight minus the "
                                 "sequences of the last round)", registry=r)
        self.in_flight = Gauge("eagle_requests_in_flight", "Accepted requests not yet finished (queued or in a "
                               "slot)", registry=r)
        self.round_seconds = Histogram("eagle_round_seconds", "Wall time of one batched round (every active "
                                       "sequence)", buckets=_ROUND_BUCKETS, registry=r)
        self.round_active = Histogram("eagle_round_sequences", "Sequences in one batched round",
                                      buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.ttft = Histogram("eagle_time_to_first_token_seconds", "From a generation request's arrival (its body "
                              "read and checked) to its first generated token", ["endpoint"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("eagle_time_per_output_token_seconds", "Per choice: (time of its last token - time "
                              "of its first) / (tokens - 1), for choices of 2 tokens or more that ran to their end",
                              ["endpoint"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("eagle_request_seconds", "From a generation request's arrival to the end of its "
                             "response, for requests answered in full (status ok)", ["endpoint"],
                             buckets=_E2E_BUCKETS, registry=r)
        for route in GENERATION_ROUTES:  # the series exist (at 0) before the first request
            for h in (self.ttft, self.tpot, self.e2e):
                h.labels(route)
        self._rounds = 0
        self._committed = 0

    def request(self, path: str, status: str) -> None:
        """Count one request's outcome under its bounded route label."""
        self.requests.labels(route_label(path), status).inc()

    def observe_round(self, seconds: float, active: int) -> None:
        self.round_seconds.observe(seconds)
        self.round_active.observe(active)

    def observe_result(self, prompt_tokens: int, stats, drafted: bool = True) -> None:
        """A finished generation's usage and acceptance (``GenerationStats``; acceptance only when it drafted)."""
        self.prompt_tokens.inc(prompt_tokens)
        if not drafted:
            return
        self.rounds.inc(stats.rounds)
        self.accepted.inc(sum(stats.accept_lengths))
        for a in stats.accept_lengths:
            self.accept_length.observe(a)
        self._rounds += stats.rounds
        self._committed += stats.rounds + sum(stats.accept_lengths)
        if self._rounds:
            self.tau.set(self._committed / self._rounds)

    def render(self) -> bytes:
        return generate_latest(_Labelled(self.registry, self.replica) if self.replica else self.registry)


class _Labelled:
    """A registry's metrics with one more label on every sample (``replica``), for ``generate_latest``."""

    def __init__(self, registry: CollectorRegistry, replica: str):
        self.registry, self.replica = registry, replica

    def collect(self):
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": self.replica}, s.value, s.timestamp, s.exemplar)
            yield out

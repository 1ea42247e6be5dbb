"""Prometheus metrics of one server (its own registry, so several apps in one process never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Rounds of a tiny CPU model take about a millisecond, a large model's on a GPU tens of ms.
_ROUND_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServerMetrics:
    """Requests by endpoint and outcome, tokens, acceptance (tau), queue depth, in-flight requests, round time."""

    def __init__(self, max_depth: int = 8):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eagle_requests", "Requests by endpoint and outcome (ok, cancelled, timeout, "
                                "error, rejected_queue_full, bad_request, unauthorized)",
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
        self._rounds = 0
        self._committed = 0

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
        return generate_latest(self.registry)

"""What a generation returns: its tokens, why it stopped, and its statistics (the speculation metrics included).

Kept apart from the loop that fills them (``generator.py``): the API, the scheduler, ``bench`` and the server read
these without the loop's buffers and graph calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def tau(accept_lengths: list[int]) -> float:
    """Committed tokens per target forward (the accepted draft tokens of each round plus its bonus token), over
    the rounds given; 0 without rounds. The one definition: stats, bench and the command line use it."""
    if not accept_lengths:
        return 0.0
    return (sum(accept_lengths) + len(accept_lengths)) / len(accept_lengths)


@dataclass
class GenerationStats:
    rounds: int = 0  # target forwards after prefill (verify rounds, or decode steps with no draft)
    accept_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per round
    draft_forwards: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # First draft position at or past the head's max_position_embeddings (None: never got there). Output stays
    # lossless past it; only acceptance may drop, as the head was not trained there.
    draft_beyond_position_limit: int | None = None
    # The speculation metrics (docs/runtime.md, GenerationStats): how the rounds ran and what they cost.
    spec_rounds: int = 0  # rounds that verified a draft tree (the rest were plain one-token rounds)
    plain_rounds: int = 0  # rounds without a draft: --no-draft, a no-draft default or per-batch row, the guard
    drafted_tokens: int = 0  # draft tokens sent to verification (the verify trees' nodes, root excluded)
    verified_tokens: int = 0  # tokens the target checked in the rounds: each tree with its root, 1 per plain round
    draft_s: float = 0.0  # draft graph time in the rounds (a batched call's time counts for every sequence in it)
    target_s: float = 0.0  # target graph time in the rounds
    host_s: float = 0.0  # the rest of the rounds' wall time (tree, acceptance, commit, binding, Python)
    guard_switches: int = 0  # times the guard turned this request's speculation off
    short_rounds: int = 0  # speculative rounds that drafted the request's short chain (runtime/chain_length.py)
    spec_flags: list[bool] = field(default_factory=list, repr=False)  # per round: did it speculate
    # per speculative round: the draft tokens its verify tree held (a guarded chain's short rounds hold fewer)
    spec_drafts: list[int] = field(default_factory=list, repr=False)

    @property
    def spec_accept_lengths(self) -> list[int]:
        """Draft tokens accepted per speculative round (the plain rounds left out)."""
        return [a for a, f in zip(self.accept_lengths, self.spec_flags, strict=False) if f]

    @property
    def tau(self) -> float:
        """Committed tokens per target forward, bonus token included."""
        return tau(self.accept_lengths)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted, over every round."""
        return sum(self.accept_lengths)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None: nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def spec_share(self) -> float | None:
        """Share of the rounds that speculated (None: no round)."""
        return self.spec_rounds / self.rounds if self.rounds else None

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "tau": self.tau, "accept_lengths": list(self.accept_lengths),
                "draft_forwards": self.draft_forwards, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "draft_beyond_position_limit": self.draft_beyond_position_limit, **self.speculation()}

    def speculation(self) -> dict:
        """The speculation metrics as one object (``generate --json``'s stats, the server's ``eagle`` extension)."""
        return {"spec_rounds": self.spec_rounds, "plain_rounds": self.plain_rounds, "spec_share": self.spec_share,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "verified_tokens": self.verified_tokens, "acceptance_rate": self.acceptance_rate,
                "draft_s": self.draft_s, "target_s": self.target_s, "host_s": self.host_s,
                "guard_switches": self.guard_switches, "short_rounds": self.short_rounds}


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    prompt_len: int
    text: str | None = None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_len, "stats": self.stats.to_dict()}

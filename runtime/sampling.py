"""Sampling settings and the target-distribution processing used by sampled decoding.

Pure numpy, no global random state: the loop creates one ``numpy.random.Generator`` per request
(``SamplingParams.make_rng``) and passes it down, so concurrent generations never share random
state and the same seed, prompt and settings give the same tokens on the same backend.

``process_logits`` turns target logits into the distribution that both the plain sampling path
and EAGLE's acceptance use: temperature, then top-k, then top-p, exactly as transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (in that order, as
``generate`` applies them), computed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from eagle_export.errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (the other settings are then ignored); top_p 1.0 and top_k 0 = no filter.

    seed: the seed of this request's random source (None = fresh OS entropy, not reproducible).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if not _is_real(t) or math.isnan(t):
            raise GenerationError(f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
        if t < 0:
            raise GenerationError(f"temperature must be >= 0 (0 means greedy), got {t!r}")
        if math.isinf(t):
            raise GenerationError(f"temperature must be finite, got {t!r}")
        if not _is_real(p) or math.isnan(p) or not 0 < p <= 1:
            raise GenerationError(f"top_p must be a number in (0, 1] (1 disables it), got {p!r}")
        if not _is_int(k) or k < 0:
            raise GenerationError(
                f"sampling top_k (--top-k-sampling) must be an integer >= 0 (0 disables it), got {k!r}"
            )
        if s is not None and (not _is_int(s) or s < 0):
            raise GenerationError(f"seed must be a non-negative integer (or None for a random one), got {s!r}")
        return self

    def make_rng(self) -> np.random.Generator:
        """A fresh random source for one request."""
        return np.random.default_rng(self.seed)

    def with_seed(self, seed: int | None) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, seed)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def process_logits(logits, params: SamplingParams) -> np.ndarray:
    """Target logits [rows, V] (or [V]) -> float64 probabilities of the same shape.

    Temperature, then top-k (keep every token whose logit is >= the k-th largest, ties kept),
    then top-p (sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p,
    always keep the most likely one), then softmax: the rules of transformers' warpers.
    """
    if params.is_greedy:
        raise ValueError("process_logits needs temperature > 0 (temperature 0 is greedy: take the argmax)")
    x = np.array(logits, dtype=np.float64)  # a copy: the caller's logits are never modified
    squeeze = x.ndim == 1
    if squeeze:
        x = x[None]
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"expected logits of shape [rows, V], got {np.shape(logits)}")
    v = x.shape[1]
    if not np.isfinite(x).all():
        raise GenerationError(
            "the target produced non-finite logits (NaN or inf; an fp16 overflow?): cannot sample from them; "
            "try an fp32 export"
        )
    with np.errstate(over="ignore"):  # an overflow is reported just below, as a clear error
        x /= params.temperature
    if not np.isfinite(x).all():
        raise GenerationError(
            f"temperature {params.temperature!r} is so small that logits / temperature overflows: use a larger "
            "temperature, or 0 for greedy decoding"
        )
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k, axis=1)[:, v - params.top_k, None]
        x[x < kth] = -np.inf
    if params.top_p < 1.0:
        for row in x:
            _top_p(row, params.top_p)
    probs = _softmax(x)
    return probs[0] if squeeze else probs


_TOP_P_FIRST = 256  # tokens sorted in the first try of _top_p


def _top_p(x: np.ndarray, top_p: float) -> None:
    """Set to -inf, in place, the logits TopPLogitsWarper removes from this row.

    The warper sorts the row ascending and drops every token whose cumulative probability is
    <= 1 - top_p (keeping the most likely one). The cumulative probability only grows, so the
    dropped tokens are a prefix of that order: all tokens outside the top m are dropped as soon
    as their total mass is <= 1 - top_p. So only the top m are sorted (m = 256, doubled until
    that holds), instead of the whole vocabulary.
    """
    v = x.shape[0]
    p = np.exp(x - x.max())
    p /= p.sum()
    m = min(v, _TOP_P_FIRST)
    while True:
        if m < v:
            top = np.argpartition(p, v - m)[v - m:]
            rest = p.sum() - p[top].sum()  # mass of the tokens outside the top m
            if rest > 1.0 - top_p:  # some of them would be kept: look at more tokens
                m = min(v, 4 * m)
                continue
        else:
            top, rest = np.arange(v), 0.0
        order = top[np.argsort(p[top], kind="stable")]  # ascending
        cum = rest + np.cumsum(p[order])
        drop = cum <= 1.0 - top_p
        drop[-1] = False  # min_tokens_to_keep = 1: the most likely token stays
        if m < v:
            keep = np.ones(v, dtype=bool)
            keep[top] = False  # everything outside the top m is dropped ...
            x[keep] = -np.inf
        x[order[drop]] = -np.inf  # ... and the low end of the top m
        return


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from non-negative weights (normalised here) with a single uniform draw."""
    c = np.cumsum(probs, dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero (or NaN) distribution")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    # u * total < total, but rounding could still land past the end: clamp to the last token with mass.
    return min(i, int(np.flatnonzero(probs)[-1]))


class LazyProbs:
    """Row i = process_logits(fetch(i)), computed on first access and cached.

    Acceptance visits only the nodes on the walked path (and needs their full-vocabulary
    distribution), so the other verify rows are never processed.
    """

    def __init__(self, fetch: Callable[[int], np.ndarray], rows: int, params: SamplingParams):
        self._fetch, self._rows, self.params = fetch, rows, params
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self._rows:
            raise IndexError(f"row {i} outside 0..{self._rows - 1}")
        row = self._cache.get(i)
        if row is None:
            row = self._cache[i] = process_logits(self._fetch(i), self.params)
            row.flags.writeable = False
        return row

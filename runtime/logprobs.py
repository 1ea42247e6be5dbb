"""Log-probabilities of committed tokens under the target's own distribution, for requests that ask for them
(a server's ``logprobs``).

The values are the log-softmax of the target's raw logits row that produced each committed token (the prefill's
last row for the first token, the verify row of the token's parent node for the others; the draft is never
consulted), before temperature or top-p: the model's own distribution, as OpenAI reports it. Only a request with
``Request.logprobs`` set costs anything; the generator calls ``token_logprobs`` for no other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eagle_export.errors import GenerationError

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's bound for chat's top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its log-probability, and the ``top`` most likely tokens (id, log-prob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(top) -> int:
    """The number of alternatives a request asks for: an integer in [0, MAX_TOP_LOGPROBS]."""
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise GenerationError(f"logprobs (alternatives per token) must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                              f"got {top!r}")
    return top


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of ``logits`` ([len(tokens), V], raw) produced ``tokens[i]``: its log-softmax (float64) at that token,
    and the ``top`` most likely tokens of the row."""
    x = np.asarray(logits, dtype=np.float64)
    mx = x.max(axis=1, keepdims=True)
    lp = x - (mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True)))
    out = []
    for row, tok in zip(lp, tokens, strict=True):
        alts: tuple[tuple[int, float], ...] = ()
        if top:
            k = min(top, row.size)
            idx = np.argpartition(-row, k - 1)[:k]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            alts = tuple((int(j), float(row[j])) for j in idx)
        out.append(TokenLogprob(int(tok), float(row[int(tok)]), alts))
    return out

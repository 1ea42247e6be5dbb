"""Goodness-of-fit tests for the sampling tests: G-tests with small cells pooled (no scipy needed).

G = 2 * sum(O * ln(O / E)) is chi-square distributed with (bins - 1) degrees of freedom under the
null; its p-value is the regularised upper incomplete gamma Q(df / 2, G / 2) (torch has it).
Cells whose expected count is below MIN_EXPECTED are pooled into one bin, so the chi-square
approximation holds. A cell with probability exactly 0 that was observed makes the test fail
outright (p = 0): the sampler produced a token the target never would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_EXPECTED = 5.0


@dataclass
class GTest:
    g: float
    df: int
    p: float
    n: int
    bins: int
    impossible: int  # observations in cells of probability 0

    def __str__(self) -> str:
        return (f"G={self.g:.1f} df={self.df} p={self.p:.3g} (n={self.n}, {self.bins} bins"
                + (f", {self.impossible} impossible draws" if self.impossible else "") + ")")


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x)."""
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(x, 0.0) / 2, dtype=torch.float64)))


def _pool(expected: np.ndarray, *observed: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Keep cells with expected >= MIN_EXPECTED, pool the rest into one bin (merged into the smallest
    kept cell if the pool itself stays below MIN_EXPECTED)."""
    big = expected >= MIN_EXPECTED
    e = list(expected[big])
    os = [list(o[big]) for o in observed]
    rest = expected[~big].sum()
    if rest > 0:
        if rest >= MIN_EXPECTED or not e:
            e.append(rest)
            for o, src in zip(os, observed, strict=True):
                o.append(src[~big].sum())
        else:
            j = int(np.argmin(e))
            e[j] += rest
            for o, src in zip(os, observed, strict=True):
                o[j] += src[~big].sum()
    return np.asarray(e, dtype=np.float64), [np.asarray(o, dtype=np.float64) for o in os]


def _g(observed: np.ndarray, expected: np.ndarray) -> float:
    nz = observed > 0
    return float(2.0 * np.sum(observed[nz] * np.log(observed[nz] / expected[nz])))


def g_test(counts, probs) -> GTest:
    """Do the counts (any shape) come from the distribution probs (same shape, sums to 1)?"""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ")
    if abs(probs.sum() - 1.0) > 1e-9:
        raise ValueError(f"probs sum to {probs.sum()}")
    n = int(counts.sum())
    impossible = int(counts[probs == 0].sum())
    if impossible:
        return GTest(float("inf"), 0, 0.0, n, 0, impossible)
    keep = probs > 0
    e, (o,) = _pool(n * probs[keep], counts[keep])
    g = _g(o, e)
    return GTest(g, len(e) - 1, chi2_sf(g, len(e) - 1), n, len(e), 0)


def g_test_two_sample(a, b) -> GTest:
    """Do two count arrays (same shape) come from the same distribution? (2 x K homogeneity test)"""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    # Pool by the smaller sample's expected counts, so every kept bin has >= MIN_EXPECTED in both rows.
    e_small, (oa, ob) = _pool(min(na, nb) * pooled, a, b)
    col = oa + ob
    ea, eb = col * na / (na + nb), col * nb / (na + nb)
    g = _g(oa, ea) + _g(ob, eb)
    k = len(e_small)
    return GTest(g, k - 1, chi2_sf(g, k - 1), int(na + nb), k, 0)

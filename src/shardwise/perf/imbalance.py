"""Expert-parallel load at small batch: how many picked experts land on the busiest rank.

At batch 1 a token picks ``k`` of ``E`` routed experts; with expert parallelism each of ``ep``
groups owns ``E/ep`` of them. The layer ends when the rank holding the most picked experts
finishes, so the planner needs the expected **maximum** count, not the average ``k/ep``.

Routing is modelled as uniform (trained routers are roughly balanced over many tokens; any
skew only makes the busiest rank busier, so these figures are optimistic).
- One token: exact distribution of the maximum of the multivariate hypergeometric counts
  (``k`` distinct experts drawn without replacement), by polynomial counting.
- ``n`` tokens verified together (speculative decoding): each expert is touched with
  probability ``q = 1 − (1 − k/E)^n`` (the distinct-expert formula); counts per group are
  modelled as independent Binomial(E/ep, q), the maximum from the product of their CDFs.
- A seeded Monte-Carlo gives p50/p99 and checks both closed forms (past E picks in all, it
  draws the binomial groups of the ``n``-token form).
"""

from __future__ import annotations

from functools import lru_cache
from math import comb, lgamma

import numpy as np


@lru_cache(maxsize=4096)
def max_load_pmf(num_experts: int, top_k: int, ep: int) -> tuple[float, ...]:
    """P(busiest group holds exactly c picked experts), c = 0..top_k, one token, uniform routing."""
    per = num_experts // ep
    total = comb(num_experts, top_k)
    cdf = []
    for cap in range(top_k + 1):
        # Ways to pick top_k experts with every group holding <= cap: coefficient of x^top_k in
        # (sum_{j<=cap} C(per, j) x^j)^ep, by exact integer polynomial powers (truncated at top_k).
        poly = [comb(per, j) for j in range(min(per, cap) + 1)]
        cdf.append(_power_coefficient(poly, ep, top_k) / total)
    return tuple(cdf[c] - (cdf[c - 1] if c else 0.0) for c in range(top_k + 1))


def _multiply(a: list[int], b: list[int], degree: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, degree + 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b[: degree + 1 - i]):
                out[i + j] += x * y
    return out


def _power_coefficient(poly: list[int], exponent: int, degree: int) -> int:
    """Coefficient of x^degree in poly^exponent (square-and-multiply, truncated at degree)."""
    result, base = [1], poly
    while exponent:
        if exponent & 1:
            result = _multiply(result, base, degree)
        exponent >>= 1
        if exponent:
            base = _multiply(base, base, degree)
    return result[degree] if degree < len(result) else 0


def expected_max_load(num_experts: int, top_k: int, ep: int) -> float:
    """Expected experts on the busiest of ``ep`` groups for one token (exact)."""
    if ep <= 1:
        return float(top_k)
    pmf = max_load_pmf(num_experts, top_k, ep)
    return float(sum(c * p for c, p in enumerate(pmf)))


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched by ``tokens`` tokens: E·(1 − (1 − k/E)^n)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_max_load_tokens(num_experts: int, top_k: int, ep: int, tokens: int) -> float:
    """Expected distinct picked experts on the busiest group when ``tokens`` tokens run together.

    One token uses the exact hypergeometric form; more use independent Binomial(E/ep, q) groups.
    """
    if tokens <= 1:
        return expected_max_load(num_experts, top_k, ep)
    q = 1.0 - (1.0 - top_k / num_experts) ** tokens
    per = num_experts // ep
    if ep <= 1 or q >= 1.0:  # q rounds to 1 for large batches: every expert is touched
        return per * q
    c = np.arange(per + 1)
    log_pmf = (  # log C(per, j) by lgamma: C itself passes the float range from per ~1030
        np.array([lgamma(per + 1) - lgamma(j + 1) - lgamma(per - j + 1) for j in range(per + 1)])
        + c * np.log(q)
        + (per - c) * np.log1p(-q)
    )
    cdf = np.cumsum(np.exp(log_pmf))
    cdf = np.minimum(cdf / cdf[-1], 1.0)
    # E[max] = sum_{c>=0} P(max > c) = sum_c (1 - F(c)^ep)
    return float(np.sum(1.0 - cdf[:-1] ** ep))


def monte_carlo_max_load(
    num_experts: int, top_k: int, ep: int, tokens: int = 1, samples: int = 20000, seed: int = 0
) -> np.ndarray:
    """Seeded samples of the busiest group's distinct picked experts (uniform routing). Past
    ``num_experts`` picks in all (a large batch), each expert is drawn as touched independently
    with q = 1 − (1 − k/E)^n: one token's k picks being distinct no longer matters, and the exact
    draw would hold samples × n × k picks (gigabytes at a batch of thousands)."""
    rng = np.random.default_rng(seed)
    per = num_experts // ep
    if tokens * top_k > num_experts:
        q = 1.0 - (1.0 - top_k / num_experts) ** tokens
        return rng.binomial(per, q, size=(samples, ep)).max(axis=1)
    picks = np.concatenate([_distinct_picks(rng, samples, num_experts, top_k) for _ in range(tokens)], axis=1)
    # distinct experts per sample row: sort each row, keep first occurrences
    picks.sort(axis=1)
    first = np.ones(picks.shape, dtype=bool)
    first[:, 1:] = picks[:, 1:] != picks[:, :-1]
    rows = np.broadcast_to(np.arange(samples)[:, None], picks.shape)
    counts = np.bincount((rows * ep + picks // per)[first], minlength=samples * ep)
    return counts.reshape(samples, ep).max(axis=1)


def _distinct_picks(rng: np.random.Generator, samples: int, num_experts: int, top_k: int) -> np.ndarray:
    """``samples`` rows of ``top_k`` distinct experts, uniform (draws with replacement, redraws rows
    that repeated an expert: cheap while k² <= E, when a row repeats none with probability about
    exp(−k²/2E) >= 0.6; past that, e.g. 64 of 256, almost every row repeats one and redraws forever)."""
    if top_k * top_k > num_experts:
        return np.argpartition(rng.random((samples, num_experts)), top_k - 1, axis=1)[:, :top_k]
    picks = rng.integers(0, num_experts, size=(samples, top_k))
    while True:
        ordered = np.sort(picks, axis=1)
        bad = np.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
        if not bad.any():
            return picks
        picks[bad] = rng.integers(0, num_experts, size=(int(bad.sum()), top_k))


def load_percentiles(
    num_experts: int, top_k: int, ep: int, tokens: int = 1, samples: int = 20000, seed: int = 0
) -> dict[str, float]:
    """Mean, p50 and p99 of the busiest group's picked experts from the seeded Monte-Carlo."""
    draws = np.sort(monte_carlo_max_load(num_experts, top_k, ep, tokens, samples, seed))
    return {"mean": float(draws.mean()), "p50": _quantile(draws, 0.50), "p99": _quantile(draws, 0.99)}


def _quantile(ordered: np.ndarray, q: float) -> float:
    """``np.percentile``'s default (linear) quantile of already sorted draws, without the
    ``np.unique``/``numpy.ma`` import it drags into every `shardwise plan` (~20 ms)."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))

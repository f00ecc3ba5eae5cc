"""The Pareto front of a sweep: rows no other row beats on every objective."""

from __future__ import annotations

import numpy as np

_CHUNK = 256


def pareto_mask(objectives: np.ndarray) -> np.ndarray:
    """Rows of ``objectives`` (N × k, every column to maximize) that no other row dominates.

    Row j dominates row i when it is at least as good in every column and better in one.
    Sorted best-first lexicographically, every dominator comes before what it dominates. So
    the first block of the rows still in play holds its own front (checked block against
    block); that front then removes every later row it dominates in one vectorized pass, and
    the next block starts from what is left.
    """
    objectives = np.asarray(objectives, dtype=float)
    n = len(objectives)
    keep = np.zeros(n, dtype=bool)
    if n == 0:
        return keep
    order = np.lexsort(tuple(-objectives[:, j] for j in reversed(range(objectives.shape[1]))))
    ranked = objectives[order]
    remaining = np.arange(n)
    while remaining.size:
        block, rest = remaining[:_CHUNK], remaining[_CHUNK:]
        cand = ranked[block]
        front = block[~_dominated_by(cand, cand)]
        keep[order[front]] = True
        remaining = rest[~_dominated_by(ranked[front], ranked[rest])] if rest.size else rest
    return keep


def _dominated_by(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each row of ``b``: is some row of ``a`` at least as good everywhere and better somewhere."""
    out = np.zeros(len(b), dtype=bool)
    step = max(1, 2_000_000 // max(1, len(b)))
    for s in range(0, len(a), step):
        part = a[s:s + step]
        ge = np.ones((len(part), len(b)), dtype=bool)
        gt = np.zeros((len(part), len(b)), dtype=bool)
        for j in range(a.shape[1]):  # column by column: numpy reduces a tiny last axis slowly
            x, y = part[:, j, None], b[None, :, j]
            ge &= x >= y
            gt |= x > y
        out |= (ge & gt).any(axis=0)
    return out


def front_indices(cols: dict[str, np.ndarray], prefill: bool = False) -> np.ndarray:
    """Indices of one model's non-dominated configurations, best first (tok/s down, then usd,
    watts up).

    Without a prefill objective, configurations differing only in layout share usd, watts and
    bits, so only the fastest layout of each (quant, box, count ``n``, link) can be on the front:
    the others are dropped first (ties kept).
    """
    idx = np.arange(len(cols["tok"]))
    if not prefill:
        key = ((cols["quant"] * (cols["box"].max() + 1) + cols["box"]) * (cols["link"].max() + 1) + cols["link"]) \
            * (cols["n"].max() + 1) + cols["n"]
        order = np.lexsort((-cols["tok"], key))
        k = key[order]
        starts = np.concatenate([[True], k[1:] != k[:-1]])
        group = np.cumsum(starts) - 1
        best = np.maximum.reduceat(cols["tok"][order], np.flatnonzero(starts))
        idx = order[cols["tok"][order] == best[group]]
    objs = [cols["tok"][idx], -cols["usd"][idx], -cols["watts"][idx]]
    if len(np.unique(cols["bits"][idx])) > 1:
        objs.append(cols["bits"][idx])
    if prefill:
        objs.append(cols["prefill"][idx])
    keep = idx[pareto_mask(np.stack(objs, axis=1))]
    order = np.lexsort((cols["watts"][keep], cols["usd"][keep], -cols["tok"][keep]))
    return keep[order]


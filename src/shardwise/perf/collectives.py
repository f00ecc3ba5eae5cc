"""α-β cost model of the collectives used by tensor, expert and pipeline parallelism.

Every function takes the message size ``n_bytes`` (bytes), the number of ranks ``p``,
the per-message latency ``alpha_s`` (seconds, software included) and the per-rank link
bandwidth ``beta_bytes_per_s`` (bytes per second, one direction), and returns seconds.
All four accept numpy arrays (broadcast against each other); with plain scalars they
return a Python ``float``.

For all-reduce, ``n_bytes`` is the size of the vector every rank holds (and ends up
with). For all-gather and reduce-scatter it is the size of the *full* vector (the
gathered result, or the input before scattering); each rank owns ``n_bytes / p``.
Every cost is 0 for ``p = 1``: a single rank communicates nothing.

Formulas (``n/β`` is the wire time of the whole message):

- ring all-reduce: reduce-scatter then all-gather around a ring,
  ``2(p−1)·α + 2(p−1)/p · n/β``.
- recursive doubling: ``log2 p`` rounds of pairwise exchange of the whole vector,
  ``log2(p)·(α + n/β)`` when p is a power of two. Otherwise (the usual MPICH scheme)
  the ``r = p − 2^⌊log2 p⌋`` extra ranks first send their vector to a partner (one
  pre-step), the remaining ``2^⌊log2 p⌋`` ranks run recursive doubling, and the
  partners send the result back (one post-step): ``(⌊log2 p⌋ + 2)·(α + n/β)``.
- one-shot: every rank sends its whole vector to every other rank at once and sums
  locally (all-gather + local reduction); each rank's link receives ``p−1`` vectors:
  ``α + (p−1)·n/β``.
- tree: binary-tree reduce to a root, then binary-tree broadcast, whole vector each
  level: ``2·⌈log2 p⌉·(α + n/β)``.
- two-level (the runtime's ``two-level``): every rank of a host sends its vector to the host's
  leader, the leaders all-reduce across hosts (ring or recursive doubling), each leader sends
  the result back: ``2·(α_intra + (k−1)·n/β_intra)`` for ``k`` ranks per host, plus the
  leaders' all-reduce over the inter-host link.
- point-to-point: ``α + n/β``.
- ring all-gather and ring reduce-scatter: ``(p−1)·α + (p−1)/p · n/β``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError

ArrayLike = Any
CostFn = Callable[[ArrayLike, ArrayLike, ArrayLike, ArrayLike], Any]


def _prepare(n_bytes: ArrayLike, p: ArrayLike, alpha_s: ArrayLike, beta_bytes_per_s: ArrayLike):
    n = np.asarray(n_bytes, dtype=float)
    ranks = np.asarray(p)
    alpha = np.asarray(alpha_s, dtype=float)
    beta = np.asarray(beta_bytes_per_s, dtype=float)
    if ranks.size and not np.all(np.equal(np.mod(ranks, 1), 0)):
        raise ShardwiseError(f"p (ranks) must be whole numbers, got {ranks}")
    ranks = ranks.astype(np.int64)
    if np.any(ranks < 1):
        raise ShardwiseError(f"p (ranks) must be >= 1, got {ranks}")
    if np.any(n < 0):
        raise ShardwiseError(f"n_bytes must be >= 0, got {n}")
    if np.any(alpha < 0):
        raise ShardwiseError(f"alpha_s must be >= 0, got {alpha}")
    if np.any(beta <= 0):
        raise ShardwiseError(f"beta_bytes_per_s must be > 0, got {beta}")
    scalar = n.ndim == 0 and ranks.ndim == 0 and alpha.ndim == 0 and beta.ndim == 0
    return n, ranks, alpha, beta, scalar


def _out(value: np.ndarray, scalar: bool):
    return float(value) if scalar else value


def _floor_log2(ranks: np.ndarray) -> np.ndarray:
    """⌊log2 p⌋ for integer arrays p >= 1, exact (no float rounding)."""
    result = np.zeros(ranks.shape, dtype=np.int64)
    rest = ranks.copy()
    while np.any(rest > 1):
        bigger = rest > 1
        result = result + bigger
        rest = np.where(bigger, rest // 2, rest)
    return result


def _ceil_log2(ranks: np.ndarray) -> np.ndarray:
    floor = _floor_log2(ranks)
    return floor + (np.left_shift(1, floor) < ranks)


def ring_allreduce_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Ring all-reduce seconds: ``2(p−1)·α + 2(p−1)/p · n/β``."""
    n, ranks, alpha, beta, scalar = _prepare(n_bytes, p, alpha_s, beta_bytes_per_s)
    steps = 2.0 * (ranks - 1)
    return _out(steps * alpha + steps / ranks * n / beta, scalar)


def recursive_doubling_allreduce_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Recursive-doubling all-reduce seconds: ``log2 p·(α + n/β)``; non-powers of two
    pay one pre-step and one post-step: ``(⌊log2 p⌋ + 2)·(α + n/β)``."""
    n, ranks, alpha, beta, scalar = _prepare(n_bytes, p, alpha_s, beta_bytes_per_s)
    floor = _floor_log2(ranks)
    power_of_two = np.left_shift(1, floor) == ranks
    rounds = np.where(power_of_two, floor, floor + 2)
    return _out(rounds * (alpha + n / beta), scalar)


def one_shot_allreduce_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """One-shot all-reduce (all-gather + local sum) seconds: ``α + (p−1)·n/β``; 0 at p = 1."""
    n, ranks, alpha, beta, scalar = _prepare(n_bytes, p, alpha_s, beta_bytes_per_s)
    cost = alpha + (ranks - 1) * n / beta
    return _out(np.where(ranks > 1, cost, 0.0), scalar)


def tree_allreduce_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Binary-tree reduce + broadcast seconds: ``2·⌈log2 p⌉·(α + n/β)``."""
    n, ranks, alpha, beta, scalar = _prepare(n_bytes, p, alpha_s, beta_bytes_per_s)
    return _out(2.0 * _ceil_log2(ranks) * (alpha + n / beta), scalar)


def point_to_point_s(n_bytes, alpha_s, beta_bytes_per_s):
    """One message from one rank to another, seconds: ``α + n/β``."""
    n, _, alpha, beta, scalar = _prepare(n_bytes, 2, alpha_s, beta_bytes_per_s)
    return _out(alpha + n / beta, scalar)


def ring_allgather_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Ring all-gather seconds, n = gathered size: ``(p−1)·α + (p−1)/p · n/β``."""
    n, ranks, alpha, beta, scalar = _prepare(n_bytes, p, alpha_s, beta_bytes_per_s)
    steps = ranks - 1.0
    return _out(steps * alpha + steps / ranks * n / beta, scalar)


def ring_reduce_scatter_s(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Ring reduce-scatter seconds, n = full input size: ``(p−1)·α + (p−1)/p · n/β``."""
    return ring_allgather_s(n_bytes, p, alpha_s, beta_bytes_per_s)


ALLREDUCE_ALGORITHMS: dict[str, CostFn] = {
    "ring": ring_allreduce_s,
    "rd": recursive_doubling_allreduce_s,
    "oneshot": one_shot_allreduce_s,
    "tree": tree_allreduce_s,
}
"""Flat all-reduce algorithms by the names the runtime (``runtime.comm``), the runtime profiles
and the CLI use; ``best_allreduce`` breaks ties in this order. The runtime runs ring, rd and
oneshot itself; tree is NCCL's."""

RUNTIME_ALGORITHMS = ("ring", "rd", "oneshot", "two-level", "builtin", "shm")
"""The runtime's all-reduce algorithms (``runtime.comm.ALLREDUCE_ALGORITHMS``)."""

PLANNER_ALGORITHM = {"ring": "ring", "rd": "rd", "oneshot": "oneshot", "two-level": "ring", "builtin": "ring",
                     "shm": "oneshot"}
"""The flat formula the planner charges each runtime algorithm with (two-level on one host and
the backend's builtin as a ring, shared memory as a one-shot: each rank reads every rank's part;
a probe's per-call overhead and α absorb the difference)."""


def runtime_allreduce_s(name: str, n_bytes, p: int, alpha_s, beta_bytes_per_s, ranks_per_host: int | None = None):
    """α-β seconds of the runtime's algorithm ``name`` over ``p`` ranks; two-level uses
    ``ranks_per_host`` (default all on one host) with the same α/β inside and across hosts."""
    if name == "two-level":
        local = ranks_per_host or p
        return two_level_allreduce_s(n_bytes, local, p // local, alpha_s, beta_bytes_per_s, alpha_s, beta_bytes_per_s)
    if name not in PLANNER_ALGORITHM:
        raise ShardwiseError(f"all-reduce '{name}' is unknown: use one of {', '.join(RUNTIME_ALGORITHMS)}")
    return ALLREDUCE_ALGORITHMS[PLANNER_ALGORITHM[name]](n_bytes, p, alpha_s, beta_bytes_per_s)


def best_allreduce(n_bytes, p, alpha_s, beta_bytes_per_s):
    """Cheapest flat all-reduce: ``(algorithm name, seconds)``.

    With scalar inputs returns ``(str, float)``; with arrays returns an array of names
    and an array of seconds. Ties go to the earlier name in ``ALLREDUCE_ALGORITHMS``.
    """
    names = list(ALLREDUCE_ALGORITHMS)
    costs = np.stack(
        np.broadcast_arrays(
            *(np.asarray(fn(n_bytes, p, alpha_s, beta_bytes_per_s), dtype=float) for fn in ALLREDUCE_ALGORITHMS.values())
        )
    )
    pick = np.asarray(np.argmin(costs, axis=0))
    seconds = np.take_along_axis(costs, pick[np.newaxis, ...], axis=0)[0]
    chosen = np.asarray(names, dtype=object)[pick]
    if pick.ndim == 0:
        return str(chosen), float(seconds)
    return chosen, seconds


def two_level_allreduce_s(
    n_bytes,
    ranks_per_host,
    hosts,
    alpha_intra_s,
    beta_intra_bytes_per_s,
    alpha_inter_s,
    beta_inter_bytes_per_s,
    inter_algorithm: str = "ring",
):
    """The runtime's two-level all-reduce over ``ranks_per_host × hosts`` ranks, seconds.

    Reduce to each host's leader (``α_intra + (k−1)·n/β_intra``: the leader receives k−1
    vectors), all-reduce of ``n`` bytes among the leaders with ``inter_algorithm`` ("ring" or
    "rd", as ``runtime.comm.two_level_allreduce`` runs it), broadcast back (the same as the reduce).
    """
    if inter_algorithm not in ("ring", "rd"):
        raise ShardwiseError(f"inter_algorithm '{inter_algorithm}' is unknown: use ring or rd")
    across = ALLREDUCE_ALGORITHMS[inter_algorithm](n_bytes, hosts, alpha_inter_s, beta_inter_bytes_per_s)
    k = np.asarray(ranks_per_host)
    inside = np.where(k > 1, alpha_intra_s + (k - 1) * np.asarray(n_bytes, dtype=float) / beta_intra_bytes_per_s, 0.0)
    total = 2 * inside + np.asarray(across)
    return float(total) if total.ndim == 0 else total

"""All-reduce (SUM) algorithms built on point-to-point messages.

Every algorithm here is written with ``torch.distributed`` send/receive pairs issued
through ``batch_isend_irecv``, so the same code runs on gloo (CPU, TCP) and NCCL (GPU).
They exist so the runtime can pick the algorithm the planner's α-β model says is
fastest for a message size (at batch 1 the messages are a few KB and per-message
latency α dominates; in prefill they are MBs and bandwidth β dominates), and so the
reduction order is fixed by this code rather than by a backend.

Contract shared by every function:

- ``t`` is a contiguous tensor of any shape and dtype that supports ``+``; every rank of
  the group passes a tensor of the same shape and dtype (a mismatch is a programming
  error the backend reports, or it hangs until the process-group timeout).
- The reduction is **in place**: ``t`` is overwritten with the element-wise sum over
  the ranks, and the same tensor object is returned for chaining.
- **Deterministic**: for a given group and rank order the summation order is fixed, so
  every rank ends with bit-identical values and repeated runs give identical bits
  (``builtin`` excepted: its order is whatever the backend does).
- Tensors with zero elements are returned untouched without any message.
- ``group`` is a ``torch.distributed`` process group (None: the default group); ranks
  outside it must not call. Rank numbers in arguments (``order``) are global ranks.

Message counts and volumes per rank for ``n`` bytes over ``p`` ranks (the terms the
planner's cost model in ``shardwise.perf.collectives`` charges):

========== ============================ ==========================================
name       messages on the critical path bytes sent per rank
========== ============================ ==========================================
ring       2(p−1)                       2(p−1)/p · n
rd         ⌊log2 p⌋ (+2 if p ≠ 2^k)     ⌊log2 p⌋ · n (+n for the folded ranks)
oneshot    1 (p−1 sends in flight)       (p−1) · n
two-level  intra reduce, inter ring/rd,  intra: n (leaders receive (k−1)·n),
           intra broadcast               inter: as ring/rd over the leaders
builtin    backend's choice              backend's choice
shm        none: one shared-memory       n into its slot, reads p·n (one host only,
           segment, a flag per rank      ``runtime.shm_allreduce``)
========== ============================ ==========================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime.shm_allreduce import shm_reduce

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "builtin_allreduce",
    "get_allreduce",
    "oneshot_allreduce",
    "recursive_doubling_allreduce",
    "ring_allreduce",
    "shm_allreduce",
    "two_level_allreduce",
]

_ProcessGroup = dist.ProcessGroup | None


# --------------------------------------------------------------------------- helpers


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t`` that aliases its storage (so writes land in ``t``)."""
    if not t.is_contiguous():
        raise ShardwiseError(
            f"all-reduce needs a contiguous tensor, got shape {tuple(t.shape)} with "
            f"strides {t.stride()}: call .contiguous() first"
        )
    return t.view(-1)


def _group_ranks(group: _ProcessGroup) -> list[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _exchange(ops: Sequence[tuple[str, torch.Tensor, int]], group: _ProcessGroup) -> None:
    """Post the (``"send"``|``"recv"``, tensor, global peer rank) ops together and wait.

    Going through ``batch_isend_irecv`` matters on NCCL: a send and a receive with the
    same peer issued as two separate calls can deadlock, grouped they cannot. Empty
    tensors are skipped (both sides compute the same sizes, so they skip together).
    """
    p2p = [
        dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group)
        for kind, tensor, peer in ops
        if tensor.numel() > 0
    ]
    if p2p:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()


def _chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``parts`` contiguous (start, stop) ranges, sizes differing
    by at most one (the first ``n % parts`` chunks get the extra element; chunks are
    empty when ``n < parts``)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for c in range(parts):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _add_canonical(out: torch.Tensor, lower: torch.Tensor, higher: torch.Tensor) -> None:
    """``out = lower + higher`` with the lower-ranked operand first.

    IEEE addition is commutative for numbers, but which NaN payload survives
    ``a + b`` depends on operand order on common CPUs; a fixed order keeps even those
    bits identical on both partners. ``out`` may alias either input.
    """
    torch.add(lower, higher, out=out)


def _ring(flat: torch.Tensor, order: Sequence[int], group: _ProcessGroup) -> None:
    """Ring reduce-scatter + all-gather of ``flat`` over global ranks ``order``.

    Position i sends to position i+1 (wrapping). Chunk c is summed exactly once, along
    the ring starting at position c and ending at its owner, position c−1; the
    all-gather then copies the owner's bits to everyone, so all ranks agree bit for bit.
    """
    m = len(order)
    if m == 1:
        return
    me = order.index(dist.get_rank())
    nxt, prv = order[(me + 1) % m], order[(me - 1) % m]
    bounds = _chunk_bounds(flat.numel(), m)
    chunk = [flat[a:b] for a, b in bounds]
    scratch = torch.empty(max(b - a for a, b in bounds), dtype=flat.dtype, device=flat.device)
    for step in range(m - 1):  # reduce-scatter: position i ends owning chunk i+1
        send_c, recv_c = (me - step) % m, (me - step - 1) % m
        incoming = scratch[: chunk[recv_c].numel()]
        _exchange([("send", chunk[send_c], nxt), ("recv", incoming, prv)], group)
        _add_canonical(chunk[recv_c], incoming, chunk[recv_c])  # partial sum, then own
    for step in range(m - 1):  # all-gather: pass finished chunks along the ring
        send_c, recv_c = (me + 1 - step) % m, (me - step) % m
        _exchange([("send", chunk[send_c], nxt), ("recv", chunk[recv_c], prv)], group)


def _recursive_doubling(flat: torch.Tensor, ranks: Sequence[int], group: _ProcessGroup) -> None:
    """Recursive doubling over global ranks ``ranks`` (their list order is the rank order).

    With q the largest power of two ≤ m and r = m − q, the first 2r positions fold in
    pairs: each even position sends its data to the next odd one and waits; the q
    remaining ranks exchange whole vectors with partners at distance 1, 2, 4, … and add
    lower-positioned data first; finally the odd positions send the result back.
    """
    m = len(ranks)
    if m == 1:
        return
    me = ranks.index(dist.get_rank())
    q = 1 << (m.bit_length() - 1)
    r = m - q
    scratch = torch.empty_like(flat)
    if me < 2 * r and me % 2 == 0:  # folded out: hand data over, get the result back
        _exchange([("send", flat, ranks[me + 1])], group)
        _exchange([("recv", flat, ranks[me + 1])], group)
        return
    if me < 2 * r:
        _exchange([("recv", scratch, ranks[me - 1])], group)
        _add_canonical(flat, scratch, flat)
        virtual = me // 2
    else:
        virtual = me - r
    mask = 1
    while mask < q:
        partner_v = virtual ^ mask
        partner = ranks[2 * partner_v + 1 if partner_v < r else partner_v + r]
        _exchange([("send", flat, partner), ("recv", scratch, partner)], group)
        if partner_v < virtual:
            _add_canonical(flat, scratch, flat)
        else:
            _add_canonical(flat, flat, scratch)
        mask <<= 1
    if me < 2 * r:
        _exchange([("send", flat, ranks[me - 1])], group)


# --------------------------------------------------------------------------- public API


def ring_allreduce(
    t: torch.Tensor, order: list[int] | None = None, group: _ProcessGroup = None
) -> torch.Tensor:
    """Ring all-reduce (SUM) of ``t`` in place; returns ``t``.

    ``order`` is a permutation of the group's global ranks: ``order[i]`` sends to
    ``order[i+1]`` and the last sends to the first (the ring order a planner picks so
    few hops cross slow links). Default: rank order. Costs 2(p−1) messages of ≈ n/p
    bytes each per rank. Every rank must pass the same ``order``.
    """
    flat = _flat(t)
    ranks = _group_ranks(group)
    if order is None:
        order = ranks
    elif sorted(order) != sorted(ranks):
        raise ShardwiseError(
            f"ring order {list(order)} is not a permutation of the group's ranks {ranks}"
        )
    if flat.numel():
        _ring(flat, list(order), group)
    return t


def recursive_doubling_allreduce(t: torch.Tensor, group: _ProcessGroup = None) -> torch.Tensor:
    """Recursive-doubling all-reduce (SUM) of ``t`` in place; returns ``t``.

    ⌊log2 p⌋ rounds of whole-vector exchanges, the latency-optimal choice for small
    messages. Non-powers of two use the standard fold: the extra ranks hand their data
    to a partner first and receive the result at the end (two more message latencies).
    Each pairwise sum adds the lower rank's data first.
    """
    flat = _flat(t)
    if flat.numel():
        _recursive_doubling(flat, _group_ranks(group), group)
    return t


def oneshot_allreduce(t: torch.Tensor, group: _ProcessGroup = None) -> torch.Tensor:
    """One-shot all-reduce (SUM) of ``t`` in place; returns ``t``.

    Every rank sends its whole tensor to every other rank in one round (an all-gather
    written as point-to-point messages), then sums the p tensors locally in rank order
    0, 1, …, p−1. One message latency, (p−1)·n bytes sent per rank and p·n bytes of
    scratch memory.
    """
    flat = _flat(t)
    ranks = _group_ranks(group)
    if flat.numel() == 0 or len(ranks) == 1:
        return t
    me = ranks.index(dist.get_rank())
    gathered = torch.empty((len(ranks), flat.numel()), dtype=flat.dtype, device=flat.device)
    gathered[me].copy_(flat)
    ops = []
    for pos, peer in enumerate(ranks):
        if pos != me:
            ops += [("send", flat, peer), ("recv", gathered[pos], peer)]
    _exchange(ops, group)
    flat.copy_(gathered[0])
    for pos in range(1, len(ranks)):
        flat.add_(gathered[pos])
    return t


def two_level_allreduce(
    t: torch.Tensor,
    ranks_per_host: int | None = None,
    group: _ProcessGroup = None,
    *,
    inter: str = "ring",
) -> torch.Tensor:
    """Hierarchical all-reduce (SUM) of ``t`` in place; returns ``t``.

    Hosts are consecutive blocks of ``ranks_per_host`` ranks in group-rank order (the
    way torchrun numbers ranks node by node); the first rank of each block is the host
    leader. (1) every rank sends its tensor to its leader, which sums in local rank
    order; (2) the leaders all-reduce among themselves with ``inter`` (``"ring"`` in
    host order, or ``"rd"``); (3) each leader sends the result to its local ranks. Only
    step (2) crosses hosts. ``ranks_per_host`` defaults to ``LOCAL_WORLD_SIZE`` from the
    environment (set by torchrun and ``launch_local``).
    """
    flat = _flat(t)
    ranks = _group_ranks(group)
    if ranks_per_host is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ShardwiseError(
                "two-level all-reduce needs ranks_per_host (or LOCAL_WORLD_SIZE in the environment)"
            )
        ranks_per_host = int(env)
    if ranks_per_host < 1 or len(ranks) % ranks_per_host:
        raise ShardwiseError(
            f"two-level all-reduce: ranks_per_host={ranks_per_host} must divide the "
            f"group size {len(ranks)}"
        )
    if inter not in ("ring", "rd"):
        raise ShardwiseError(f"two-level all-reduce: inter='{inter}' must be 'ring' or 'rd'")
    if flat.numel() == 0 or len(ranks) == 1:
        return t
    k = ranks_per_host
    me = ranks.index(dist.get_rank())
    local, leader_pos = me % k, me - me % k
    if local:
        _exchange([("send", flat, ranks[leader_pos])], group)
    elif k > 1:
        incoming = torch.empty((k - 1, flat.numel()), dtype=flat.dtype, device=flat.device)
        _exchange([("recv", incoming[j - 1], ranks[leader_pos + j]) for j in range(1, k)], group)
        for j in range(k - 1):
            flat.add_(incoming[j])
    if not local:
        leaders = ranks[::k]
        (_ring if inter == "ring" else _recursive_doubling)(flat, leaders, group)
        _exchange([("send", flat, ranks[leader_pos + j]) for j in range(1, k)], group)
    else:
        _exchange([("recv", flat, ranks[leader_pos])], group)
    return t


def builtin_allreduce(t: torch.Tensor, group: _ProcessGroup = None) -> torch.Tensor:
    """The backend's own ``dist.all_reduce`` (SUM) of ``t`` in place; returns ``t``.

    The reference the other algorithms are tested against; its summation order is the
    backend's (gloo and NCCL pick by size and topology), so bit-identity across ranks
    and runs is the backend's promise, not this module's.
    """
    flat = _flat(t)
    if flat.numel():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return t


def shm_allreduce(t: torch.Tensor, group: _ProcessGroup = None) -> torch.Tensor:
    """All-reduce (SUM) of ``t`` in place through shared memory; returns ``t``. Every rank of the
    group must run on this host (x86-64, CPU tensors): each writes its tensor into its slot of one
    segment and sums all slots in rank order 0, 1, …, p−1 (``runtime.shm_allreduce``)."""
    flat = _flat(t)
    ranks = _group_ranks(group)
    if flat.numel() and len(ranks) > 1:
        shm_reduce(flat, ranks, group)
    return t


ALLREDUCE_ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_allreduce,
    "rd": recursive_doubling_allreduce,
    "oneshot": oneshot_allreduce,
    "two-level": two_level_allreduce,
    "builtin": builtin_allreduce,
    "shm": shm_allreduce,
}
"""Name → in-place SUM all-reduce; each is callable as ``fn(t)`` with defaults."""


def get_allreduce(name: str) -> Callable[..., torch.Tensor]:
    """The all-reduce function called ``name`` (a key of ``ALLREDUCE_ALGORITHMS``)."""
    try:
        return ALLREDUCE_ALGORITHMS[name]
    except KeyError:
        valid = ", ".join(ALLREDUCE_ALGORITHMS)
        raise ShardwiseError(
            f"unknown all-reduce algorithm '{name}': valid names are {valid}"
        ) from None

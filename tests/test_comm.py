"""All-reduce algorithms against the built-in all-reduce, over real gloo processes.

Process start-up dominates on a small box, so one ``launch_local`` of 5 ranks runs every
case: p = 5 over the default group, p = 2, 3, 4 over sub-groups whose global ranks are
not 0..p−1 (which also checks the global/group rank bookkeeping). Each rank returns a
compact record per case; the assertions run in the test process.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import comm
from shardwise.runtime.shm_allreduce import CAPACITY_BYTES
from shardwise.runtime.launch import launch_local

WORLD = 5
GROUPS = {2: [1, 3], 3: [0, 2, 4], 4: [1, 2, 3, 4], 5: None}  # p -> global ranks (None: world)
BIG = 2**20  # elements (4 MiB of float32)
SIZES = (1, 3, 1000, BIG)
SHAPES = {1000: (8, 125)}  # the 1000-element case runs as a 2-D tensor
# 1 Mi elements costs a second per case on a busy 2-core box: the algorithms run it at
BIG_CASES = {
    2: ("ring", "ring-permuted", "rd", "oneshot", "builtin", "two-level/1/rd", "two-level/2", "shm"),
    3: ("ring", "rd", "oneshot", "builtin", "shm"),
    4: ("ring", "two-level/2", "builtin"),
    5: ("ring", "rd", "builtin", "shm"),
}


def _members(p: int) -> list[int]:
    return GROUPS[p] if GROUPS[p] is not None else list(range(WORLD))


def _data(rank: int, n: int, kind: str) -> torch.Tensor:
    """Rank ``rank``'s input: integer-valued float32 (sums are exact) or N(0, 1) float32."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + 7 * n + (kind == "rand"))
    if kind == "int":
        return torch.randint(-1024, 1025, (n,), generator=gen).to(torch.float32)
    return torch.randn(n, generator=gen)


def _digest(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes: equal bits give equal digests (cheap at 4 MiB)."""
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy())


def _ring_reference(xs: dict[int, torch.Tensor], order: list[int]) -> torch.Tensor:
    """The ring's documented association order, computed locally: chunk c is summed
    along the ring starting at position c."""
    m, n = len(order), xs[order[0]].numel()
    out = torch.empty(n, dtype=torch.float32)
    for c, (a, b) in enumerate(comm._chunk_bounds(n, m)):
        acc = xs[order[c]][a:b].clone()
        for j in range(1, m):
            acc = acc + xs[order[(c + j) % m]][a:b]
        out[a:b] = acc
    return out


def _cases(p: int, group) -> list[tuple[str, object, list[int] | None]]:
    """(label, in-place all-reduce, ring order it follows or None) for group size p."""
    members = _members(p)
    perm = [members[i] for i in torch.randperm(p, generator=torch.Generator().manual_seed(p))]
    if perm == members:
        perm = perm[::-1]
    cases = [
        ("ring", lambda t: comm.ring_allreduce(t, group=group), members),
        ("ring-permuted", lambda t: comm.ring_allreduce(t, order=perm, group=group), perm),
        ("rd", lambda t: comm.recursive_doubling_allreduce(t, group=group), None),
        ("oneshot", lambda t: comm.oneshot_allreduce(t, group=group), None),
        ("builtin", lambda t: comm.builtin_allreduce(t, group=group), None),
        ("shm", lambda t: comm.shm_allreduce(t, group=group), None),
        ("two-level/1/rd", lambda t: comm.two_level_allreduce(t, 1, group, inter="rd"), None),
    ]
    for k in range(1, p + 1):
        if p % k == 0:
            cases.append((f"two-level/{k}", lambda t, k=k: comm.two_level_allreduce(t, k, group), None))
    return cases


def _comm_worker(rank: int, world_size: int) -> dict:
    """Run every case this rank belongs to; return {(p, case, n, data): record}.

    Integer-valued data runs at the small sizes (there any summation order is exact);
    N(0, 1) data at every size (there only a fixed order gives identical bits).
    """
    torch.set_num_threads(1)
    groups = {p: dist.new_group(ranks) if ranks else None for p, ranks in GROUPS.items()}
    records: dict = {}
    for p, group in groups.items():
        members = _members(p)
        if rank not in members:
            continue
        for n, kind in [(n, k) for n in SIZES[:-1] for k in ("int", "rand")] + [(BIG, "rand")]:
            xs = {r: _data(r, n, kind) for r in members}
            in_rank_order = xs[members[0]].clone()
            for r in members[1:]:
                in_rank_order += xs[r]  # the one-shot's documented result
            ref64 = torch.stack([x.double() for x in xs.values()]).sum(0) if n < BIG else None
            builtin = xs[rank].clone()
            dist.all_reduce(builtin, group=group)
            for name, fn, order in _cases(p, group):
                if n == BIG and name not in BIG_CASES[p]:
                    continue
                runs = []
                for _ in range(2):
                    t = xs[rank].clone().view(SHAPES.get(n, (n,)))
                    assert fn(t) is t  # in place, same object returned
                    runs.append(t.view(-1))
                got = runs[0]
                rec = {
                    "digests": (_digest(runs[0]), _digest(runs[1])),
                    "equal_builtin": torch.equal(got, builtin),
                    "close_builtin": torch.allclose(got, builtin, rtol=1e-5, atol=1e-5),
                    "close_f64": ref64 is None
                    or torch.allclose(got.double(), ref64, rtol=1e-5, atol=1e-5),
                }
                if name in ("oneshot", "shm"):  # both sum in the group's rank order
                    rec["documented_order"] = torch.equal(got, in_rank_order)
                if order is not None:
                    rec["documented_order"] = torch.equal(got, _ring_reference(xs, order))
                records[(p, name, n, kind)] = rec
    # int64 through every registered algorithm by its registry name and defaults
    x = torch.randint(-(2**40), 2**40, (37,), generator=torch.Generator().manual_seed(rank))
    expect = x.clone()
    dist.all_reduce(expect)
    for name in comm.ALLREDUCE_ALGORITHMS:
        records[("int64", name)] = torch.equal(comm.get_allreduce(name)(x.clone()), expect)
    # shm in slot-sized pieces: two whole slots and a tail, the same bits as the one-shot's rank order
    x = _data(rank, 2 * CAPACITY_BYTES // 4 + 3, "rand")
    records["shm pieces"] = torch.equal(comm.shm_allreduce(x.clone()), comm.oneshot_allreduce(x.clone()))
    try:
        comm.ring_allreduce(torch.ones(4), order=[0] * world_size)
        records["bad order"] = "no error"
    except ShardwiseError as exc:
        records["bad order"] = str(exc)
    return records


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch_local(_comm_worker, WORLD, timeout_s=60, run_timeout_s=240)


@pytest.mark.parametrize("p", sorted(GROUPS))
def test_allreduce_matches_builtin_and_is_bit_identical(results, p):
    members = _members(p)
    keys = [key for key in results[members[0]] if key[0] == p]
    names = {c[0] for c in _cases(p, None)}
    assert {(name, n, kind) for _, name, n, kind in keys} == {
        (name, n, kind) for name in names for n in SIZES[:-1] for kind in ("int", "rand")
    } | {(name, BIG, "rand") for name in BIG_CASES[p]}
    failures = []
    for key in keys:
        recs = [results[r][key] for r in members]
        if len({d for rec in recs for d in rec["digests"]}) != 1:
            failures.append(f"{key}: bits differ across ranks or between two runs")
        for r, rec in zip(members, recs):
            if key[3] == "int" and not rec["equal_builtin"]:
                failures.append(f"{key} rank {r}: not equal to builtin on integer data")
            if not (rec["close_builtin"] and rec["close_f64"]):
                failures.append(f"{key} rank {r}: not close to the builtin / float64 sum")
            if not rec.get("documented_order", True):
                failures.append(f"{key} rank {r}: bits differ from the documented summation order")
    assert not failures, "\n".join(failures)


def test_registry_defaults_and_bad_order(results):
    for r, res in enumerate(results):
        assert all(res[("int64", name)] for name in comm.ALLREDUCE_ALGORITHMS), r
        assert res["shm pieces"], r
        assert "is not a permutation of the group's ranks [0, 1, 2, 3, 4]" in res["bad order"]


def test_get_allreduce_names_and_errors():
    assert set(comm.ALLREDUCE_ALGORITHMS) == {"ring", "rd", "oneshot", "two-level", "builtin", "shm"}
    assert comm.get_allreduce("ring") is comm.ring_allreduce
    with pytest.raises(ShardwiseError, match="valid names are ring, rd, oneshot, two-level, builtin, shm"):
        comm.get_allreduce("auto")
    with pytest.raises(ShardwiseError, match="contiguous"):
        comm.ring_allreduce(torch.ones(4, 4).t())


def test_chunk_bounds_are_even_and_cover():
    assert comm._chunk_bounds(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    bounds = comm._chunk_bounds(1003, 4)
    assert [b - a for a, b in bounds] == [251, 251, 251, 250]
    assert bounds[0][0] == 0 and bounds[-1][1] == 1003

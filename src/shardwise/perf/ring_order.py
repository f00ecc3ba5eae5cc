"""Ring order search: the fastest and slowest rank order for a ring all-reduce on a cable graph.

The cost of one order is ``shardwise.spec.topology.Topology.ring_step_s`` (see that
module for the model). Up to ``EXACT_SEARCH_MAX_HOSTS`` hosts the search is exact
(branch and bound over the orders left after symmetries); above, greedy then 2-opt and
Or-opt local search. NCCL and gloo pass data in rank order, so the order printed by the
search is the rank order to launch with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.spec.topology import RingModel, Topology

EXACT_SEARCH_MAX_HOSTS = 16
"""Rings up to this many hosts are searched exactly (branch and bound)."""

DEFAULT_NODE_BUDGET = 60_000
"""Search nodes the exact search may visit before it settles for the best order found
(about 3-4 s of pure Python; symmetric clusters finish far below it)."""

_REL_TOL = 1e-12


@dataclass(frozen=True)
class RingResult:
    """A ring order with its cost: the bottleneck step (s) and the whole all-reduce (s).

    ``exact`` is True when the search examined every distinct order (so the order is
    the proven best or worst); False when it used the heuristic or ran out of budget.
    """

    order: tuple[str, ...]
    step_s: float
    allreduce_s: float
    exact: bool


def twin_classes(model: RingModel) -> list[int]:
    """Class id per host (the smallest member's index): hosts that can swap places.

    Hosts u and v are twins when exchanging them maps every route onto the route
    between the exchanged ends, with the same latency and the same cable
    bandwidths hop by hop; then every ring order costs the same as the order with
    u and v exchanged, so the exact search tries one order per arrangement of
    classes (hosts on one switch behind identical cables are the usual case).
    """
    p = model.p
    cls = list(range(p))
    for v in range(p):
        for u in range(v):
            if cls[u] == u and _are_twins(model, u, v):
                cls[v] = u
                break
    return cls


def _are_twins(model: RingModel, u: int, v: int) -> bool:
    node_u, node_v = model.nodes[u][u][0], model.nodes[v][v][0]

    def swap_host(x: int) -> int:
        return v if x == u else u if x == v else x

    def swap_node(x: int) -> int:
        return node_v if x == node_u else node_u if x == node_v else x

    for a in range(model.p):
        for b in range(model.p):
            if a == b:
                continue
            sa, sb = swap_host(a), swap_host(b)
            if model.latency[a][b] != model.latency[sa][sb]:
                return False
            if tuple(map(swap_node, model.nodes[a][b])) != model.nodes[sa][sb]:
                return False
            if [model.wire_s[d] for d in model.edges[a][b]] != [model.wire_s[d] for d in model.edges[sa][sb]]:
                return False
    return True


LOCAL_SEARCH_MAX_MOVES = 2000
"""Improving moves the local search may take before it stops (bounds its run time)."""


def _neighbours(order: list[int]):
    """2-opt (reverse a segment) and Or-opt (move a segment of 1-3 hosts) moves; host 0 stays first."""
    p = len(order)
    for i in range(1, p - 1):
        for j in range(i + 1, p):
            yield order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
    for length in (1, 2, 3):
        for i in range(1, p - length + 1):
            segment = order[i : i + length]
            rest = order[:i] + order[i + length :]
            for k in range(1, len(rest) + 1):
                if k != i:
                    yield rest[:k] + segment + rest[k:]


def _local_search(model: RingModel, order: list[int], sense: int) -> list[int]:
    """First-improvement local search from ``order`` until no move improves.

    ``sense`` +1 minimises, -1 maximises the key (bottleneck step, sum of hop costs);
    the sum guides the search across plateaus of the bottleneck.
    """

    def key(o: list[int]) -> tuple[float, float]:
        step, total = model.evaluate(o)
        return (sense * step, sense * total)

    current = key(order)
    for _ in range(LOCAL_SEARCH_MAX_MOVES):
        for candidate in _neighbours(order):
            candidate_key = key(candidate)
            if _better(candidate_key, current):
                order, current = candidate, candidate_key
                break
        else:
            break
    return order


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    scale = max(abs(b[0]), 1e-30)
    if a[0] < b[0] - _REL_TOL * scale:
        return True
    return abs(a[0] - b[0]) <= _REL_TOL * scale and a[1] < b[1] - _REL_TOL * max(abs(b[1]), 1e-30)


def _greedy(model: RingModel, sense: int) -> list[int]:
    order = [0]
    left = set(range(1, model.p))
    while left:
        last = order[-1]
        nxt = min(left, key=lambda j: (sense * model.base[last][j], j))
        order.append(nxt)
        left.remove(nxt)
    return order


def _branch_and_bound(
    model: RingModel, start: list[int], sense: int, node_budget: int
) -> tuple[list[int], float, bool]:
    """Exact ring search by depth-first branch and bound; ``sense`` +1 minimises, -1 maximises.

    Host 0 is fixed first (rotations cost the same), each twin class is placed in
    index order (see ``twin_classes``) and of a ring and its mirror image (same cost,
    routes being symmetric) only the one whose second host's class is not above its
    last host's class is scored. Partial rings are cut when their bottleneck so far
    (loads only grow as hops are added) cannot beat the incumbent; when minimising,
    also when some host left has no hop in or out cheaper than the incumbent.
    Returns (order, bottleneck step seconds, exhausted); ``exhausted`` is True when
    the search finished within ``node_budget`` nodes, i.e. the order is proven.
    """
    p = model.p
    latency, edges, wire, base = model.latency, model.edges, model.wire_s, model.base
    cls = twin_classes(model)
    members: dict[int, list[int]] = {}
    for host in range(p):
        members.setdefault(cls[host], []).append(host)
    class_list = sorted(members)
    used = {c: 0 for c in class_list}
    used[cls[0]] = 1
    load = [0] * model.n_directed
    maxlat = [0.0] * model.n_directed
    best_order = list(start)
    best = model.evaluate(start)[0]
    # Maximising: the most latency any hop can add to a cable direction.
    max_lat_on = [0.0] * model.n_directed
    for u in range(p):
        for v in range(p):
            for d in edges[u][v]:
                max_lat_on[d] = max(max_lat_on[d], latency[u][v])
    used_edges = sorted({d for u in range(p) for v in range(p) for d in edges[u][v]})
    # Minimising: bitmasks of the hops that alone already cost less than the incumbent.
    can_in = [0] * p
    can_out = [0] * p

    def refresh_masks() -> None:
        limit = best * (1 - _REL_TOL)
        for w in range(p):
            can_in[w] = sum(1 << u for u in range(p) if u != w and base[u][w] < limit)
            can_out[w] = sum(1 << v for v in range(p) if v != w and base[w][v] < limit)

    refresh_masks()
    order = [0]
    budget = [node_budget]

    def child_step(u: int, v: int, step: float) -> float:
        lat = latency[u][v]
        for d in edges[u][v]:
            cost = (maxlat[d] if maxlat[d] > lat else lat) + (load[d] + 1) * wire[d]
            if cost > step:
                step = cost
        return step

    def add_hop(u: int, v: int) -> list[tuple[int, float]]:
        saved = []
        lat = latency[u][v]
        for d in edges[u][v]:
            saved.append((d, maxlat[d]))
            if lat > maxlat[d]:
                maxlat[d] = lat
            load[d] += 1
        return saved

    def undo(saved: list[tuple[int, float]]) -> None:
        for d, previous in saved:
            load[d] -= 1
            maxlat[d] = previous

    def hopeless(step: float, last: int, left: int, hops_left: int) -> bool:
        if sense > 0:
            if step >= best * (1 - _REL_TOL):
                return True
            if not can_in[0] & (left | 1 << last):
                return True
            rest = left
            while rest:
                bit = rest & -rest
                w = bit.bit_length() - 1
                rest ^= bit
                if not can_in[w] & (left | 1 << last) & ~bit or not can_out[w] & (left | 1) & ~bit:
                    return True
            return False
        upper = step
        for d in used_edges:
            cost = (maxlat[d] if maxlat[d] > max_lat_on[d] else max_lat_on[d]) + (load[d] + hops_left) * wire[d]
            if cost > upper:
                upper = cost
        return upper <= best * (1 + _REL_TOL)

    def dfs(step: float, left: int) -> bool:
        nonlocal best, best_order
        budget[0] -= 1
        if budget[0] < 0:
            return False
        last = order[-1]
        if not left:
            if p > 2 and cls[order[1]] > cls[order[-1]]:
                return True
            final = child_step(last, 0, step)
            if (final < best * (1 - _REL_TOL)) if sense > 0 else (final > best * (1 + _REL_TOL)):
                best, best_order = final, list(order)
                if sense > 0:
                    refresh_masks()
            return True
        children = []
        for c in class_list:
            if used[c] < len(members[c]):
                v = members[c][used[c]]
                children.append((sense * child_step(last, v, step), v, c))
        children.sort()
        hops_left = left.bit_count()
        for signed_step, v, c in children:
            new_step = sense * signed_step
            saved = add_hop(last, v)
            used[c] += 1
            order.append(v)
            rest = left & ~(1 << v)
            ok = hopeless(new_step, v, rest, hops_left) or dfs(new_step, rest)
            order.pop()
            used[c] -= 1
            undo(saved)
            if not ok:
                return False
        return True

    exhausted = dfs(0.0, (1 << p) - 2)
    return best_order, best, exhausted


def _canonical_ring_count(cls: list[int]) -> int:
    """Rings the exact search scores at most: host 0 first, twins in order, one of two mirror images."""
    sizes: dict[int, int] = {}
    for c in cls:
        sizes[c] = sizes.get(c, 0) + 1
    count = math.factorial(len(cls) - 1)
    for c, size in sizes.items():
        count //= math.factorial(size - 1 if c == cls[0] else size)
    return max(1, count // 2)


def _search(topology: Topology, n_bytes: float, hosts: tuple[str, ...] | None, sense: int, node_budget: int) -> RingResult:
    names = tuple(hosts) if hosts is not None else topology.hosts
    model = topology.ring_model(names, n_bytes)
    p = model.p
    if p < 3:
        step = topology.ring_step_s(names, n_bytes)
        return RingResult(order=names, step_s=step, allreduce_s=2 * (p - 1) * step, exact=True)
    order = _local_search(model, _greedy(model, sense), sense)
    exact = False
    if p <= EXACT_SEARCH_MAX_HOSTS:
        # Maximising has only a weak bound, so it runs only where enumeration fits.
        if sense > 0 or _canonical_ring_count(twin_classes(model)) * p <= node_budget:
            order, _, exact = _branch_and_bound(model, order, sense, node_budget)
    step = model.evaluate(order)[0]
    return RingResult(
        order=tuple(names[i] for i in order), step_s=step, allreduce_s=2 * (p - 1) * step, exact=exact
    )


def best_ring_order(
    topology: Topology,
    n_bytes: float,
    hosts: tuple[str, ...] | None = None,
    node_budget: int = DEFAULT_NODE_BUDGET,
) -> RingResult:
    """Fastest ring order for a ring all-reduce of ``n_bytes`` over ``hosts`` (default all).

    Exact (branch and bound) up to ``EXACT_SEARCH_MAX_HOSTS`` hosts, greedy + 2-opt +
    Or-opt above; ``RingResult.exact`` says which. The first host stays first.
    """
    return _search(topology, n_bytes, hosts, +1, node_budget)


def worst_ring_order(
    topology: Topology,
    n_bytes: float,
    hosts: tuple[str, ...] | None = None,
    node_budget: int = DEFAULT_NODE_BUDGET,
) -> RingResult:
    """Slowest ring order, to show what a bad rank order costs.

    Exact where the distinct rings (after symmetries) fit in ``node_budget``, e.g.
    hosts behind one or two switches; otherwise the worst order local search finds.
    """
    return _search(topology, n_bytes, hosts, -1, node_budget)

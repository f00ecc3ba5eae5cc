"""Physical link graph of a cluster, its TOML form, shortest-path routing and ring cost.

Nodes are hosts (the boxes that run ranks) and switches; edges are cables with a
bandwidth (GB/s per direction, full duplex) and a latency (seconds per message,
software included). A cluster TOML file describes it (``[cluster]`` is read by
``shardwise.spec.hardware.load_cluster_file``; a file for ``shardwise ring`` may hold
only the three arrays)::

    [cluster]
    box = "dgx-spark"          # catalog key
    link = "200g-roce"         # catalog key: default bandwidth/latency of [[links]]

    [[hosts]]
    name = "spark-01"
    [[hosts]]
    name = "spark-02"

    [[switches]]
    name = "sw-a"

    [[links]]                  # one entry per cable; a and b are host or switch names
    a = "spark-01"
    b = "sw-a"
    bandwidth_gbps = 12.5      # GB/s per direction; optional when [cluster] link is set
    latency_s = 5e-6           # seconds; optional when [cluster] link is set
    [[links]]
    a = "spark-02"
    b = "sw-a"

A switchless ring is hosts only, each linked to its two neighbours. Two cables between
the same pair are one entry with the summed bandwidth.

Routing takes the lowest-latency path between two hosts (ties: fewest hops, then node
names), and the route from b to a is the route from a to b reversed.

Ring cost: in each of the ``2(p−1)`` steps of a ring all-reduce over host order
``h0 … h(p−1)`` every rank sends ``n/p`` bytes to its successor at the same time. A
directed edge carried by ``load`` ring hops moves ``load · n/p`` bytes in that step, so
hop ``h`` takes ``latency(h) + max over its edges of load · (n/p) / bandwidth`` and the
step takes as long as the slowest hop. The search for the best and worst ring order is
``shardwise.perf.ring_order``.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from shardwise.errors import ShardwiseError, unknown_name


@dataclass(frozen=True)
class Edge:
    """One full-duplex cable: ``bandwidth_gbps`` GB/s each way, ``latency_s`` seconds per message."""

    a: str
    b: str
    bandwidth_gbps: float
    latency_s: float


def _check_edge(edge: Edge, label: str, nodes: dict[str, int]) -> None:
    for end in (edge.a, edge.b):
        if end not in nodes:
            raise ShardwiseError(f"{label}: {unknown_name('host or switch', end, nodes)}")
    if edge.a == edge.b:
        raise ShardwiseError(f"{label}: a and b are both '{edge.a}'; a link joins two different nodes")
    if not edge.bandwidth_gbps > 0:
        raise ShardwiseError(f"{label}: bandwidth_gbps must be > 0, got {edge.bandwidth_gbps:g}")
    if not edge.latency_s >= 0:
        raise ShardwiseError(f"{label}: latency_s must be >= 0, got {edge.latency_s:g}")


@dataclass(frozen=True)
class _Routes:
    """Routes between host positions: hop latency (s) and directed edge ids per ordered pair."""

    latency_s: tuple[tuple[float, ...], ...]
    edges: tuple[tuple[tuple[int, ...], ...], ...]
    nodes: tuple[tuple[tuple[int, ...], ...], ...]
    bandwidth_bytes_per_s: tuple[float, ...]


@dataclass(frozen=True)
class Topology:
    """Hosts, switches and the cables between them (see the module docstring)."""

    hosts: tuple[str, ...]
    switches: tuple[str, ...] = ()
    edges: tuple[Edge, ...] = ()
    edge_labels: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ShardwiseError("hosts: a topology needs at least one [[hosts]] entry")
        seen: dict[str, int] = {}
        for kind, names in (("hosts", self.hosts), ("switches", self.switches)):
            for i, name in enumerate(names):
                if not isinstance(name, str) or not name:
                    raise ShardwiseError(f"{kind}[{i}]: name must be a non-empty string, got {name!r}")
                if name in seen:
                    raise ShardwiseError(f"{kind}[{i}]: name '{name}' is used twice; give every host and switch its own name")
                seen[name] = len(seen)
        labels = self.edge_labels or tuple(f"links[{i}]" for i in range(len(self.edges)))
        pairs: dict[frozenset[str], str] = {}
        for edge, label in zip(self.edges, labels, strict=True):
            _check_edge(edge, label, seen)
            pair = frozenset((edge.a, edge.b))
            if pair in pairs:
                raise ShardwiseError(
                    f"{label}: {edge.a} and {edge.b} are already joined by {pairs[pair]}; "
                    "write parallel cables as one entry with the summed bandwidth_gbps"
                )
            pairs[pair] = label
        self._check_connected()

    @property
    def nodes(self) -> tuple[str, ...]:
        """Hosts then switches."""
        return self.hosts + self.switches

    def _adjacency(self) -> list[list[tuple[int, int]]]:
        index = {name: i for i, name in enumerate(self.nodes)}
        adjacency: list[list[tuple[int, int]]] = [[] for _ in self.nodes]
        for k, edge in enumerate(self.edges):
            adjacency[index[edge.a]].append((index[edge.b], 2 * k))
            adjacency[index[edge.b]].append((index[edge.a], 2 * k + 1))
        return adjacency

    def _check_connected(self) -> None:
        adjacency = self._adjacency()
        reached = {0}
        frontier = [0]
        while frontier:
            node = frontier.pop()
            for other, _ in adjacency[node]:
                if other not in reached:
                    reached.add(other)
                    frontier.append(other)
        missing = [name for i, name in enumerate(self.nodes) if i not in reached]
        if missing:
            raise ShardwiseError(
                f"links: {', '.join(missing)} not connected to {self.hosts[0]}; add [[links]] entries that join them"
            )

    @cached_property
    def _routes(self) -> _Routes:
        adjacency = self._adjacency()
        latency = [edge.latency_s for edge in self.edges]
        names = self.nodes
        p = len(self.hosts)
        hop_latency = [[0.0] * p for _ in range(p)]
        hop_edges: list[list[tuple[int, ...]]] = [[()] * p for _ in range(p)]
        hop_nodes: list[list[tuple[int, ...]]] = [[(i,)] * p for i in range(p)]
        for source in range(p):
            # Dijkstra on (latency, hops, node-name sequence): deterministic tie-breaks.
            best: dict[int, tuple[float, int, tuple[str, ...]]] = {source: (0.0, 0, (names[source],))}
            via: dict[int, tuple[int, int]] = {}
            heap = [(0.0, 0, (names[source],), source)]
            done: set[int] = set()
            while heap:
                lat, hops, seq, node = heapq.heappop(heap)
                if node in done:
                    continue
                done.add(node)
                for other, directed in adjacency[node]:
                    key = (lat + latency[directed // 2], hops + 1, seq + (names[other],))
                    if other not in done and (other not in best or key < best[other]):
                        best[other] = key
                        via[other] = (node, directed)
                        heapq.heappush(heap, (*key, other))
            for target in range(source + 1, p):
                path_edges: list[int] = []
                path_nodes = [target]
                node = target
                while node != source:
                    node, directed = via[node]
                    path_edges.append(directed)
                    path_nodes.append(node)
                path_edges.reverse()
                path_nodes.reverse()
                hop_latency[source][target] = hop_latency[target][source] = best[target][0]
                hop_edges[source][target] = tuple(path_edges)
                hop_edges[target][source] = tuple(d ^ 1 for d in reversed(path_edges))
                hop_nodes[source][target] = tuple(path_nodes)
                hop_nodes[target][source] = tuple(reversed(path_nodes))
        bandwidth = tuple(edge.bandwidth_gbps * 1e9 for edge in self.edges for _ in (0, 1))
        return _Routes(
            latency_s=tuple(map(tuple, hop_latency)),
            edges=tuple(map(tuple, hop_edges)),
            nodes=tuple(map(tuple, hop_nodes)),
            bandwidth_bytes_per_s=bandwidth,
        )

    def _host_positions(self, order: tuple[str, ...] | list[str]) -> list[int]:
        position = {name: i for i, name in enumerate(self.hosts)}
        ids = []
        for name in order:
            if name not in position:
                raise ShardwiseError(f"ring order: {unknown_name('host', name, self.hosts)}")
            ids.append(position[name])
        if len(set(ids)) != len(ids):
            raise ShardwiseError(f"ring order: a host appears twice in {list(order)}; list each host once")
        if not ids:
            raise ShardwiseError("ring order: give at least one host")
        return ids

    def route(self, a: str, b: str) -> tuple[str, ...]:
        """Node names on the route from host ``a`` to host ``b``, both ends included."""
        i, j = self._host_positions([a, b]) if a != b else self._host_positions([a]) * 2
        return tuple(self.nodes[k] for k in self._routes.nodes[i][j])

    def path_latency_s(self, a: str, b: str) -> float:
        """Latency (s) of the route from host ``a`` to host ``b``: the sum over its cables."""
        i, j = self._host_positions([a, b]) if a != b else self._host_positions([a]) * 2
        return self._routes.latency_s[i][j]

    def edge_loads(self, order: tuple[str, ...] | list[str]) -> dict[tuple[str, str], int]:
        """Ring hops carried by each cable direction ``(from, to)`` for the ring ``order``."""
        ids = self._host_positions(order)
        loads: dict[tuple[str, str], int] = {}
        if len(ids) < 2:
            return loads
        for u, v in zip(ids, ids[1:] + ids[:1], strict=True):
            for directed in self._routes.edges[u][v]:
                edge = self.edges[directed // 2]
                key = (edge.a, edge.b) if directed % 2 == 0 else (edge.b, edge.a)
                loads[key] = loads.get(key, 0) + 1
        return loads

    def ring_model(self, order: tuple[str, ...] | list[str], n_bytes: float) -> RingModel:
        """Ring cost over the hosts in ``order`` (indexed 0..p−1 in that order) for ``n_bytes``."""
        ids = self._host_positions(order)
        return RingModel(self._routes, ids, ring_chunk_bytes(n_bytes, len(ids)))

    def ring_step_s(self, order: tuple[str, ...] | list[str], n_bytes: float) -> float:
        """Seconds of one ring step (every rank sends ``n_bytes / p`` to its successor)."""
        model = self.ring_model(order, n_bytes)
        if model.p < 2:
            return 0.0
        return model.evaluate(list(range(model.p)))[0]

    def ring_allreduce_time(self, order: tuple[str, ...] | list[str], n_bytes: float) -> float:
        """Seconds of a ring all-reduce of ``n_bytes`` over ``order``: ``2(p−1)`` ring steps."""
        return 2 * (len(order) - 1) * self.ring_step_s(order, n_bytes)


def ring_chunk_bytes(n_bytes: float, p: int) -> float:
    """Bytes each rank sends per ring step: ``n_bytes / p``."""
    if not n_bytes >= 0:
        raise ShardwiseError(f"message size must be >= 0 bytes, got {n_bytes}")
    return n_bytes / p


class RingModel:
    """Ring cost over a subset of hosts, indexed 0..p−1, for one chunk size (bytes)."""

    def __init__(self, routes: _Routes, host_ids: list[int], chunk_bytes: float) -> None:
        p = len(host_ids)
        self.p = p
        self.latency = [[routes.latency_s[host_ids[i]][host_ids[j]] for j in range(p)] for i in range(p)]
        self.edges = [[routes.edges[host_ids[i]][host_ids[j]] for j in range(p)] for i in range(p)]
        self.nodes = [[routes.nodes[host_ids[i]][host_ids[j]] for j in range(p)] for i in range(p)]
        self.n_directed = len(routes.bandwidth_bytes_per_s)
        self.wire_s = [chunk_bytes / bw for bw in routes.bandwidth_bytes_per_s]
        self.base = [
            [self.latency[i][j] + max(self.wire_s[d] for d in self.edges[i][j]) if i != j else 0.0 for j in range(p)]
            for i in range(p)
        ]

    def evaluate(self, order: list[int]) -> tuple[float, float]:
        """(bottleneck step seconds, sum of hop seconds) of the ring ``order``."""
        load = [0] * self.n_directed
        hops = list(zip(order, order[1:] + order[:1], strict=True))
        for u, v in hops:
            for d in self.edges[u][v]:
                load[d] += 1
        costs = [self.latency[u][v] + max(load[d] * self.wire_s[d] for d in self.edges[u][v]) for u, v in hops]
        return max(costs), sum(costs)


# ---------------------------------------------------------------- TOML reading/writing

_ARRAY_HEADER = re.compile(r"^\s*\[\[\s*([A-Za-z0-9_.-]+)\s*\]\]")


def array_table_lines(text: str) -> dict[str, list[int]]:
    """1-based line numbers of each ``[[name]]`` header in TOML ``text``, by name."""
    lines: dict[str, list[int]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        match = _ARRAY_HEADER.match(line)
        if match:
            lines.setdefault(match.group(1), []).append(number)
    return lines


def _labels(kind: str, count: int, header_lines: dict[str, list[int]], where: str) -> list[str]:
    lines = header_lines.get(kind, [])
    prefix = f"{where}: " if where else ""
    if len(lines) == count:
        return [f"{prefix}{kind}[{i}] (line {lines[i]})" for i in range(count)]
    return [f"{prefix}{kind}[{i}]" for i in range(count)]


def _entries(doc: dict[str, Any], kind: str, where: str) -> list[Any]:
    value = doc.get(kind, [])
    if not isinstance(value, list):
        raise ShardwiseError(f"{where}: '{kind}' must be an array of tables written [[{kind}]]")
    return value


def _number(entry: dict[str, Any], key: str, label: str, default: float | None) -> float:
    if key not in entry:
        if default is None:
            raise ShardwiseError(
                f"{label}: missing {key}; add {key} = ... or set [cluster] link to a catalog link for defaults"
            )
        return default
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShardwiseError(f"{label}: {key} must be a number, got {value!r}")
    return float(value)


def _names(entries: list[Any], labels: list[str]) -> tuple[str, ...]:
    names = []
    for entry, label in zip(entries, labels, strict=True):
        if not isinstance(entry, dict):
            raise ShardwiseError(f"{label}: must be a table with name = \"...\"")
        extra = sorted(set(entry) - {"name"})
        if extra:
            raise ShardwiseError(f"{label}: unknown key '{extra[0]}'; the only key is name")
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ShardwiseError(f"{label}: name must be a non-empty string, got {entry.get('name')!r}")
        names.append(entry["name"])
    return tuple(names)


def topology_from_toml(
    doc: dict[str, Any],
    text: str = "",
    where: str = "",
    default_bandwidth_gbps: float | None = None,
    default_latency_s: float | None = None,
) -> Topology | None:
    """Topology from a parsed cluster TOML document, or None when it has no [[hosts]].

    ``text`` (the raw file) lets errors name TOML line numbers; ``where`` (the file
    name) prefixes them. Links without bandwidth/latency take the defaults, else fail.
    """
    header_lines = array_table_lines(text)
    host_entries = _entries(doc, "hosts", where)
    switch_entries = _entries(doc, "switches", where)
    link_entries = _entries(doc, "links", where)
    if not host_entries:
        if switch_entries or link_entries:
            raise ShardwiseError(f"{where or 'topology'}: [[links]]/[[switches]] given without [[hosts]]; add one [[hosts]] per box")
        return None
    hosts = _names(host_entries, _labels("hosts", len(host_entries), header_lines, where))
    switches = _names(switch_entries, _labels("switches", len(switch_entries), header_lines, where))
    nodes = {name: i for i, name in enumerate(hosts + switches)}
    labels = _labels("links", len(link_entries), header_lines, where)
    edges = []
    for entry, label in zip(link_entries, labels, strict=True):
        if not isinstance(entry, dict):
            raise ShardwiseError(f"{label}: must be a table with a, b, bandwidth_gbps, latency_s")
        extra = sorted(set(entry) - {"a", "b", "bandwidth_gbps", "latency_s"})
        if extra:
            raise ShardwiseError(f"{label}: unknown key '{extra[0]}'; keys are a, b, bandwidth_gbps, latency_s")
        for end in ("a", "b"):
            if not isinstance(entry.get(end), str):
                raise ShardwiseError(f"{label}: {end} must name a host or switch, got {entry.get(end)!r}")
        edge = Edge(
            a=entry["a"],
            b=entry["b"],
            bandwidth_gbps=_number(entry, "bandwidth_gbps", label, default_bandwidth_gbps),
            latency_s=_number(entry, "latency_s", label, default_latency_s),
        )
        _check_edge(edge, label, nodes)
        edges.append(edge)
    return Topology(hosts=hosts, switches=switches, edges=tuple(edges), edge_labels=tuple(labels))


def topology_to_toml(topology: Topology) -> dict[str, Any]:
    """The ``hosts``/``switches``/``links`` arrays of a cluster TOML document."""
    doc: dict[str, Any] = {"hosts": [{"name": name} for name in topology.hosts]}
    if topology.switches:
        doc["switches"] = [{"name": name} for name in topology.switches]
    if topology.edges:
        doc["links"] = [
            {"a": e.a, "b": e.b, "bandwidth_gbps": e.bandwidth_gbps, "latency_s": e.latency_s} for e in topology.edges
        ]
    return doc

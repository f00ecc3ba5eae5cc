"""Routing, ring cost and ring order search on synthetic link graphs."""

import itertools
import random
import time

import pytest

from shardwise.errors import ShardwiseError
from shardwise.perf.ring_order import best_ring_order, worst_ring_order
from shardwise.spec.hardware import load_topology_file
from shardwise.spec.topology import Edge, Topology

LAT = 5e-6


def two_switches(per_switch=4, uplink_gbps=1.0):
    hosts = tuple(name for i in range(per_switch) for name in (f"a{i + 1}", f"b{i + 1}"))  # interleaved
    edges = [Edge(h, "sw-a" if h[0] == "a" else "sw-b", 12.5, LAT) for h in hosts]
    edges.append(Edge("sw-a", "sw-b", uplink_gbps, LAT))
    return Topology(hosts=hosts, switches=("sw-a", "sw-b"), edges=tuple(edges))


def test_ring_cost_by_hand_on_two_switches():
    topo = two_switches()
    n = 8e6  # chunk 1 MB: 80 us on a 12.5 GB/s cable, 1 ms on the 1 GB/s uplink
    # Listed order a1 b1 a2 b2 ...: all 8 hops cross the uplink, 4 each way.
    loads = topo.edge_loads(topo.hosts)
    assert loads[("sw-a", "sw-b")] == 4 and loads[("sw-b", "sw-a")] == 4
    step = 3 * LAT + 4 * 1e6 / 1e9
    assert topo.ring_step_s(topo.hosts, n) == pytest.approx(step)
    assert topo.ring_allreduce_time(topo.hosts, n) == pytest.approx(14 * step)


@pytest.mark.parametrize("n_bytes", [14336, 8e6])
def test_search_crosses_slow_uplink_once_each_way(n_bytes):
    topo = two_switches()
    best = best_ring_order(topo, n_bytes)
    loads = topo.edge_loads(best.order)
    assert loads[("sw-a", "sw-b")] == 1 and loads[("sw-b", "sw-a")] == 1
    assert best.exact
    listed = topo.ring_allreduce_time(topo.hosts, n_bytes)
    assert best.allreduce_s < listed
    # crossing hop: 3 cables, uplink load 1 -> 3*5us + chunk/1e9
    chunk = n_bytes / 8
    assert best.step_s == pytest.approx(3 * LAT + chunk / 1e9)
    worst = worst_ring_order(topo, n_bytes)
    assert worst.exact and worst.allreduce_s == pytest.approx(listed)


def brute_force(topo, n_bytes, pick):
    first, rest = topo.hosts[0], topo.hosts[1:]
    return pick(topo.ring_allreduce_time((first, *perm), n_bytes) for perm in itertools.permutations(rest))


def random_topology(hosts, switches, seed):
    rng = random.Random(seed)
    nodes = [f"h{i}" for i in range(hosts)] + [f"s{i}" for i in range(switches)]
    order = nodes[:]
    rng.shuffle(order)
    pairs = {frozenset((order[i], order[rng.randrange(i)])) for i in range(1, len(order))}  # spanning tree
    for a, b in itertools.combinations(nodes, 2):
        if rng.random() < 0.3:
            pairs.add(frozenset((a, b)))
    edges = tuple(Edge(*sorted(pair), rng.uniform(1, 50), rng.uniform(1e-6, 3e-5)) for pair in sorted(pairs, key=sorted))
    return Topology(hosts=tuple(nodes[:hosts]), switches=tuple(nodes[hosts:]), edges=edges)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_bytes", [14336, 5e7])
def test_exact_search_equals_brute_force(seed, n_bytes):
    topo = random_topology(6 + seed % 2, seed % 3, seed)
    best = best_ring_order(topo, n_bytes)
    assert best.exact
    assert best.allreduce_s == pytest.approx(brute_force(topo, n_bytes, min), rel=1e-9)
    assert topo.ring_allreduce_time(best.order, n_bytes) == pytest.approx(best.allreduce_s)
    worst = worst_ring_order(topo, n_bytes)
    assert worst.allreduce_s == pytest.approx(brute_force(topo, n_bytes, max), rel=1e-9)


def test_symmetry_pruning_equals_brute_force_on_uneven_switches():
    # 7 hosts: 3 on a fast switch, 3 on another, 1 host on a slow direct cable: twins prune.
    hosts = ("x1", "x2", "x3", "y1", "y2", "y3", "z")
    edges = [Edge(h, "sx", 25, 2e-6) for h in hosts[:3]] + [Edge(h, "sy", 10, 3e-6) for h in hosts[3:6]]
    edges += [Edge("sx", "sy", 2, 4e-6), Edge("z", "sy", 1, 9e-6)]
    topo = Topology(hosts=hosts, switches=("sx", "sy"), edges=tuple(edges))
    for n_bytes in (14336, 4e7):
        assert best_ring_order(topo, n_bytes).allreduce_s == pytest.approx(brute_force(topo, n_bytes, min))
        assert worst_ring_order(topo, n_bytes).allreduce_s == pytest.approx(brute_force(topo, n_bytes, max))


def test_switchless_ring_recovers_cable_order():
    rng = random.Random(7)
    names = [f"n{i:02d}" for i in range(10)]
    cable_order = names[:]
    rng.shuffle(cable_order)
    edges = tuple(Edge(cable_order[i], cable_order[(i + 1) % 10], 25, LAT) for i in range(10))
    topo = Topology(hosts=tuple(names), edges=edges)
    best = best_ring_order(topo, 14336)
    assert best.exact
    assert all(load == 1 for load in topo.edge_loads(best.order).values())
    assert best.step_s == pytest.approx(LAT + 14336 / 10 / 25e9)
    # a hop between non-neighbours is routed around the ring through other hosts
    assert len(topo.route(cable_order[0], cable_order[3])) == 4


def test_sixteen_hosts_two_switches_exact_and_fast():
    topo = two_switches(per_switch=8)
    start = time.perf_counter()
    best = best_ring_order(topo, 14336)
    worst = worst_ring_order(topo, 14336)
    elapsed = time.perf_counter() - start
    assert best.exact and worst.exact
    assert topo.edge_loads(best.order)[("sw-a", "sw-b")] == 1
    assert elapsed < 5.0


def test_routes_prefer_low_latency_then_fewer_hops():
    edges = (
        Edge("a", "b", 10, 10e-6),
        Edge("a", "s", 10, 2e-6),
        Edge("s", "b", 10, 2e-6),
    )
    topo = Topology(hosts=("a", "b"), switches=("s",), edges=edges)
    assert topo.route("a", "b") == ("a", "s", "b")
    assert topo.path_latency_s("b", "a") == pytest.approx(4e-6)


def write(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


HOSTS = '[[hosts]]\nname = "h1"\n[[hosts]]\nname = "h2"\n[[switches]]\nname = "sw"\n'


def test_bad_files_name_the_entry(tmp_path):
    bad_bw = HOSTS + (
        '[[links]]\na = "h1"\nb = "sw"\nbandwidth_gbps = 12.5\nlatency_s = 5e-6\n'
        '[[links]]\na = "h2"\nb = "sw"\nbandwidth_gbps = -1\nlatency_s = 5e-6\n'
    )
    with pytest.raises(ShardwiseError, match=r"links\[1\] \(line 12\): bandwidth_gbps must be > 0, got -1"):
        load_topology_file(write(tmp_path, bad_bw))
    unknown = HOSTS + '[[links]]\na = "h1"\nb = "sw"\n[[links]]\na = "h3"\nb = "sw"\n'
    unknown = '[cluster]\nlink = "100g-roce"\n' + unknown
    with pytest.raises(ShardwiseError, match=r"links\[1\] \(line 12\): unknown host or switch 'h3': did you mean h2, h1"):
        load_topology_file(write(tmp_path, unknown))
    disconnected = HOSTS + '[[links]]\na = "h1"\nb = "sw"\nbandwidth_gbps = 1\nlatency_s = 0\n'
    with pytest.raises(ShardwiseError, match="h2 not connected to h1"):
        load_topology_file(write(tmp_path, disconnected))
    no_defaults = HOSTS + '[[links]]\na = "h1"\nb = "sw"\n'
    with pytest.raises(ShardwiseError, match=r"links\[0\] \(line 7\): missing bandwidth_gbps"):
        load_topology_file(write(tmp_path, no_defaults))
    with pytest.raises(ShardwiseError, match="not valid TOML"):
        load_topology_file(write(tmp_path, "[[hosts]\nname="))


def test_links_take_cluster_link_defaults(tmp_path):
    text = '[cluster]\nlink = "roce-100g"\n' + HOSTS + '[[links]]\na = "h1"\nb = "sw"\n[[links]]\na = "h2"\nb = "sw"\n'
    topo = load_topology_file(write(tmp_path, text))
    assert topo.edges[0].bandwidth_gbps == 12.25 and topo.edges[0].latency_s == 1.1e-5

"""Shaped namespace networks: cleanup, and the best ring order beating the worst on real links."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.errors import ShardwiseError
from shardwise.testing.netns import shaped_network, unavailable_reason
from shardwise.perf.ring_order import best_ring_order, worst_ring_order
from shardwise.spec.topology import Edge, Topology

SRC = str(Path(__file__).resolve().parents[1] / "src")
REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

SLOW_GBPS = 0.01  # 80 Mbit/s between the two switches; host ports are left unshaped
TWO_RACKS = Topology(
    hosts=("a", "b", "c", "d"),
    switches=("s1", "s2"),
    edges=(
        Edge("a", "s1", 10.0, 1e-5), Edge("c", "s1", 10.0, 1e-5),
        Edge("b", "s2", 10.0, 1e-5), Edge("d", "s2", 10.0, 1e-5),
        Edge("s1", "s2", SLOW_GBPS, 1e-5),
    ),
)

RANK_SCRIPT = r"""
import json, sys, time
import torch
import torch.distributed as dist
from shardwise.runtime.comm import ring_allreduce
from shardwise.runtime.rendezvous import init_from_env
torch.set_num_threads(1)
init_from_env("gloo", timeout_s=30)
orders, n = json.loads(sys.argv[1]), int(sys.argv[2])
buf = torch.zeros(n // 4)
out = {}
for name, order in orders.items():
    ring_allreduce(buf, order)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        ring_allreduce(buf, order)
        times.append(time.perf_counter() - t0)
    out[name] = min(times)
print(json.dumps(out))
"""


def _namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def test_namespaces_are_removed_even_on_failure():
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with shaped_network(TWO_RACKS) as net:
            assert set(net.namespaces.values()) <= _namespaces()
            raise RuntimeError("boom")
    assert _namespaces() == before


def test_direct_host_cables_are_refused_before_anything_is_built():
    ring = Topology(hosts=("a", "b", "c"), edges=(Edge("a", "b", 1, 0), Edge("b", "c", 1, 0), Edge("c", "a", 1, 0)))
    before = _namespaces()
    with pytest.raises(ShardwiseError, match="joins two hosts"):
        with shaped_network(ring):
            pass
    assert _namespaces() == before


def test_best_ring_order_beats_worst_on_shaped_links():
    n_bytes = 2 << 20
    best, worst = best_ring_order(TWO_RACKS, n_bytes), worst_ring_order(TWO_RACKS, n_bytes)
    assert worst.allreduce_s > 1.5 * best.allreduce_s  # the worst order crosses the slow cable twice as often
    rank = {host: i for i, host in enumerate(TWO_RACKS.hosts)}
    orders = {"best": [rank[h] for h in best.order], "worst": [rank[h] for h in worst.order]}
    with shaped_network(TWO_RACKS, shape_above_gbps=1.0) as net:
        outputs = net.run([sys.executable, "-c", RANK_SCRIPT, json.dumps(orders), str(n_bytes)], timeout_s=150,
                          env={"PYTHONPATH": SRC})
    times = json.loads(outputs[0].strip().splitlines()[-1])
    assert times["best"] < times["worst"], times
    assert times["best"] >= 0.5 * best.allreduce_s  # the slow cable really limits it

"""Shaped test networks: Linux network namespaces joined by veth pairs through bridges.

``shaped_network(topology)`` turns a ``spec.topology.Topology`` whose hosts each hang off one
switch (one switch = a star; two switches joined by a cable = two racks) into real
kernel networking, and always tears it down again (context manager, also on errors):

- every host becomes a namespace with one interface ``eth0`` at ``10.R.0.(i+1)/24``;
- every switch becomes a namespace holding a Linux bridge; every cable becomes a veth
  pair, its ends in the two namespaces (bridge ports on the switch side);
- a cable's ``bandwidth_gbps`` (GB/s) becomes a ``tbf`` qdisc on both of its ends (the
  kernel's token bucket: ``rate`` in bit/s), so each direction is limited separately.
  Its ``latency_s`` is not emulated (``netem`` is not available everywhere); the
  software α of gloo is there anyway.

``ShapedNetwork.run(argv)`` starts one process per host inside its namespace
(``ip netns exec``) with torchrun's variables set (RANK = host index, MASTER_ADDR =
host 0's address, GLOO_SOCKET_IFNAME=eth0), waits with a time limit and kills every
process on failure or timeout. Needs root (CAP_NET_ADMIN) and ``ip`` / ``tc``;
``unavailable_reason()`` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError
from shardwise.spec.topology import Topology

_CMD_TIMEOUT_S = 20.0


def _ip(*args: str) -> None:
    _sh(["ip", *args])


def _sh(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ShardwiseError(f"'{' '.join(argv)}' did not finish within {_CMD_TIMEOUT_S:g} s") from None
    if done.returncode:
        raise ShardwiseError(f"'{' '.join(argv)}' failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None when they can): not root, no ``ip`` or
    ``tc``, or the kernel refuses a namespace or a tbf qdisc."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    name = f"swchk{os.getpid() % 100000}"
    try:
        _ip("netns", "add", name)
        try:
            _ip("-n", name, "link", "add", "ck0", "type", "veth", "peer", "name", "ck1")
            _sh(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "ck0", "root", "tbf",
                 "rate", "100mbit", "burst", "32kb", "latency", "100ms"])
        finally:
            _ip("netns", "del", name)
    except ShardwiseError as exc:
        return f"namespaces or tbf not permitted here: {exc}"
    return None


@dataclass
class ShapedNetwork:
    """A live shaped network: namespace and address per host (see ``shaped_network``)."""

    topology: Topology
    tag: str
    namespaces: dict[str, str] = field(default_factory=dict)  # host or switch -> namespace
    addresses: dict[str, str] = field(default_factory=dict)  # host -> IPv4 address

    def address(self, host: str) -> str:
        """IPv4 address of ``host``'s eth0."""
        return self.addresses[host]

    def run(self, argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None,
            port: int = 29500) -> list[str]:
        """Run ``argv`` once per host inside its namespace as ranks 0..n−1 (host order), with
        torchrun's environment; returns each rank's stdout. Kills all of them and raises a
        one-line error when one fails or ``timeout_s`` passes."""
        hosts = self.topology.hosts
        base = {**os.environ, **(env or {}), "WORLD_SIZE": str(len(hosts)), "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": self.addresses[hosts[0]], "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1"}
        procs = []
        try:
            for rank, host in enumerate(hosts):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", self.namespaces[host], *argv],
                    env={**base, "RANK": str(rank), "LOCAL_RANK": "0"},
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                ))
            deadline = time.monotonic() + timeout_s
            outputs = []
            for rank, proc in enumerate(procs):
                try:
                    out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise ShardwiseError(f"ranks in namespaces still running after {timeout_s:g} s (rank {rank} first)") from None
                if proc.returncode:
                    tail = (err.strip().splitlines() or ["no output"])[-1]
                    raise ShardwiseError(f"rank {rank} ({hosts[rank]}) exited with {proc.returncode}: {tail}")
                outputs.append(out)
            return outputs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _check_shape(topology: Topology) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(switch of each host, switch-to-switch cables); one-line errors for shapes a bridge
    network cannot realise (a host with several cables or a direct host cable, switch loops)."""
    hosts, switches = set(topology.hosts), set(topology.switches)
    uplink: dict[str, str] = {}
    trunks = []
    for edge in topology.edges:
        ends = {edge.a, edge.b}
        if ends <= hosts:
            raise ShardwiseError(f"cable {edge.a}-{edge.b} joins two hosts: shaped networks join hosts through switches")
        if ends <= switches:
            trunks.append((edge.a, edge.b))
            continue
        host = edge.a if edge.a in hosts else edge.b
        if host in uplink:
            raise ShardwiseError(f"host {host} has more than one cable: shaped networks give each host one switch port")
        uplink[host] = edge.b if host == edge.a else edge.a
    if len(trunks) != max(len(switches) - 1, 0):
        raise ShardwiseError("switches must form a tree (bridges without spanning tree cannot have loops)")
    return uplink, trunks


def _shape(namespace: str, dev: str, bandwidth_gbps: float) -> None:
    rate = max(int(bandwidth_gbps * 8e9), 8000)
    burst = max(rate // 8 // 250, 16 * 1024)  # >= one timer tick's worth of bytes at HZ=250
    _sh(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
         "rate", f"{rate}bit", "burst", str(burst), "latency", "500ms"])


@contextmanager
def shaped_network(topology: Topology, shape_above_gbps: float | None = None) -> Iterator[ShapedNetwork]:
    """Build ``topology`` from namespaces, bridges and tbf-limited veth pairs; remove it all
    on exit. Cables faster than ``shape_above_gbps`` (GB/s, None: shape every cable) are
    left unshaped, so only the slow links one wants to study get a qdisc."""
    reason = unavailable_reason()
    if reason:
        raise ShardwiseError(f"cannot build a shaped network: {reason}")
    _check_shape(topology)
    tag = f"{os.getpid() % 10000:04d}{int(time.time() * 1000) % 100:02d}"
    net = ShapedNetwork(topology, tag)
    subnet = 10 + int(tag) % 200
    try:
        for i, node in enumerate(topology.nodes):
            ns = f"sw{tag}n{i}"
            _ip("netns", "add", ns)
            net.namespaces[node] = ns
            _ip("-n", ns, "link", "set", "lo", "up")
            if node in topology.switches:
                _ip("-n", ns, "link", "add", "br0", "type", "bridge")
                _ip("-n", ns, "link", "set", "br0", "up")
        for k, edge in enumerate(topology.edges):
            a, b = (edge.a, edge.b) if edge.a in topology.hosts or edge.b not in topology.hosts else (edge.b, edge.a)
            va, vb = f"v{tag}a{k}", f"v{tag}b{k}"
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            for dev, node in ((va, a), (vb, b)):
                ns = net.namespaces[node]
                _ip("link", "set", dev, "netns", ns)
                if node in topology.hosts:
                    _ip("-n", ns, "link", "set", dev, "name", "eth0")
                    dev_name = "eth0"
                else:
                    _ip("-n", ns, "link", "set", dev, "master", "br0")
                    dev_name = dev
                _ip("-n", ns, "link", "set", dev_name, "up")
                if shape_above_gbps is None or edge.bandwidth_gbps <= shape_above_gbps:
                    _shape(ns, dev_name, edge.bandwidth_gbps)
        for i, host in enumerate(topology.hosts):
            addr = f"10.{subnet}.0.{i + 1}"
            _ip("-n", net.namespaces[host], "addr", "add", f"{addr}/24", "dev", "eth0")
            net.addresses[host] = addr
        yield net
    finally:
        for ns in net.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_CMD_TIMEOUT_S)


"""Microbenchmarks that measure a cluster and turn it into ``Measured`` figures.

``probe_rank`` runs inside every rank of a process group (``launch_local`` on one host,
``torchrun`` across hosts) and measures, with the runtime's own code paths:

- every all-reduce algorithm of ``shardwise.runtime.comm`` over message sizes that
  double from ``min_bytes`` to ``max_bytes``, printed like nccl-tests: time (the
  median of the timed calls on each rank, then the slowest rank: a shared, busy host
  makes means useless), algbw =
  bytes / time and busbw = algbw · 2(p−1)/p (nccl-tests' all-reduce bus bandwidth,
  comparable across rank counts);
- point-to-point ping-pong over each link (half the round trip), from which
  ``fit_alpha_beta`` fits the link's α (seconds per message) and β (bytes per second);
- a STREAM-like triad ``a = b + s·c`` (3 words moved per element) for the memory
  bandwidth one rank sees, all ranks at once, since they share the memory bus;
- dense matmul throughput per dtype (fp32, bf16) in TFLOPS;
- the host cost of one eager torch op (``op_overhead_s``): a small decoder-like block
  timed and divided by the aten ops it dispatches (counted by ``count_ops``); at batch 1
  on small models this, not bandwidth, sets the speed of an eager runtime;
- the cost of one all-reduce *inside a decode step* per algorithm
  (``collective_in_decode_s``): the same block with each layer's two all-reduces running
  the algorithm, on every rank at once, minus the block alone, per all-reduce. Between
  back-to-back calls the ranks arrive together and stay awake; in a decode step they
  arrive from compute with skew and a blocked rank must be woken, which on a shared or
  busy host costs several times the tight-loop latency.

``summarize`` (parent side, numpy only) fits α/β per link and for the ring, derives the
per-call software overhead of each algorithm (from the in-decode cost where measured, else
from the tight-loop table) and builds the probe document; the cluster file it describes is
what ``shardwise plan --cluster`` reads.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError

PROBE_ALGORITHMS = ("ring", "rd", "oneshot", "two-level", "builtin")
"""All-reduce algorithms the probe times (names of ``runtime.comm.ALLREDUCE_ALGORITHMS``)."""

OVERHEAD_MAX_BYTES = 16384
"""Sizes up to this are latency-bound: the per-call overhead is read from them."""


@dataclass(frozen=True)
class ProbeConfig:
    """What to measure; picklable, the same on every rank.

    Sizes are bytes, ``iters`` timed repetitions per point (fewer above 1 MiB so the
    default run stays short), ``triad_bytes`` the size of each triad array (keep it well
    above the last-level cache), ``matmul_size`` the square matrix side.
    """

    min_bytes: int = 8
    max_bytes: int = 4 << 20
    iters: int = 20
    warmup: int = 3
    algorithms: tuple[str, ...] = PROBE_ALGORITHMS
    triad_bytes: int = 64 << 20
    matmul_size: int = 512
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    threads: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ShardwiseError(
                f"--min-bytes {self.min_bytes} and --max-bytes {self.max_bytes}: need 1 <= min <= max"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ShardwiseError(f"--iters must be >= 1 (got {self.iters}) and warmup >= 0 (got {self.warmup})")
        unknown = [a for a in self.algorithms if a not in PROBE_ALGORITHMS]
        if unknown:
            raise ShardwiseError(f"unknown all-reduce algorithm '{unknown[0]}': use {', '.join(PROBE_ALGORITHMS)}")
        if self.triad_bytes < 4096 or self.matmul_size < 16 or self.threads < 1:
            raise ShardwiseError("triad arrays need >= 4 KiB, matmuls >= 16 wide, and threads >= 1")

    def sizes(self) -> list[int]:
        """Message sizes in bytes: ``min_bytes`` doubling up to ``max_bytes``."""
        return message_sizes(self.min_bytes, self.max_bytes)

    def iters_for(self, n_bytes: int) -> int:
        """Timed repetitions for one message size (scaled down above 1 MiB)."""
        return self.iters if n_bytes <= 1 << 20 else max(2, self.iters * (1 << 20) // n_bytes)


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """``min_bytes``, 2·``min_bytes``, … up to ``max_bytes`` (inclusive when on the grid)."""
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= 2
    return sizes


def bus_bandwidth(algbw: float, p: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: ``algbw · 2(p−1)/p`` (0 for one rank)."""
    return algbw * 2 * (p - 1) / p


def fit_alpha_beta(
    n_bytes: Sequence[float], seconds: Sequence[float], messages: float = 1.0, volume: float = 1.0
) -> tuple[float, float]:
    """Robust least-squares (α s, β bytes/s) of ``t = messages·α + volume·n/β``.

    ``messages`` and ``volume`` adapt the fit to an algorithm: a point-to-point message
    is (1, 1), a ring all-reduce over p ranks (2(p−1), 2(p−1)/p). Each point's residual is
    relative to its time, so the latency-bound small sizes fix α as firmly as the large
    ones fix β; Huber reweighting (a few rounds) keeps a point a busy host slowed down
    from dragging the line. α is clipped at 0; a β that comes out non-positive (times
    that do not grow with size) is an error naming the range.
    """
    n = np.asarray(n_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.size < 2 or len(set(n.tolist())) < 2:
        raise ShardwiseError("fitting alpha/beta needs at least 2 points with different message sizes")
    if np.any(t <= 0):
        raise ShardwiseError("fitting alpha/beta needs positive times")
    design = np.stack([np.full_like(n, messages), volume * n], axis=1) / t[:, None]
    weights = np.ones_like(t)
    for _ in range(8):
        sw = np.sqrt(weights)
        (alpha, inv_beta), *_ = np.linalg.lstsq(design * sw[:, None], sw, rcond=None)
        if alpha < 0:  # α at its bound: fit 1/β alone
            alpha = 0.0
            inv_beta = float(np.sum(weights * design[:, 1]) / np.sum(weights * design[:, 1] ** 2))
        residual = np.abs(design @ np.array([alpha, inv_beta]) - 1.0)
        scale = 1.4826 * float(np.median(residual)) or 1e-12
        weights = np.minimum(1.0, 1.345 * scale / np.maximum(residual, 1e-300))
    if inv_beta <= 0:
        raise ShardwiseError(
            f"times do not grow with message size ({t.min():.3g}-{t.max():.3g} s over "
            f"{int(n.min())}-{int(n.max())} B): probe larger sizes with --max-bytes"
        )
    return float(alpha), 1.0 / float(inv_beta)


def ring_alpha_beta(n_bytes: Sequence[float], seconds: Sequence[float], p: int) -> tuple[float, float]:
    """(α, β) of the link from ring all-reduce points over ``p`` ranks (``fit_alpha_beta``)."""
    if p < 2:
        raise ShardwiseError("a ring fit needs at least 2 ranks")
    return fit_alpha_beta(n_bytes, seconds, messages=2 * (p - 1), volume=2 * (p - 1) / p)


# --------------------------------------------------------------------------- inside a rank


def op_counter():
    """A torch dispatch mode whose ``ops`` attribute counts the aten ops dispatched while it
    is active (views and in-place ops included); use as ``with op_counter() as c:``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return _OpCounter()


def count_ops(fn: Callable[[], Any]) -> int:
    """Number of aten ops ``fn()`` dispatches."""
    with op_counter() as counter:
        fn()
    return counter.ops


REFERENCE_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "vocab_size": 256,
                    "num_attention_heads": 4, "head_dim": 32}
"""The reference decoder's sizes: a llama the runtime runs, with sizes no bundled tiny
checkpoint (``make-checkpoint --scale tiny``) uses, so calibrating on it is not fitting the
model later benched."""

REFERENCE_MOE_CONFIG = {**REFERENCE_CONFIG, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64}
"""The MoE reference (a qwen3_moe with the reference sizes; tiny checkpoints use 8 experts,
top-2): routing and the per-expert loop dispatch ops from more Python per op than a dense
MLP does, so MoE layers get their own per-op cost (``op_overhead_moe_s``)."""


def _reference_block(context: int = 16, reduce: Callable[[Any], Any] | None = None, moe: bool = False) -> Callable[[], Any]:
    """One decode step of the runtime's own decoder layers (norms, projections, rotary,
    attention over a static cache, gated MLP) on a small random llama at tp=1: the op mix,
    and the per-op host cost, of the runtime's eager decode path. Each layer's two
    all-reduce hooks run ``reduce`` (default: identity, so the step runs alone inside a
    rank of a larger group; every rank must call a block built with the same ``reduce``).
    ``moe``: the MoE reference (``REFERENCE_MOE_CONFIG``) instead of the dense llama."""
    import torch

    from shardwise.plan import ParallelPlan
    from shardwise.runtime.checkpoint import shrink_config
    from shardwise.runtime.model import ShardedCausalLM
    from shardwise.spec.model import load_model, parse_config

    cfg = shrink_config(dict(load_model("qwen3-30b-a3b" if moe else "llama-3.1-8b").config))
    cfg.update(REFERENCE_MOE_CONFIG if moe else REFERENCE_CONFIG)
    model = ShardedCausalLM(parse_config(cfg, name="probe-reference"), ParallelPlan(), 0, "float32",
                            max_seq_len=context + 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    for layer in model.model.layers:
        layer.reduce_attn = layer.reduce_mlp = reduce or _identity
    positions = torch.tensor([context])
    rope = model.rotary(positions, model.dtype)
    x0 = torch.randn(1, 1, cfg["hidden_size"], generator=g)

    def block():
        h = x0
        for layer in model.model.layers:
            h = layer(h, positions, rope)
        return model.model.norm(h)

    return block


def _identity(t):
    return t


def _block_seconds(block: Callable[[], Any], reps: int, batches: int) -> float:
    """Median over ``batches`` of the mean seconds per call of ``block`` (after 10 warm-ups)."""
    import torch

    with torch.no_grad():
        for _ in range(10):
            block()
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(reps):
                block()
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def measure_op_overhead(reps: int = 20, batches: int = 15, moe: bool = False) -> tuple[float, int]:
    """(seconds per dispatched aten op, ops per block) of the reference block (``moe``: the
    MoE one), eager, as the runtime's plain decode path dispatches it (no ``runtime.exact``
    scope); the median of ``batches`` batches, like the decode steps ``bench`` compares it with."""
    import torch

    block = _reference_block(moe=moe)
    with torch.no_grad():
        ops = count_ops(block)
    return _block_seconds(block, reps, batches) / ops, ops


def measure_collective_in_decode(reduce: Callable[[Any], Any], reps: int = 10, batches: int = 15) -> float:
    """Seconds one all-reduce (``reduce``) adds to a decode step: the reference block with
    its 2 per layer all-reduces minus the block without them, per all-reduce, both timed
    right here on every rank at once (call it on every rank of the group together)."""
    import torch.distributed as dist

    alone = _reference_block()
    with_reduce = _reference_block(reduce=reduce)
    dist.barrier()
    alone_s = _block_seconds(alone, reps, batches)
    dist.barrier()
    with_s = _block_seconds(with_reduce, reps, batches)
    return max(0.0, with_s - alone_s) / (2 * REFERENCE_CONFIG["num_hidden_layers"])


REFERENCE_MESSAGE_BYTES = REFERENCE_CONFIG["hidden_size"] * 4
"""Bytes of the reference block's all-reduce message (one fp32 hidden vector)."""


def measure_host_costs(world: int, algorithms: Sequence[str], batches: int = 15) -> dict[str, Any]:
    """This rank's host costs on the reference blocks: seconds per op of the dense
    (``op_overhead_s``, with ``reference_block_ops``) and MoE (``op_overhead_moe_s``) blocks and,
    with peers, each algorithm's in-decode all-reduce seconds (``collective_in_decode_s``;
    every rank of the group must call this together)."""
    from shardwise.runtime.comm import get_allreduce

    op_s, block_ops = measure_op_overhead(batches=batches)
    out: dict[str, Any] = {
        "op_overhead_s": op_s, "reference_block_ops": block_ops,
        "op_overhead_moe_s": measure_op_overhead(reps=10, batches=batches, moe=True)[0],
        "collective_in_decode_s": {},
    }
    if world > 1:
        for name in algorithms:
            out["collective_in_decode_s"][name] = measure_collective_in_decode(get_allreduce(name), batches=batches)
    return out


def in_decode_overhead_s(name: str, in_decode_s: float, p: int, local: int, alpha: float, beta: float) -> float:
    """Per-call software overhead of all-reduce ``name``: its measured in-decode seconds over
    its α-β time (``_model_seconds``) at the reference message size, at least 0."""
    return max(0.0, in_decode_s - _model_seconds(name, REFERENCE_MESSAGE_BYTES, p, local, alpha, beta))


def measure_triad(n_bytes: int, reps: int = 5) -> float:
    """STREAM triad ``a = b + 3·c`` over float32 arrays of ``n_bytes`` each: best GB/s
    (3 arrays moved per pass: 2 read, 1 written)."""
    import torch

    n = n_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best / 1e9


def measure_matmul(size: int, dtype_name: str, reps: int = 3) -> float:
    """Dense ``size``² matmul throughput in TFLOPS (2·size³ operations per product)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def _link_pairs(world: int, local_world: int, hosts: list[str]) -> list[tuple[int, int, str]]:
    """(rank a, rank b, label) for each link to ping-pong: consecutive hosts' first ranks
    (around the ring of hosts), and two ranks of the first host (the loopback link)."""
    leaders = list(range(0, world, local_world))
    pairs = []
    if len(leaders) > 1:
        ring = list(zip(leaders, leaders[1:] + leaders[:1]))[: len(leaders) if len(leaders) > 2 else 1]
        pairs += [(a, b, f"{hosts[a]}<->{hosts[b]}") for a, b in ring]
    if local_world > 1:
        pairs.append((0, 1, "loopback"))
    return pairs


def probe_rank(rank: int, world: int, cfg: ProbeConfig, progress: Any = None) -> dict[str, Any]:
    """Measure collectives, links, memory and compute on this rank; returns raw figures.

    ``progress`` (rank 0 only uses it) receives ``(advance, label)`` pairs through its
    ``put`` method (a multiprocessing queue from the launcher, or a local callback).
    """
    import torch
    import torch.distributed as dist

    from shardwise.runtime.comm import get_allreduce

    torch.set_num_threads(cfg.threads)

    def tick(label: str) -> None:
        if progress is not None and rank == 0:
            progress.put((1, label))

    hosts = [socket.gethostname()]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
    collectives: dict[str, list[tuple[int, float]]] = {}
    links: list[dict[str, Any]] = []
    if world > 1:
        for name in cfg.algorithms:
            if name == "two-level" and world % local_world:
                continue
            fn = get_allreduce(name)
            points = []
            for n in cfg.sizes():
                buf = torch.zeros(max(1, n // 4))
                for _ in range(cfg.warmup):
                    fn(buf)
                dist.barrier()
                times = []
                for _ in range(cfg.iters_for(n)):
                    t0 = time.perf_counter()
                    fn(buf)
                    times.append(time.perf_counter() - t0)
                elapsed = torch.tensor([statistics.median(times)], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                points.append((n, float(elapsed)))
                tick(f"{name} {n} B")
            collectives[name] = points
        for a, b, label in _link_pairs(world, local_world, hosts):
            points = []
            for n in cfg.sizes():
                buf = torch.zeros(max(1, n // 4))
                iters = cfg.iters_for(n)
                dist.barrier()
                elapsed = torch.zeros(1, dtype=torch.float64)
                if rank in (a, b):
                    peer = b if rank == a else a
                    times = []
                    for _ in range(cfg.warmup + iters):
                        t0 = time.perf_counter()
                        if rank == a:
                            dist.send(buf, peer)
                            dist.recv(buf, peer)
                        else:
                            dist.recv(buf, peer)
                            dist.send(buf, peer)
                        times.append((time.perf_counter() - t0) / 2)
                    elapsed[0] = statistics.median(times[cfg.warmup:])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                points.append((n, float(elapsed)))
                tick(f"p2p {label} {n} B")
            links.append({"name": label, "ranks": [a, b], "points": points})
        dist.barrier()
    triad = measure_triad(cfg.triad_bytes)
    tick("memory triad")
    tflops = {d: measure_matmul(cfg.matmul_size, d) for d in cfg.dtypes}
    tick("matmul")
    host = measure_host_costs(world, list(collectives))
    tick("eager op overhead and all-reduce inside a decode step")
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "rank": rank, "host": hosts[rank], "local_world_size": local_world, "hosts": hosts,
        "collectives": collectives, "links": links, "triad_gbps": triad, "tflops": tflops,
        "host_memory_bytes": memory_bytes, "threads": cfg.threads, **host,
    }


def probe_steps(cfg: ProbeConfig, world: int, local_world: int) -> int:
    """How many progress ticks ``probe_rank`` reports for this world (for a progress bar)."""
    if world < 2:
        return 3
    algs = [a for a in cfg.algorithms if a != "two-level" or world % local_world == 0]
    hosts = [f"h{i}" for i in range(world)]
    pairs = _link_pairs(world, local_world, hosts)
    return len(cfg.sizes()) * (len(algs) + len(pairs)) + 3


# --------------------------------------------------------------------------- parent side


def _table(points: list[tuple[int, float]], p: int) -> list[dict[str, float]]:
    rows = []
    for n, t in points:
        algbw = n / t / 1e9
        rows.append({"bytes": n, "time_s": t, "algbw_gbps": algbw, "busbw_gbps": bus_bandwidth(algbw, p)})
    return rows


def _model_seconds(name: str, n: float, p: int, local: int, alpha: float, beta: float) -> float:
    """α-β time of the runtime's algorithm ``name`` (two-level on one host: reduce to the
    leader and broadcast back, 2 messages each carrying (local−1)·n bytes to the leader)."""
    from shardwise.perf import collectives as cost

    if name == "ring" or name == "builtin":
        return cost.ring_allreduce_s(n, p, alpha, beta)
    if name == "rd":
        return cost.recursive_doubling_allreduce_s(n, p, alpha, beta)
    if name == "oneshot":
        return cost.one_shot_allreduce_s(n, p, alpha, beta)
    hosts = p // local
    inter = cost.ring_allreduce_s(n, hosts, alpha, beta) if hosts > 1 else 0.0
    return 2 * (alpha + (local - 1) * n / beta) + inter


def summarize(reports: list[dict[str, Any]], cfg: ProbeConfig, backend: str) -> dict[str, Any]:
    """The probe document from every rank's raw figures: nccl-tests-style tables, α/β fits
    per link and for the ring, per-call software overhead per algorithm, memory bandwidth
    (the slowest rank's triad), matmul TFLOPS and seconds per eager op (the slowest rank)."""
    first = reports[0]
    p = len(reports)
    local = first["local_world_size"]
    doc: dict[str, Any] = {
        "kind": "probe", "world_size": p, "hosts": sorted(set(first["hosts"])), "backend": backend,
        "threads_per_rank": first["threads"], "iters": cfg.iters,
        "collectives": {name: _table(points, p) for name, points in first["collectives"].items()},
        "links": [], "ring_fit": None, "collective_overhead_s": {},
    }
    for link in first["links"]:
        n, t = zip(*link["points"])
        alpha, beta = fit_alpha_beta(n, t)
        doc["links"].append({"name": link["name"], "ranks": link["ranks"], "alpha_s": alpha, "beta_gbps": beta / 1e9,
                             "points": [{"bytes": a, "time_s": b} for a, b in link["points"]]})
    ring = first["collectives"].get("ring")
    if ring and len(ring) >= 2:
        n, t = zip(*ring)
        alpha, beta = ring_alpha_beta(n, t, p)
        doc["ring_fit"] = {"alpha_s": alpha, "beta_gbps": beta / 1e9}
        doc["collective_in_decode_s"] = {}
        for name, points in first["collectives"].items():
            in_decode = [r["collective_in_decode_s"][name] for r in reports if name in r["collective_in_decode_s"]]
            if in_decode:  # the slowest rank's: every rank waits for it
                doc["collective_in_decode_s"][name] = max(in_decode)
                overhead = in_decode_overhead_s(name, max(in_decode), p, local, alpha, beta)
            else:
                small = [t - _model_seconds(name, n, p, local, alpha, beta) for n, t in points if n <= OVERHEAD_MAX_BYTES]
                overhead = max(0.0, float(np.median(small))) if small else 0.0
            doc["collective_overhead_s"][name] = overhead
    doc["memory_bandwidth_gbps"] = min(r["triad_gbps"] for r in reports)
    doc["memory_bandwidth_gbps_per_rank"] = [r["triad_gbps"] for r in reports]
    doc["tflops"] = {d: min(r["tflops"][d] for r in reports) for d in first["tflops"]}
    doc["op_overhead_s"] = max(r["op_overhead_s"] for r in reports)
    doc["op_overhead_moe_s"] = max(r["op_overhead_moe_s"] for r in reports)
    doc["reference_block_ops"] = first["reference_block_ops"]
    doc["memory_gb_per_rank"] = first["host_memory_bytes"] / local / 1e9
    return doc


def measured_of(doc: dict[str, Any], source: str):
    """``Measured`` figures for a cluster file from a probe document."""
    from shardwise.spec.hardware import Measured

    ring = doc.get("ring_fit")
    return Measured(
        source=source,
        memory_gb=round(doc["memory_gb_per_rank"], 3),
        memory_bandwidth_gbps=round(doc["memory_bandwidth_gbps"], 3),
        tflops_bf16=round(doc["tflops"]["bf16"], 5) if "bf16" in doc["tflops"] else None,
        link_bandwidth_gbps=round(ring["beta_gbps"], 4) if ring else None,
        link_latency_s=float(f"{ring['alpha_s']:.4g}") if ring else None,
    )


def cluster_of(doc: dict[str, Any], box: str, link: str, source: str):
    """A ``ClusterSpec`` of ``world_size`` boxes (one per rank) with the probe's figures."""
    from shardwise.spec.hardware import ClusterSpec, apply_measured, get_box, get_link

    measured = measured_of(doc, source)
    box_obj, link_obj = apply_measured(get_box(box), get_link(link), measured)
    return ClusterSpec(box=box_obj, boxes=doc["world_size"], link=link_obj, measured=measured)

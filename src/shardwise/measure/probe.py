"""``shardwise probe``: microbenchmarks that measure a cluster, run in every rank.

``run_probe`` starts the ranks (``launch_local`` on one host) or joins ``torchrun``'s
group across hosts; ``probe_rank`` runs inside every rank and measures, with the
runtime's own code paths:

- every all-reduce algorithm of ``shardwise.runtime.comm`` over message sizes that
  double from ``min_bytes`` to ``max_bytes``, printed like nccl-tests: time (the
  median of the timed calls on each rank, then the slowest rank: a shared, busy host
  makes means useless);
- point-to-point ping-pong over each link (half the round trip), from which
  ``measure.probe_fit.fit_alpha_beta`` fits the link's α and β;
- a STREAM-like triad ``a = b + s·c`` (3 words moved per element) for the memory
  bandwidth one rank sees, all ranks at once, since they share the memory bus;
- dense matmul throughput per dtype (fp32, bf16) in TFLOPS;
- the host cost of one eager torch op and of one all-reduce inside a decode step
  (``runtime.host_costs.measure_host_costs``).

Rank 0 gathers the raw figures and ``measure.probe_fit.summarize`` builds the probe
document from them.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.runtime.host_costs import measure_host_costs

PROBE_ALGORITHMS = ("ring", "rd", "oneshot", "two-level", "builtin")
"""All-reduce algorithms the probe times (names of ``runtime.comm.ALLREDUCE_ALGORITHMS``)."""

DEFAULT_BOX = "cpu-host"
"""Catalog box whose figures a local probe's measurements replace (``--box``)."""

DEFAULT_LINK = "loopback-tcp"
"""Catalog link whose α/β a local probe's measurements replace (``--link``)."""


@dataclass(frozen=True)
class ProbeConfig:
    """What to measure; picklable, the same on every rank.

    Sizes are bytes, ``iters`` timed repetitions per point (fewer above 1 MiB so the
    default run stays short), ``triad_bytes`` the size of each triad array (keep it well
    above the last-level cache), ``matmul_size`` the square matrix side, ``host_batches`` the timed
    batches whose median each host cost is (``runtime.host_costs``; fewer: quicker and noisier).
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
    host_batches: int = 15

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
        if self.host_batches < 1:
            raise ShardwiseError(f"--host-batches must be >= 1 (got {self.host_batches})")

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
    host = measure_host_costs(world, list(collectives), batches=cfg.host_batches)
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


# --------------------------------------------------------------------------- driver


def wait_for_master(addr: str, port: int, timeout_s: float) -> float:
    """Block until a TCP listener answers on ``addr:port``; returns the seconds left of
    ``timeout_s``. Raises a one-line error naming the address when none answers in time
    (torch's own store client retries past its timeout)."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ShardwiseError(
                f"no rendezvous listener at {addr}:{port} within {timeout_s:g} s ({last}): start rank 0 "
                "first and check --master-addr / MASTER_ADDR and MASTER_PORT"
            )
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, left)):
                return deadline - time.monotonic()
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def run_probe(
    cfg, ranks: int, backend: str = "gloo", master_addr: str = "127.0.0.1", timeout_s: float = 60.0,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Probe ``ranks`` local processes (or join torchrun's group); returns the probe document
    on the printing rank and None on the others."""
    from shardwise.measure.probe_fit import summarize

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"]) if os.environ["RANK"].isdigit() else -1
        left = timeout_s
        if rank != 0:  # check the master answers before torch's store client retries past the limit
            addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            if not port.isdigit():
                raise ShardwiseError(f"MASTER_PORT={port!r} must be a port number")
            left = wait_for_master(addr, int(port), timeout_s)
        import torch.distributed as dist

        from shardwise.runtime.peer_watch import torchrun_group

        with torchrun_group(backend, max(left, 1.0)) as (rank, world):
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            with _progress(probe_steps(cfg, world, local), show_progress and rank == 0) as bar:
                report = probe_rank(rank, world, cfg, bar)
            reports: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(report, reports, dst=0)
        return summarize(reports, cfg, backend) if rank == 0 else None
    from shardwise.runtime.launch import launch_local

    if ranks < 1:
        raise ShardwiseError(f"--ranks must be >= 1, got {ranks}")
    from shardwise.runtime.rank_start import context

    queue = context().Queue()  # of the start method the ranks have
    with _progress(probe_steps(cfg, ranks, ranks), show_progress) as bar:

        def feed() -> None:
            while (item := queue.get()) is not None:
                bar.put(item)

        # the launcher stays on the main thread, where Ctrl-C lands: its cleanup stops the ranks
        reader = threading.Thread(target=feed, daemon=True)
        reader.start()
        try:
            reports = launch_local(probe_rank, ranks, args=(cfg, queue), backend=backend, master_addr=master_addr,
                                   timeout_s=timeout_s, run_timeout_s=None)
        finally:
            queue.put(None)
            reader.join(timeout=5)
    return summarize(reports, cfg, backend)


class _progress:
    """A rich progress bar fed with ``put((advance, label))``; silent when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("probe"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.description}"), TimeElapsedColumn(), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total)
        return self

    def put(self, item: tuple[int, str]) -> None:
        if self.enabled:
            self.bar.update(self.task, advance=item[0], description=item[1])

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)

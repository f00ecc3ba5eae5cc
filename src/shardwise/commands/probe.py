"""`shardwise probe`: measure collectives, links, memory bandwidth and matmul throughput,
print them like nccl-tests and write a cluster file that `shardwise plan --cluster` reads.

Locally it starts ``--ranks`` processes (``launch_local``, loopback); under ``torchrun``
(RANK / WORLD_SIZE in the environment) every process joins the torchrun group and rank
0 prints and writes.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from shardwise.errors import ShardwiseError

DEFAULT_BOX = "cpu-host"
DEFAULT_LINK = "loopback-tcp"


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
    from shardwise.probe import probe_rank, probe_steps, summarize

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"]) if os.environ["RANK"].isdigit() else -1
        left = timeout_s
        if rank != 0:  # check the master answers before torch's store client retries past the limit
            addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            if not port.isdigit():
                raise ShardwiseError(f"MASTER_PORT={port!r} must be a port number")
            left = wait_for_master(addr, int(port), timeout_s)
        import torch.distributed as dist

        from shardwise.runtime.launch import init_from_env

        rank, world = init_from_env(backend, timeout_s=max(left, 1.0))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        with _progress(probe_steps(cfg, world, local), show_progress and rank == 0) as bar:
            report = probe_rank(rank, world, cfg, bar)
        reports: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(report, reports, dst=0)
        dist.destroy_process_group()
        return summarize(reports, cfg, backend) if rank == 0 else None
    from shardwise.runtime.launch import launch_local

    if ranks < 1:
        raise ShardwiseError(f"--ranks must be >= 1, got {ranks}")
    import multiprocessing

    queue = multiprocessing.get_context("spawn").Queue()
    result: dict[str, Any] = {}

    def launch() -> None:
        try:
            result["reports"] = launch_local(
                probe_rank, ranks, args=(cfg, queue), backend=backend, master_addr=master_addr,
                timeout_s=timeout_s, run_timeout_s=None,
            )
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc
        finally:
            queue.put(None)

    worker = threading.Thread(target=launch, daemon=True)
    with _progress(probe_steps(cfg, ranks, ranks), show_progress) as bar:
        worker.start()
        while (item := queue.get()) is not None:
            bar.put(item)
    worker.join()
    if "error" in result:
        raise result["error"]
    return summarize(result["reports"], cfg, backend)


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


def render(doc: dict[str, Any]) -> None:
    """Print the probe document: one nccl-tests-style table per algorithm, then the fits."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]shardwise probe[/]: {doc['world_size']} rank(s) on {', '.join(doc['hosts'])}, "
              f"{doc['backend']}, {doc['threads_per_rank']} thread(s) per rank")
    for name, rows in doc["collectives"].items():
        t = Table(title=f"all-reduce {name} (float32, sum)")
        for col in ("size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(f"{r['bytes']:,}", f"{r['time_s'] * 1e6:,.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
        con.print(t)
    if doc["links"] or doc["ring_fit"]:
        t = Table(title="α-β fits (t = messages·α + bytes/β)")
        for col in ("link", "points", "α (us)", "β (GB/s)"):
            t.add_column(col, justify="right" if col != "link" else "left")
        for link in doc["links"]:
            t.add_row(f"{link['name']} (p2p, ranks {link['ranks'][0]}-{link['ranks'][1]})", str(len(link["points"])),
                      f"{link['alpha_s'] * 1e6:.1f}", f"{link['beta_gbps']:.3f}")
        if doc["ring_fit"]:
            ring = doc["ring_fit"]
            t.add_row(f"ring over {doc['world_size']} ranks", str(len(doc["collectives"]["ring"])),
                      f"{ring['alpha_s'] * 1e6:.1f}", f"{ring['beta_gbps']:.3f}")
        con.print(t)
        over = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in doc["collective_overhead_s"].items())
        con.print(f"per-call overhead beyond α-β (us, sizes <= 16 KiB): {over}")
    con.print(
        f"memory (STREAM triad, per rank, all ranks at once): [bold]{doc['memory_bandwidth_gbps']:.2f} GB/s[/]; "
        + "matmul: " + ", ".join(f"{k} [bold]{v:.4f} TFLOPS[/]" for k, v in doc["tflops"].items())
        + f"; eager op: {doc['op_overhead_s'] * 1e6:.1f} us"
    )
    if doc.get("cluster_file"):
        con.print(f"wrote {doc['cluster_file']} (use: shardwise plan --cluster {doc['cluster_file']})")


def register(app: typer.Typer) -> None:
    """Add the `probe` verb."""

    @app.command("probe")
    def probe_command(
        ranks: Annotated[int, typer.Option("--ranks", help="local processes (ignored under torchrun)")] = 2,
        backend: Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPU)")] = "gloo",
        min_bytes: Annotated[int, typer.Option("--min-bytes", help="smallest message, bytes")] = 8,
        max_bytes: Annotated[int, typer.Option("--max-bytes", help="largest message, bytes (64 MB: 67108864)")] = 4 << 20,
        iters: Annotated[int, typer.Option("--iters", help="timed repetitions per size")] = 20,
        algorithms: Annotated[str, typer.Option("--algorithms", help="comma list of ring, rd, oneshot, two-level, builtin")] = ",".join(
            ("ring", "rd", "oneshot", "two-level", "builtin")),
        threads: Annotated[int, typer.Option("--threads", help="torch threads per rank (the runtime uses 1)")] = 1,
        triad_mb: Annotated[int, typer.Option("--triad-mb", help="size of each triad array, MB")] = 64,
        matmul_size: Annotated[int, typer.Option("--matmul-size", help="square matmul side")] = 512,
        box: Annotated[str, typer.Option("--box", help="catalog box the measured figures replace")] = DEFAULT_BOX,
        link: Annotated[str, typer.Option("--link", help="catalog link the measured α/β replace")] = DEFAULT_LINK,
        master_addr: Annotated[str, typer.Option("--master-addr", help="rendezvous address for local ranks")] = "127.0.0.1",
        timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the rendezvous and each collective")] = 60.0,
        out: Annotated[Optional[Path], typer.Option("--out", help="write a cluster TOML file here")] = None,
        json_out_file: Annotated[Optional[Path], typer.Option("--json-out", help="write the probe JSON document here")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="print the probe JSON document")] = False,
    ) -> None:
        """Measure all-reduce algorithms (nccl-tests style), link α/β, memory bandwidth and matmul TFLOPS."""
        from shardwise.probe import ProbeConfig, cluster_of
        from shardwise.spec.hardware import cluster_to_toml, get_box, get_link, write_cluster_file

        get_box(box)
        get_link(link)
        cfg = ProbeConfig(min_bytes=min_bytes, max_bytes=max_bytes, iters=iters,
                          algorithms=tuple(a.strip() for a in algorithms.split(",") if a.strip()),
                          triad_bytes=triad_mb << 20, matmul_size=matmul_size, threads=threads)
        doc = run_probe(cfg, ranks, backend, master_addr, timeout, show_progress=not json_out)
        if doc is None:
            return
        stamp = datetime.date.today().isoformat()
        source = f"shardwise probe {stamp}, {doc['world_size']} rank(s) on {', '.join(doc['hosts'])}, {backend}"
        cluster = cluster_of(doc, box, link, source)
        doc["cluster"] = cluster_to_toml(cluster)
        if out is not None:
            write_cluster_file(cluster, out)
            doc["cluster_file"] = str(out)
        if json_out_file is not None:
            try:
                json_out_file.write_text(json.dumps(doc, indent=2))
            except OSError as exc:
                raise ShardwiseError(f"{json_out_file}: cannot write ({exc.strerror})") from None
        if json_out:
            print(json.dumps(doc, indent=2))
        else:
            render(doc)

"""`shardwise probe`: measure collectives, links, memory bandwidth and matmul throughput,
print them like nccl-tests and write a cluster file that `shardwise plan --cluster` reads.

Locally it starts ``--ranks`` processes (``launch_local``, loopback); under ``torchrun``
(RANK / WORLD_SIZE in the environment) every process joins the torchrun group and rank
0 prints and writes (``shardwise.measure.probe.run_probe``).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from shardwise.errors import ShardwiseError
from shardwise.measure.probe import DEFAULT_BOX, DEFAULT_LINK

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
        threads: Annotated[int, typer.Option("--threads", help="torch threads per rank (as `bench` runs its ranks; run and serve use cores / ranks)")] = 1,
        triad_mb: Annotated[int, typer.Option("--triad-mb", help="size of each triad array, MB")] = 64,
        matmul_size: Annotated[int, typer.Option("--matmul-size", help="square matmul side")] = 512,
        host_batches: Annotated[int, typer.Option("--host-batches", help="timed batches per host cost (their median; fewer: quicker, noisier)")] = 15,
        box: Annotated[str, typer.Option("--box", help="catalog box the measured figures replace")] = DEFAULT_BOX,
        link: Annotated[str, typer.Option("--link", help="catalog link the measured α/β replace")] = DEFAULT_LINK,
        master_addr: Annotated[str, typer.Option("--master-addr", help="rendezvous address for local ranks")] = "127.0.0.1",
        timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the rendezvous and each collective")] = 60.0,
        out: Annotated[Optional[Path], typer.Option("--out", help="write a cluster TOML file here")] = None,
        json_out_file: Annotated[Optional[Path], typer.Option("--json-out", help="write the probe JSON document here")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="print the probe JSON document")] = False,
    ) -> None:
        """Measure all-reduce algorithms (nccl-tests style), link α/β, memory bandwidth and matmul TFLOPS."""
        from shardwise.measure.probe import ProbeConfig, run_probe
        from shardwise.measure.probe_fit import cluster_of
        from shardwise.spec.hardware import cluster_to_toml, get_box, get_link, write_cluster_file

        get_box(box)
        get_link(link)
        cfg = ProbeConfig(min_bytes=min_bytes, max_bytes=max_bytes, iters=iters,
                          algorithms=tuple(a.strip() for a in algorithms.split(",") if a.strip()),
                          triad_bytes=triad_mb << 20, matmul_size=matmul_size, threads=threads,
                          host_batches=host_batches)
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

"""``shardwise ring``: the best rank order for ring all-reduce on a cluster's cable graph."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from shardwise.errors import ShardwiseError

DEFAULT_MESSAGE_BYTES = 14336
"""hidden × 2 bytes of a 7168-wide model: one decode all-reduce at batch 1."""


def ring(
    topology: Path = typer.Option(  # help is rich markup: '\[' keeps the section names' brackets
        ..., "--topology", help=r"Cluster TOML file with [\[hosts]], [\[switches]], [\[links]]."),
    message_bytes: int = typer.Option(
        DEFAULT_MESSAGE_BYTES, "--message-bytes", help="All-reduce message size in bytes (default: hidden 7168 x 2)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Search the ring order (torchrun/NCCL rank order) with the fastest all-reduce."""
    from shardwise.spec.hardware import load_topology_file
    from shardwise.perf.ring_order import best_ring_order, worst_ring_order

    if message_bytes < 0:
        raise ShardwiseError(f"--message-bytes must be >= 0, got {message_bytes}")
    topo = load_topology_file(topology)
    if len(topo.hosts) < 2:
        raise ShardwiseError(f"{topology}: a ring needs at least 2 [[hosts]], found {len(topo.hosts)}")
    best = best_ring_order(topo, message_bytes)
    worst = worst_ring_order(topo, message_bytes)
    listed_s = topo.ring_allreduce_time(topo.hosts, message_bytes)
    if as_json:
        doc = {
            "message_bytes": message_bytes,
            "best_order": list(best.order),
            "best_s": best.allreduce_s,
            "best_exact": best.exact,
            "listed_order": list(topo.hosts),
            "listed_s": listed_s,
            "worst_order": list(worst.order),
            "worst_s": worst.allreduce_s,
            "worst_exact": worst.exact,
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ring all-reduce of {message_bytes} B over {len(topo.hosts)} hosts")
    table.add_column("order")
    table.add_column("all-reduce (µs)", justify="right")
    table.add_column("hosts in rank order")
    table.add_row("best" + ("" if best.exact else " found"), f"{best.allreduce_s * 1e6:.1f}", " ".join(best.order))
    table.add_row("listed", f"{listed_s * 1e6:.1f}", " ".join(topo.hosts))
    table.add_row("worst" + ("" if worst.exact else " found"), f"{worst.allreduce_s * 1e6:.1f}", " ".join(worst.order))
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add the ``ring`` verb to ``app``."""
    app.command("ring")(ring)

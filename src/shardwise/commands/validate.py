"""`shardwise validate [CSV]`: the performance model against published measurements."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the `validate` verb."""

    @app.command("validate")
    def validate_command(
        csv_path: Annotated[Optional[Path], typer.Argument(help="measurements CSV (default: data/measurements.csv)")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
        cv: Annotated[bool, typer.Option("--cv", help="also predict each row with profiles fitted without its source (leave one source out)")] = False,
    ) -> None:
        """Predicted vs measured decode tok/s per row, median APE, and the pure roofline's median APE."""
        from shardwise.perf.calibrate import DEFAULT_CSV
        from shardwise.perf.validate import validate_file

        doc = validate_file(csv_path or DEFAULT_CSV, cv=cv)
        if json_out:
            print(json.dumps(doc, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        t = Table(title="Decode tok/s: predicted vs measured")
        for col in ("id", "model", "box", "n", "layout", "batch", "profile", "measured", "predicted", "APE %", "roofline",
                    "roofline APE %"):
            t.add_column(col, justify="right" if col not in ("id", "model", "box", "layout", "profile") else "left")
        for r in doc["rows"]:
            t.add_row(
                r["id"], r["model"], r["box"], str(r["boxes"]), r["layout"],
                f"{r['batch']}{' (all)' if r['aggregate'] else ''}", r["profile"],
                f"{r['measured_tok_per_s']:.2f}", f"{r['predicted_tok_per_s']:.2f}", f"{r['ape']:.0f}",
                f"{r['roofline_tok_per_s']:.2f}", f"{r['roofline_ape']:.0f}",
            )
        con.print(t)
        if doc["resolved"]:
            con.print(
                f"median APE at batch 1: [bold]{doc['median_ape']:.1f}%[/] over {doc['resolved']} rows "
                f"(pure roofline: {doc['baseline_median_ape']:.1f}%)"
            )
        held = doc["cv"]
        if held and held["rows"]:
            con.print(
                f"cross-validated (leave one source out): median APE [bold]{held['median_ape']:.1f}%[/] over "
                f"{held['rows']} rows" + (f"; {held['no_other_source']} rows have no other source for their profile"
                                          if held["no_other_source"] else "")
            )
        b = doc["batched"]
        if b["resolved"]:
            con.print(
                f"rows at batch > 1, apart: median APE [bold]{b['median_ape']:.1f}%[/] over {b['resolved']} rows "
                f"(pure roofline: {b['baseline_median_ape']:.1f}%)"
            )
        con.print(f"unresolved rows: {len(doc['unresolved'])}")
        for u in doc["unresolved"]:
            con.print(f"  [dim]{u['id']}: {u['reason']}[/]")

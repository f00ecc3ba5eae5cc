"""`shardwise report [INPUT...] -o report.html`: one self-contained HTML page from plan, sweep,
bench and trace JSON (kinds told apart by shape; the bench/trace schema is in
``shardwise.report.inputs``). With no input it reports the seed's case: Kimi K3 on 16 DGX Spark
(``shardwise plan`` defaults) and a sweep of Kimi K3 around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from shardwise.errors import ShardwiseError


def write_report(inputs: list[Path], output: Path) -> tuple[Path, list, list[str]]:
    """Build the report for ``inputs`` (none: the seed's case) and write it to ``output``."""
    from shardwise.report.html import build_report, default_inputs
    from shardwise.report.inputs import load_inputs

    if inputs:
        docs = load_inputs(inputs)
        subtitle = "inputs: " + ", ".join(f"{k} {v}" for k, v in docs.sources.items())
    else:
        docs = default_inputs()
        subtitle = "default report, the seed's case: " + "; ".join(docs.sources.values())
    page, charts, notes = build_report(docs, subtitle)
    try:
        output.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ShardwiseError(f"{output}: cannot write the report ({exc.strerror})") from None
    return output, charts, notes


def register(app: typer.Typer) -> None:
    """Add the `report` verb."""

    @app.command("report")
    def report_command(
        inputs: Annotated[Optional[list[Path]], typer.Argument(help="plan, sweep, bench or trace JSON files (none: the seed's case)")] = None,
        output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write")] = Path("report.html"),
    ) -> None:
        """Write one self-contained HTML report: waterfall, memory, roofline, Pareto front, per-layer timeline."""
        path, charts, notes = write_report(list(inputs or []), output)
        print(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB): {', '.join(c.title for c in charts)}")
        for note in notes:
            print(f"note: {note}")

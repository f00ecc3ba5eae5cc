"""`shardwise quantize CHECKPOINT --format mxfp4|int8|int4 --out DIR`: write an MXFP4 or weight-only
int8 / int4 copy of a float checkpoint and report bytes, bits per weight and the error it introduced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def _print_summary(result, src: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"{src} → {result.out} ({result.layout}, scale rounding {result.scale_rounding})")
    for col in ("group", "params", "quantized", "bytes in", "bytes out", "bits in", "bits out", "rel RMS"):
        t.add_column(col, justify="right")
    for name, g in result.groups.items():
        t.add_row(name, f"{g.params:,}", f"{g.quantized_params:,}", f"{g.bytes_before:,}", f"{g.bytes_after:,}",
                  f"{g.bits_before:.2f}", f"{g.bits_after:.2f}", f"{g.rel_rms:.4f}" if g.quantized_params else "-")
    t.add_row("total", "", "", f"{result.bytes_before:,}", f"{result.bytes_after:,}", "", "", "", style="bold")
    con.print(t)
    ratio = result.bytes_before / result.bytes_after if result.bytes_after else 0.0
    con.print(f"{result.quantized_tensors} tensors quantized; {result.bytes_before:,} → {result.bytes_after:,} bytes ({ratio:.2f}× smaller)")
    if result.logits_max_abs is not None:
        con.print(
            f"logits on a fixed {len(result.prompt_ids)}-token prompt (tp=1, float32): max |Δ| "
            f"{result.logits_max_abs:.4g}, relative RMS {result.logits_rel_rms:.4g}, "
            f"top-1 agreement {result.top1_agreement:.1%}"
        )


def register(app: typer.Typer) -> None:
    """Add the `quantize` verb."""

    @app.command("quantize")
    def quantize_command(
        checkpoint: Annotated[Path, typer.Argument(help="float32/bfloat16 HF safetensors checkpoint folder")],
        out: Annotated[Path, typer.Option("--out", help="output folder for the quantized checkpoint")],
        fmt: Annotated[str, typer.Option("--format", help="mxfp4 (32-input blocks, E8M0 scales), int8 (per output channel) or int4 (per group)")] = "mxfp4",
        group_size: Annotated[int | None, typer.Option("--group-size", help="int4/int8: inputs per bfloat16 scale (a multiple of 32; int4 default 32, int8 default per channel)")] = None,
        experts_only: Annotated[bool, typer.Option("--experts-only", help="quantize only the routed experts (gpt_oss: always)")] = False,
        lm_head: Annotated[bool, typer.Option("--lm-head", help="int8/int4: quantize the LM head too (as llama.cpp's Q8_0/Q4_0 do)")] = False,
        scale_rounding: Annotated[str, typer.Option("--scale-rounding", help="ocp (floor(log2 amax) - 2) or up (no saturation)")] = "ocp",
        compare: Annotated[bool, typer.Option("--compare/--no-compare", help="run both checkpoints on a fixed prompt and report the logits difference")] = True,
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    ) -> None:
        """Write an MXFP4 checkpoint (gpt-oss layout for gpt_oss, compressed-tensors otherwise) or a weight-only
        int8/int4 one (compressed-tensors pack-quantized)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from shardwise.runtime.loader import load_spec
        from shardwise.runtime.quantize_checkpoint import quantize_checkpoint

        spec = load_spec(checkpoint)
        total = sum(t.experts for t in spec.tensors())
        with Progress(
            TextColumn("[bold]quantize[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), transient=True, disable=json_out,
        ) as bar:
            task = bar.add_task("", total=total)
            result = quantize_checkpoint(
                checkpoint, out, fmt, experts_only=experts_only, scale_rounding=scale_rounding, compare=compare,
                progress=lambda name: bar.update(task, advance=1, description=name), group_size=group_size,
                lm_head=lm_head,
            )
        if json_out:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            _print_summary(result, checkpoint)

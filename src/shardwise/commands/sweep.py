"""`shardwise sweep`: every way to run the models on the catalog's boxes, cut to the Pareto front
of decode tok/s vs cost vs power (and prefill tok/s with --prefill), best first.

Any dimension can be fixed: --model, --box, --boxes, --link, --quant / --experts. Constraints:
--budget (USD), --max-watts (loaded W), --min-tok-per-s, --context (tokens the KV cache must
hold), --max-boxes. The rules behind each row (which links a box can use, switches, prices,
quantization variants) are in ``shardwise.perf.sweep`` and ``shardwise.perf.configurations``.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Annotated, Optional

import typer

from shardwise.errors import ShardwiseError
from shardwise.perf.scenario import DEFAULT_MAX_BOXES, SEED, build_request

CSV_FIELDS = (
    "model", "box", "boxes", "link", "tp", "ep", "pp", "layout", "quant", "bits_per_weight", "tok_per_s",
    "prefill_tok_per_s", "prefill_bottleneck", "usd", "watts", "rated_watts", "switches", "price_per_box_usd", "price_basis",
    "joules_per_token", "usd_per_tok_per_s", "bottleneck", "step_s", "collective_s", "free_bytes",
    "context_tokens", "runtime", "spec_tokens", "draft_model", "box_name", "link_name",
)


def parse_explain(value: str) -> tuple[str, int, str | None]:
    """'BOX:N[:LINK]' → (box, count, link key); an unknown box or link is a one-line error (not
    "outside this sweep"), a link alias becomes its catalog key."""
    from shardwise.spec.hardware import get_box, get_link

    parts = value.split(":")
    try:
        if len(parts) not in (2, 3) or int(parts[1]) < 1:
            raise ValueError
        box, count, link = parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None
    except ValueError:
        raise ShardwiseError(
            f"--explain '{value}' must look like BOX:N or BOX:N:LINK with N >= 1, e.g. dgx-spark:16:100g-roce") from None
    try:
        get_box(box)
        link = get_link(link).key if link is not None else None
    except ShardwiseError as exc:
        raise ShardwiseError(f"--explain '{value}': {exc} (`shardwise catalog` lists them)") from None
    return box, count, link


def run(req, explain_targets: list[tuple[str, str, int, str | None]], show_progress: bool):
    """Run the sweep (with a rich progress bar when asked) and explain each target."""
    from shardwise.perf.explain import explain
    from shardwise.perf.sweep import run_sweep

    if show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("sweeping"), BarColumn(), MofNCompleteColumn(), TextColumn("model x quantization"),
                      TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("sweep", total=None)

            def progress(advance: int, total: int) -> None:
                bar.update(task, total=total, advance=advance)

            result = run_sweep(req, progress)
    else:
        result = run_sweep(req)
    lines = [explain(result, req, m, b, n, lk) for m, b, n, lk in explain_targets]
    return result, lines


def seed_target(req) -> list[tuple[str, str, int, str | None]]:
    """The seed's configuration, when the sweep covers it."""
    from shardwise.spec.hardware import get_link

    link = get_link(SEED["link"]).key
    if (SEED["model"] in req.models and any(b.key == SEED["box"] for b in req.boxes) and SEED["boxes"] in req.counts
            and any(lk.key == link for lk in req.links)):
        return [(SEED["model"], SEED["box"], SEED["boxes"], link)]
    return []


def to_csv(rows: list[dict]) -> str:
    """The rows as CSV (scalar fields; ``formats`` is in --json only)."""
    buf = io.StringIO()
    fields = [f for f in CSV_FIELDS if any(f in r for r in rows)]
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k, "") for k in fields})
    return buf.getvalue()


def render(result, req, explanations: list[str], limit: int) -> None:
    """Print the front as rich tables."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(
        f"swept [bold]{result.configurations:,}[/] configurations in {result.elapsed_s:.2f} s: "
        f"{result.fitting:,} fit in memory at {req.context_tokens:,} tokens of context, {result.feasible:,} meet the "
        f"constraints, [bold]{len(result.rows)}[/] on the Pareto front (decode tok/s vs $ vs W"
        + (" vs prefill tok/s" if req.prefill else "") + ", per model)"
    )
    many = len({r["model"] for r in result.rows}) > 1
    if many:
        t = Table(title="Models ranked by decode tok/s (fastest configuration that fits and meets the constraints)")
        for col, just in (("#", "right"), ("model", "left"), ("tok/s", "right"), ("configuration", "left"),
                          ("$", "right"), ("W", "right"), ("bottleneck", "left")):
            t.add_column(col, justify=just)
        for i, r in enumerate(result.ranking, 1):
            t.add_row(str(i), r["model"], f"{r['tok_per_s']:,.2f}", _config(r), f"{r['usd']:,.0f}",
                      f"{r['watts']:,.0f}", r["bottleneck"])
        con.print(t)
    t = Table(title=f"Pareto front, best first ({min(limit, len(result.rows))} of {len(result.rows)} rows; --limit for more)")
    cols = (["model"] if many else []) + ["box", "n", "link", "layout", "quant", "tok/s"] + (
        ["prefill tok/s"] if req.prefill else []) + ["$", "W", "J/token", "$ per tok/s", "bottleneck"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "box", "link", "layout", "quant", "bottleneck") else "right")
    for r in result.rows[:limit]:
        cells = ([r["model"]] if many else []) + [r["box"], str(r["boxes"]), r["link"], r["layout"], r["quant"],
                                                 f"{r['tok_per_s']:,.2f}"]
        if req.prefill:
            cells.append(f"{r['prefill_tok_per_s']:,.0f}")
        cells += [f"{r['usd']:,.0f}", f"{r['watts']:,.0f}", f"{r['joules_per_token']:,.1f}",
                  f"{r['usd_per_tok_per_s']:,.0f}", r["bottleneck"]]
        t.add_row(*cells)
    con.print(t)
    for line in explanations:
        con.print(f"[bold]check:[/] {line}")
    for note in result.notes:
        con.print(f"[dim]note: {note}[/]")
    con.print(
        f"[dim]runtime profile {req.runtime}; $ = boxes at the builder's price where known, else list "
        f"(--list-prices), plus switches; W = loaded watts of boxes and switches; rules: shardwise.perf.sweep[/]"
    )


def _config(r: dict) -> str:
    link = "" if r["link"] == "none" else f" over {r['link']}"
    return f"{r['boxes']} x {r['box']}{link}, {r['layout']}, {r['quant']}"


def register(app: typer.Typer) -> None:
    """Add the `sweep` verb."""

    @app.command("sweep")
    def sweep_command(
        model: Annotated[Optional[str], typer.Option(help="catalog model(s), comma-separated (default: all)")] = None,
        box: Annotated[Optional[str], typer.Option(help="catalog box(es), comma-separated (default: all)")] = None,
        box_spec: Annotated[Optional[str], typer.Option(
            "--box-spec", help="TOML file describing a box outside the catalog; swept alone, or with the --box names")] = None,
        boxes: Annotated[Optional[str], typer.Option(help="box counts: 16, 4,8,16 or 8-16 (default 1..--max-boxes)")] = None,
        link: Annotated[Optional[str], typer.Option(help="catalog link(s), comma-separated (default: all)")] = None,
        quant: Annotated[Optional[str], typer.Option(help="formats for every matmul weight, comma-separated; 'native' = the checkpoint's (default: native,fp8,mxfp4, never above the checkpoint)")] = None,
        experts: Annotated[Optional[str], typer.Option(help="format(s) of the routed experts, comma-separated")] = None,
        budget: Annotated[Optional[float], typer.Option(help="most USD for boxes and switches")] = None,
        max_watts: Annotated[Optional[float], typer.Option(help="most loaded watts, boxes and switches")] = None,
        min_tok_per_s: Annotated[Optional[float], typer.Option(help="least decode tok/s (per user with --users)")] = None,
        users: Annotated[int, typer.Option(help="concurrent sequences every configuration must serve (batch)")] = 1,
        context: Annotated[int, typer.Option(help="context tokens at decode (the KV cache must fit)")] = 4096,
        max_boxes: Annotated[Optional[int], typer.Option(help=f"most boxes (default {DEFAULT_MAX_BOXES})")] = None,
        runtime: Annotated[str, typer.Option(help="runtime profile: ideal, vllm, llama-cpp, mlx, shardwise")] = "vllm",
        spec_tokens: Annotated[int, typer.Option(help="speculative draft tokens per step (0 = off)")] = 0,
        acceptance: Annotated[Optional[float], typer.Option(help="per-token draft acceptance in (0, 1)")] = None,
        workload: Annotated[Optional[str], typer.Option(help="named acceptance: code-edit or chat")] = None,
        draft_model: Annotated[Optional[str], typer.Option(
            help="draft model (catalog key or config.json) run on every box; default: a free drafter (prompt lookup)")] = None,
        prefill: Annotated[bool, typer.Option("--prefill", help="add prefill tok/s as an objective and a column")] = False,
        prompt_tokens: Annotated[int, typer.Option(help="prompt tokens for --prefill")] = 2048,
        list_prices: Annotated[bool, typer.Option("--list-prices", help="list prices for every box")] = False,
        kv_dtype: Annotated[str, typer.Option(help="KV-cache dtype")] = "bf16",
        explain: Annotated[Optional[list[str]], typer.Option(help="BOX:N[:LINK]: say whether it is on the front, or what beats it")] = None,
        limit: Annotated[int, typer.Option(help="rows in the table")] = 25,
        json_out: Annotated[bool, typer.Option("--json", help="print the front as a JSON list of rows")] = False,
        csv_out: Annotated[bool, typer.Option("--csv", help="print the front as CSV")] = False,
    ) -> None:
        """Sweep boxes x counts x links x layouts x quantizations x models; print the Pareto front."""
        if json_out and csv_out:
            raise ShardwiseError("--json and --csv both given: pick one")
        if limit < 1:
            raise ShardwiseError(f"--limit must be >= 1 row, got {limit}")
        req = build_request(model, box, boxes, link, quant, experts, budget, max_watts, min_tok_per_s, context,
                            max_boxes, runtime, spec_tokens, acceptance, workload, prefill, prompt_tokens,
                            list_prices, kv_dtype, draft_model, users)
        if box_spec is not None:
            from dataclasses import replace

            from shardwise.spec.box_spec import load_box_spec

            spec_box = load_box_spec(box_spec)
            named = req.boxes if box is not None else ()
            if any(b.key == spec_box.key for b in named):
                raise ShardwiseError(f"--box-spec {box_spec} is keyed '{spec_box.key}', as a --box already is: rename one")
            req = replace(req, boxes=(*named, spec_box))
        targets = seed_target(req)
        for value in explain or ():
            b, n, lk = parse_explain(value)
            targets += [(m, b, n, lk) for m in req.models]
        result, lines = run(req, targets, show_progress=sys.stderr.isatty())
        if json_out:
            print(json.dumps(result.rows, indent=1))
        elif csv_out:
            sys.stdout.write(to_csv(result.rows))
        else:
            render(result, req, lines, limit)
        if json_out or csv_out:
            for line in lines:
                print(f"check: {line}", file=sys.stderr)

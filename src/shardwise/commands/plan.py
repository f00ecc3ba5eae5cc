"""`shardwise plan`: box count, speed, bottleneck, power and cost for a model on a cluster.

With no arguments it plans the seed's case: Kimi K3 on 16 DGX Spark boxes over 100 Gb RoCE,
TP16 + EP16, 4 k context, the vLLM runtime profile, at the $6,950 per box the builder paid.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from shardwise.errors import ShardwiseError
from shardwise.perf.scenario import SEED, build_scenario


def resolve_box(box: str | None, box_spec: str | None, cluster: str | None):
    """The --box name, or the Box a --box-spec file describes (one-line errors when both or a cluster is given)."""
    if box_spec is None:
        return box or SEED["box"]
    for flag, value in (("--box", box), ("--cluster", cluster)):
        if value is not None:
            raise ShardwiseError(f"--box-spec and {flag} both name the box: pick one")
    from shardwise.spec.box_spec import load_box_spec

    return load_box_spec(box_spec)


def render(doc: dict) -> None:
    """Print a plan document as rich tables."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    m, c, mem, d, pf, pw, cost = (doc[k] for k in ("model", "cluster", "memory", "decode", "prefill", "power", "cost"))
    gb = 1e9
    con.print(
        f"[bold]{m['name']}[/] ({m['model_type']}): {m['total_params'] / 1e9:,.1f} B params, "
        f"{m['active_params'] / 1e9:,.1f} B active, {m['avg_bits_per_weight']:.2f} bits/weight avg "
        f"on [bold]{c['boxes']} x {c['box']}[/] over {c['link']}, {doc['plan']['layout']}, runtime {doc['plan']['runtime']}"
    )
    con.print(f"[dim]{m['active_convention']}[/]")
    t = Table(title="Memory per box (fullest rank)")
    columns = {"weights GB": "weights_bytes", "KV GB": "kv_bytes", "workspace GB": "workspace_bytes",
               "reserve GB": "reserve_bytes", "draft model GB": "draft_bytes", "free GB": "free_bytes", "box GB": "box_bytes"}
    if not mem["draft_bytes"]:
        del columns["draft model GB"]
    for col in columns:
        t.add_column(col, justify="right")
    t.add_row(*(f"{mem[k] / gb:,.1f}" for k in columns.values()))
    con.print(t)
    con.print(
        f"boxes needed: {mem['min_boxes_weights']} by weights alone ({mem['total_weight_bytes'] / gb:,.0f} GB), "
        f"{mem['min_boxes']} with cache and reserves, {mem['min_boxes_layout']} with a valid layout"
        + ("" if mem["fits"] else "  [bold red]this plan does not fit[/]")
    )
    w = Table(title="Decode waterfall (batch 1)")
    w.add_column("step")
    w.add_column("tok/s", justify="right")
    w.add_column("cause")
    for s in d["waterfall"]:
        w.add_row(s["step"], f"{s['tok_per_s']:,.2f}", s["cause"])
    con.print(w)
    con.print(
        f"decode: [bold]{d['tok_per_s']:,.2f} tok/s[/] (naive ceiling {d['naive_ceiling_tok_per_s']:,.1f}, "
        f"bandwidth ceiling {d['ceiling_tok_per_s']:,.1f}); bottleneck: [bold]{d['bottleneck']}[/]; "
        f"{d['collectives_per_step']} collectives/step, all-reduce {d['allreduce_algorithm']}"
    )
    cross = d["compute_bound_from_batch"]
    con.print(
        f"batch {d['batch']}: {d['tok_per_s']:,.2f} tok/s per sequence, {d['aggregate_tok_per_s']:,.2f} tok/s in all; "
        f"at most {mem['max_batch']:,} sequences of {mem['context_tokens']:,} tokens fit; "
        + (f"decode turns compute-bound from batch {cross}" if cross else "decode stays memory-bound up to that batch")
    )
    if d["batch_curve"]:
        curve = Table(title="Concurrency curve")
        for col in ("batch", "tok/s per sequence", "tok/s in all", "step ms", "bound"):
            curve.add_column(col, justify="right")
        for r in d["batch_curve"]:
            curve.add_row(f"{r['batch']}", f"{r['tok_per_s']:,.2f}", f"{r['aggregate_tok_per_s']:,.1f}",
                          f"{r['step_s'] * 1e3:,.1f}", "compute" if r["compute_bound"] else "memory")
        con.print(curve)
    ring = doc["plan"].get("ring")
    if ring:
        con.print(
            f"ring order (give torchrun/NCCL this host order): [bold]{' '.join(ring['best_order'])}[/] "
            f"{ring['best_s'] * 1e6:,.1f} us per all-reduce; listed order {ring['listed_s'] * 1e6:,.1f} us; "
            f"worst {ring['worst_s'] * 1e6:,.1f} us"
        )
    con.print(f"prefill ({pf['prompt_tokens']} tokens): {pf['tok_per_s']:,.0f} tok/s, bottleneck {pf['bottleneck']}")
    con.print(
        f"power: {pw['load_watts']:,.0f} W under load ({pw['rated_watts']:,.0f} W rated supplies, "
        f"switch {pw['switch_watts']:,.0f} W), {pw['joules_per_token']:,.1f} J/token"
    )
    con.print(
        f"cost: ${cost['usd']:,.0f} for the boxes at ${cost['price_per_box_usd']:,.0f} ({cost['price_note']}), "
        f"+ ${cost['switch_usd']:,.0f} switch; ${cost['usd_per_tok_per_s']:,.0f} per tok/s"
    )
    for note in doc["notes"]:
        con.print(f"[dim]note: {note}[/]")


def register(app: typer.Typer) -> None:
    """Add the `plan` verb."""

    @app.command("plan")
    def plan_command(
        model: Annotated[str, typer.Option(help="catalog key or path to a config.json")] = SEED["model"],
        box: Annotated[Optional[str], typer.Option(help=f"box from the catalog (default {SEED['box']})")] = None,
        box_spec: Annotated[Optional[str], typer.Option(
            "--box-spec", help="TOML file describing a box outside the catalog (the fields of a hardware.toml entry)")] = None,
        boxes: Annotated[Optional[int], typer.Option(help="number of boxes (default 16)")] = None,
        link: Annotated[str, typer.Option(help="link from the catalog")] = SEED["link"],
        tp: Annotated[Optional[int], typer.Option(help="tensor-parallel degree")] = None,
        ep: Annotated[Optional[int], typer.Option(help="expert-parallel degree (divides tp)")] = None,
        pp: Annotated[Optional[int], typer.Option(help="pipeline stages")] = None,
        context: Annotated[int, typer.Option(help="context tokens at decode")] = 4096,
        prompt_tokens: Annotated[int, typer.Option(help="prompt tokens for the prefill estimate")] = 2048,
        spec_tokens: Annotated[int, typer.Option(help="speculative draft tokens per step (0 = off)")] = 0,
        acceptance: Annotated[Optional[float], typer.Option(help="per-token draft acceptance in (0, 1)")] = None,
        workload: Annotated[Optional[str], typer.Option(help="named acceptance: code-edit or chat")] = None,
        draft_model: Annotated[Optional[str], typer.Option(
            help="draft model (catalog key or config.json) run on every box; default: a free drafter (prompt lookup)")] = None,
        runtime: Annotated[str, typer.Option(help="runtime profile: ideal, vllm, llama-cpp, mlx, shardwise")] = "vllm",
        quant: Annotated[Optional[str], typer.Option(
            help="one format for every matmul weight (--experts / --dense, when given, win for their part)")] = None,
        experts: Annotated[Optional[str], typer.Option(help="format of the routed experts")] = None,
        dense: Annotated[Optional[str], typer.Option(help="format of the non-expert matmul weights")] = None,
        price: Annotated[Optional[float], typer.Option(help="price per box, USD (0 for boxes already owned)")] = None,
        kv_dtype: Annotated[str, typer.Option(help="KV-cache dtype")] = "bf16",
        cluster: Annotated[Optional[str], typer.Option(help="cluster TOML (from `shardwise probe` or by hand)")] = None,
        batch: Annotated[int, typer.Option(help="sequences decoded together (users at once), each with its own cache")] = 1,
        batch_curve: Annotated[bool, typer.Option(
            "--batch-curve", help="add per-sequence and aggregate tok/s for batch 1 .. the most that fits")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
        emit: Annotated[Optional[str], typer.Option(
            "--emit", help="print the per-host commands that run this plan instead of the tables: vllm or shardwise "
                           "(with --json: the document's \"launch\" section)")] = None,
    ) -> None:
        """Plan a model on a cluster: memory fit, decode/prefill speed, waterfall, bottleneck, power, cost."""
        from shardwise.perf.estimate import estimate
        from shardwise.perf.launch_commands import check_target, launch_plan

        check_target(emit)
        box_arg = resolve_box(box, box_spec, cluster)

        sc = build_scenario(
            model, box_arg, boxes, link, tp, ep, pp, context, prompt_tokens, spec_tokens, acceptance, workload,
            runtime, quant, experts, dense, price, kv_dtype, cluster, draft_model, batch,
        )
        doc = estimate(sc, curve=batch_curve)
        if not doc["memory"]["fits"]:
            mem = doc["memory"]
            need = mem["min_boxes_layout"]
            at_batch = f" at --batch {batch} (it holds {mem['max_batch']} sequences)" if batch > 1 else ""
            raise ShardwiseError(
                f"{sc.model.name} does not fit on {sc.boxes} x {sc.box.name}{at_batch} ({-mem['free_bytes'] / 1e9:,.1f} GB "
                f"short on the fullest box): "
                + (f"it needs {need} boxes" if need else
                   f"no layout of up to {mem['layout_search_max_boxes']:,} boxes holds it (a cache replicated on "
                   "every rank, such as MLA's latent, does not shrink with more boxes): lower --context or --batch")
            )
        launch = launch_plan(emit, doc, sc, model, draft_model, cluster) if emit else None
        if json_out:
            if launch is not None:
                doc["launch"] = launch.to_json()
            print(json.dumps(doc, indent=2))
        elif launch is not None:
            print("\n".join(launch.lines()))
        else:
            render(doc)

"""`shardwise catalog`: the bundled models, boxes, links, quantization formats and runtime profiles."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def catalog_document() -> dict:
    """Everything the planner knows by name, as one JSON-ready dict."""
    from shardwise.perf.profiles import load_profiles
    from shardwise.quant.formats import FORMATS
    from shardwise.spec.box_options import option_names
    from shardwise.spec.hardware import get_box, load_catalog
    from shardwise.spec.parse import catalog_models, load_model

    cat = load_catalog()
    models = []
    for key in catalog_models():
        m = load_model(key)
        models.append({
            "key": key, "model_type": m.model_type, "total_params": m.total_params, "active_params": m.active_params,
            "layers": m.num_layers, "experts": m.moe.num_experts if m.moe else 0,
            "experts_per_token": m.moe.top_k if m.moe else 0, "quant_method": m.quant_method,
        })

    def options(b) -> list[dict] | None:  # each memory option as `--box KEY` plans it (GB, GB/s, USD)
        if b.memory_options is None:
            return None
        return [{"key": k, "memory_gb": o.memory_gb, "memory_bandwidth_gbps": o.memory_bandwidth_gbps,
                 "tflops_bf16": o.tflops_bf16, "list_price_usd": o.list_price_usd, "estimates": sorted(o.estimates)}
                for k, o in ((k, get_box(k)) for k in option_names(b))]

    boxes = [
        {"key": k, "name": b.name, "memory_gb": b.memory_gb, "memory_bandwidth_gbps": b.memory_bandwidth_gbps,
         "tflops_bf16": b.tflops_bf16, "load_watts": b.load_watts, "list_price_usd": b.list_price_usd,
         "estimates": sorted(b.estimates), "memory_options": options(b)}
        for k, b in cat.boxes.items()
    ]
    links = [
        {"key": k, "name": lk.name, "kind": lk.kind, "bandwidth_gbps": lk.bandwidth_gbps, "latency_s": lk.latency_s,
         "estimates": sorted(lk.estimates)}
        for k, lk in cat.links.items()
    ]
    formats = [{"name": f.name, "bits_per_weight": f.bits_per_weight, "source": f.source} for f in FORMATS.values()]
    profiles = [
        {"name": p.name, "mem_efficiency": p.mem_efficiency, "compute_efficiency": p.compute_efficiency,
         "step_overhead_s": p.step_overhead_s, "layer_overhead_s": p.layer_overhead_s,
         "collective_overhead_s": p.collective_overhead_s, "tcp_message_overhead_s": p.tcp_message_overhead_s, "source": p.source}
        for p in load_profiles().values()
    ]
    return {"models": models, "boxes": boxes, "links": links, "formats": formats, "profiles": profiles}


def register(app: typer.Typer) -> None:
    """Add the `catalog` verb."""

    @app.command("catalog")
    def catalog_command(
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    ) -> None:
        """List models, boxes, links, quantization formats and runtime profiles (figures carry sources in the catalog files)."""
        doc = catalog_document()
        if json_out:
            print(json.dumps(doc, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        t = Table(title="Models (bundled Hugging Face configs)")
        for c in ("key", "type", "total B", "active B", "layers", "experts"):
            t.add_column(c)
        for m in doc["models"]:
            t.add_row(m["key"], m["model_type"], f"{m['total_params'] / 1e9:,.1f}", f"{m['active_params'] / 1e9:,.2f}",
                      str(m["layers"]), f"{m['experts_per_token']}/{m['experts']}" if m["experts"] else "dense")
        con.print(t)
        t = Table(title="Boxes (* = contains estimates)")
        for c in ("key", "memory GB", "GB/s", "bf16 TFLOPS", "load W", "list $", "memory options GB"):
            t.add_column(c)
        for b in doc["boxes"]:
            opts = "/".join(f"{o['memory_gb']:g}" for o in b["memory_options"] or ())
            t.add_row(b["key"] + (" *" if b["estimates"] else ""), f"{b['memory_gb']:g}", f"{b['memory_bandwidth_gbps']:g}",
                      f"{b['tflops_bf16']:g}", f"{b['load_watts']:g}", f"{b['list_price_usd']:,.0f}", opts)
        con.print(t)
        t = Table(title="Memory options (plan each with --box KEY; * = contains estimates)")
        for c in ("key", "memory GB", "GB/s", "bf16 TFLOPS", "list $"):
            t.add_column(c)
        for o in (o for b in doc["boxes"] for o in b["memory_options"] or ()):
            t.add_row(o["key"] + (" *" if o["estimates"] else ""), f"{o['memory_gb']:g}", f"{o['memory_bandwidth_gbps']:g}",
                      f"{o['tflops_bf16']:g}", f"{o['list_price_usd']:,.0f}")
        con.print(t)
        t = Table(title="Links (* = contains estimates)")
        for c in ("key", "kind", "GB/s", "latency us"):
            t.add_column(c)
        for lk in doc["links"]:
            t.add_row(lk["key"] + (" *" if lk["estimates"] else ""), lk["kind"], f"{lk['bandwidth_gbps']:g}",
                      f"{lk['latency_s'] * 1e6:g}")
        con.print(t)
        t = Table(title="Quantization formats")
        t.add_column("name")
        t.add_column("bits/weight")
        t.add_column("source")
        for f in doc["formats"]:
            t.add_row(f["name"], f"{f['bits_per_weight']:.3f}", f["source"])
        con.print(t)
        t = Table(title="Runtime profiles")
        for c in ("name", "mem eff", "compute eff", "step ms", "per-layer us", "per-collective us", "TCP per-message us", "source"):
            t.add_column(c)
        for p in doc["profiles"]:
            t.add_row(p["name"], f"{p['mem_efficiency']:.3f}", f"{p['compute_efficiency']:.1f}",
                      f"{p['step_overhead_s'] * 1e3:.2f}", f"{p['layer_overhead_s'] * 1e6:.0f}",
                      f"{p['collective_overhead_s'] * 1e6:.0f}",
                      f"{p['tcp_message_overhead_s'] * 1e6:.0f}", p["source"])
        con.print(t)

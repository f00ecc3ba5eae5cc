"""`shardwise bench --url http://HOST:PORT/v1`: an OpenAI-compatible server measured per
``pp / tg @ depth`` point and concurrency, with the plan's prediction beside each point when the
plan's flags are given. Called by ``commands.bench`` (which owns the verb); parse, call, print.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from shardwise.errors import ShardwiseError


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3g}" if x < 0.1 else f"{x * 1e3:,.0f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def render(doc: dict[str, Any]) -> None:
    """One row per point: prompt tokens, prefill, decode (each beside the plan), TTFT, ITL."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    planned = any(p["prediction"] for p in doc["points"])
    t = Table(title=f"{doc['model']} at {doc['url']} ({doc['endpoint']}, streamed, {doc['runs']} run"
                    f"{'s' if doc['runs'] != 1 else ''} per point)", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    cols = ["test", "conc", "prompt\ntokens", "prefill\ntok/s"] + (["plan"] if planned else []) + [
        "decode\ntok/s"] + (["plan"] if planned else []) + ["all reqs\ndecode", "TTFT ms\np50/p99", "ITL ms\np50/p99"]
    for c in cols:
        t.add_column(c, justify="left" if c == "test" else "right", overflow="fold")
    for p in doc["points"]:
        pred, pt = p["prediction"], p["prompt_tokens"]
        prompt = str(pt["min"]) if pt["min"] == pt["max"] else f"{pt['min']}-{pt['max']}"
        row = [p["test"].replace(" / ", "/"), str(p["concurrency"]), prompt, _rate(p["prefill_tok_per_s"])]
        if planned:
            row.append(_rate(pred["prefill_tok_per_s"]) if pred else "-")
        row.append(_rate(p["decode_tok_per_s"]))
        if planned:
            row.append(_rate(pred["decode_tok_per_s"]) if pred else "-")
        row += [_rate(p["decode_total_tok_per_s"]), f"{_ms(p['ttft_s']['p50'])}/{_ms(p['ttft_s']['p99'])}",
                f"{_ms(p['itl_s']['p50'])}/{_ms(p['itl_s']['p99'])}"]
        t.add_row(*row)
    con.print(t)
    fitted = f"; fitted with {doc['prompt_tokens_method']}" if doc["server"]["stream_usage"] else ""
    con.print(f"prompt tokens: {doc['prompt_tokens_accuracy']}{fitted}")
    con.print(f"prefill tok/s = (depth + pp) tokens / (TTFT - {doc['latency_s'] * 1e3:.1f} ms latency); "
              f"decode tok/s = (tokens - 1) / (last - first token), per request (medians)")
    first = next((p["prediction"] for p in doc["points"] if p["prediction"]), None)
    if first:
        con.print(f"plan: {first['model']} on {first['boxes']} x {first['box']} ({first['layout']}, "
                  f"{first['runtime']} profile), batch 1, decode context depth + pp + tg/2")
    for note in doc["notes"]:
        con.print(f"[yellow]note:[/] {note}")
    if doc.get("json_path"):
        con.print(f"wrote {doc['json_path']}")


def serving_bench(
    url: str, model: str | None, pp: int | None, tg: int | None, depth: str | None, concurrency: str | None,
    runs: int | None, endpoint: str | None, api_key: str | None, timeout: float, plan_model: str | None,
    box: str | None, boxes: int | None, link: str | None, runtime: str | None, out: Path | None, json_out: bool,
) -> None:
    """Check the flags, predict with the plan (if asked), measure the server, print."""
    from shardwise.measure.serving_bench import measure_server, plan_predictions, serving_inputs

    cfg, plan = serving_inputs(url, model, pp, tg, depth, concurrency, runs, endpoint, api_key, timeout,
                               plan_model, box, boxes, link, runtime)
    predictions = plan_predictions(plan, cfg.pp, cfg.tg, cfg.depths) if plan is not None else None
    if out is not None and not out.parent.is_dir():
        raise ShardwiseError(f"{out}: folder '{out.parent}' does not exist")
    progress = None if json_out else (lambda what: typer.echo(f"measuring {what}", err=True))
    doc = measure_server(cfg, predictions, progress)
    if out is not None:
        try:
            out.write_text(json.dumps(doc, indent=2))
        except OSError as exc:
            raise ShardwiseError(f"cannot write {out} ({exc.strerror})") from None
        doc["json_path"] = str(out)
    if json_out:
        print(json.dumps(doc, indent=2))
    else:
        render(doc)

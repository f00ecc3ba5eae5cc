"""The report's charts: each a plotly figure with axis units and a one-sentence caption.

Every builder returns a ``Chart`` (id, title, figure, caption) from plain documents (see
``report.inputs``), so the report can be rebuilt from files alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from shardwise.report.inputs import RunDocument

GB = 1e9
COLORS = {"compute": "#1f77b4", "comm": "#ff7f0e", "wait": "#b0b0b0"}
_LAYOUT = dict(template="plotly_white", margin=dict(l=70, r=30, t=30, b=60), height=430,
               font=dict(family="system-ui, sans-serif", size=13))


@dataclass(frozen=True)
class Chart:
    """One chart of the report."""

    id: str
    title: str
    figure: go.Figure
    caption: str


def _fmt(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:,.2f}"


def _label(plan: dict) -> str:
    c = plan["cluster"]
    return f"{plan['model']['name']} on {c['boxes']} x {c['box']} ({plan['plan']['layout']})"


# ---- waterfall -------------------------------------------------------------------------------


def waterfall(plan: dict, run: RunDocument | None) -> Chart:
    """Decode tok/s from the bandwidth ceiling down to the estimate, step by named step."""
    steps = plan["decode"]["waterfall"]
    names = [s["step"] for s in steps]
    values = [s["tok_per_s"] for s in steps]
    deltas = [values[0]] + [b - a for a, b in zip(values, values[1:])]
    estimate = plan["decode"]["tok_per_s"]
    fig = go.Figure(go.Waterfall(
        x=names + ["estimate"], y=deltas + [0.0], measure=["absolute"] + ["relative"] * (len(steps) - 1) + ["total"],
        text=[_fmt(v) for v in values] + [_fmt(estimate)], textposition="outside",
        hovertext=[s["cause"] for s in steps] + ["the planner's decode estimate"], hoverinfo="x+text+y",
        connector=dict(line=dict(color="#888")), decreasing=dict(marker=dict(color="#d62728")),
        increasing=dict(marker=dict(color="#2ca02c")), totals=dict(marker=dict(color="#1f77b4")),
        name="model", showlegend=False,
    ))
    caption = (f"Decode speed of {_label(plan)} falls from the seed arithmetic's {_fmt(values[0])} tok/s "
               f"bandwidth ceiling to the {_fmt(estimate)} tok/s estimate, one named cause per step")
    if run is not None:
        fig.add_trace(go.Bar(x=[f"measured ({run.kind})"], y=[run.measured_tok_per_s], marker_color="#9467bd",
                             text=[_fmt(run.measured_tok_per_s)], textposition="outside", name="measured",
                             showlegend=False))
        caption += f", against {_fmt(run.measured_tok_per_s)} tok/s measured by the {run.kind}"
    fig.update_layout(**_LAYOUT, yaxis_title="decode tokens/s (batch 1)", xaxis_title="step (hover for its cause)")
    fig.update_xaxes(tickangle=-25)
    return Chart("waterfall", "Decode waterfall", fig, caption + ".")


# ---- memory ------------------------------------------------------------------------------------


def memory(plan: dict) -> Chart:
    """Memory of the fullest box: weights, KV cache, workspace, reserve, free."""
    mem = plan["memory"]
    parts = [("weights", mem["weights_bytes"], "#1f77b4"), ("KV cache", mem["kv_bytes"], "#ff7f0e"),
             ("workspace", mem["workspace_bytes"], "#8c564b"), ("reserve", mem["reserve_bytes"], "#7f7f7f"),
             ("free", max(mem["free_bytes"], 0.0), "#2ca02c")]
    x = [f"fullest box ({plan['cluster']['box']})"]
    fig = go.Figure([go.Bar(name=n, x=x, y=[v / GB], marker_color=c, text=[f"{v / GB:,.1f} GB"], textposition="inside")
                     for n, v, c in parts])
    fig.add_hline(y=mem["box_bytes"] / GB, line_dash="dash", line_color="#d62728",
                  annotation_text=f"box memory {mem['box_bytes'] / GB:,.0f} GB")
    fig.update_layout(**_LAYOUT, barmode="stack", yaxis_title="memory per box (GB)", xaxis_title="box")
    free = mem["free_bytes"] / GB
    tail = f"{free:,.1f} GB free" if free >= 0 else f"{-free:,.1f} GB short: this plan does not fit"
    caption = (f"The fullest of {plan['cluster']['boxes']} boxes holds {mem['weights_bytes'] / GB:,.1f} GB of weights, "
               f"{mem['kv_bytes'] / GB:,.1f} GB of KV cache at {mem['context_tokens']:,} tokens, "
               f"{mem['workspace_bytes'] / GB:,.1f} GB of workspace and a {mem['reserve_bytes'] / GB:,.1f} GB reserve "
               f"out of {mem['box_bytes'] / GB:,.0f} GB, leaving {tail}.")
    return Chart("memory", "Memory per box", fig, caption)


# ---- roofline ------------------------------------------------------------------------------------


def roofline(plan: dict, peak_tflops: float, mem_efficiency: float, compute_efficiency: float) -> Chart:
    """Per-box roofline (FLOP/byte vs TFLOPS) with the decode step and the prefill on it.

    Decode: bytes = memory_s · BW · eff_mem and FLOPs = compute_s · peak · eff_compute (the
    plan's busiest-rank step); attained = FLOPs / step_s. Prefill (approximate): the decode
    step's FLOPs × prompt tokens over the rank's weights read once, in the prefill's time.
    """
    import numpy as np

    d, pf, mem = plan["decode"], plan["prefill"], plan["memory"]
    bw = plan["cluster"]["memory_bandwidth_gbps"] * GB
    peak = peak_tflops * 1e12
    flops = d["compute_s"] * peak * compute_efficiency
    nbytes = d["memory_s"] * bw * mem_efficiency
    dec_i, dec_p = flops / nbytes, flops / d["step_s"] / 1e12
    pre_flops = flops * pf["prompt_tokens"]
    pre_i = pre_flops / mem["weights_bytes"]
    pre_p = pre_flops / (pf["prompt_tokens"] / pf["tok_per_s"]) / 1e12
    ridge = peak / bw
    xs = np.logspace(np.log10(min(dec_i, ridge) / 10), np.log10(max(pre_i, ridge) * 10), 200)
    fig = go.Figure([
        go.Scatter(x=xs, y=np.minimum(peak, bw * xs) / 1e12, name="peak roof", line=dict(color="#444")),
        go.Scatter(x=xs, y=np.minimum(peak * compute_efficiency, bw * mem_efficiency * xs) / 1e12,
                   name=f"runtime roof ({plan['plan']['runtime']})", line=dict(color="#444", dash="dash")),
        go.Scatter(x=[dec_i], y=[dec_p], mode="markers+text", name="decode step (batch 1)", text=["decode"],
                   textposition="top center", marker=dict(size=13, color="#d62728")),
        go.Scatter(x=[pre_i], y=[pre_p], mode="markers+text", name=f"prefill ({pf['prompt_tokens']} tokens, approx.)",
                   text=["prefill"], textposition="top center", marker=dict(size=13, color="#2ca02c", symbol="diamond")),
    ])
    fig.update_layout(**_LAYOUT, xaxis_type="log", yaxis_type="log", xaxis_title="arithmetic intensity (FLOP/byte)",
                      yaxis_title="attained TFLOPS per box (bf16)", xaxis_dtick=1, yaxis_dtick=1)
    bound = "memory bandwidth" if dec_i < ridge else "compute"
    caption = (f"Roofline of one {plan['cluster']['box']} ({plan['cluster']['memory_bandwidth_gbps']:g} GB/s, "
               f"{peak_tflops:g} bf16 TFLOPS, ridge at {ridge:,.0f} FLOP/byte): batch-1 decode sits at "
               f"{dec_i:,.1f} FLOP/byte and {dec_p:,.3f} TFLOPS, bound by {bound}, while prefill reaches about "
               f"{pre_i:,.0f} FLOP/byte and {pre_p:,.1f} TFLOPS.")
    return Chart("roofline", "Roofline", fig, caption)


# ---- Pareto scatter --------------------------------------------------------------------------------


def pareto(rows: list[dict], plan: dict | None) -> Chart:
    """Front rows: cost vs decode tok/s, colour = loaded watts, one trace per model; the chosen
    configuration (the plan's, else the fastest row) as a star."""
    models = sorted({r["model"] for r in rows})
    watts = [r["watts"] for r in rows]
    cmin, cmax = min(watts), max(watts)
    fig = go.Figure()
    symbols = ["circle", "square", "triangle-up", "diamond", "cross", "x", "pentagon", "hexagon", "triangle-down"]
    for i, m in enumerate(models):
        sel = [r for r in rows if r["model"] == m]
        fig.add_trace(go.Scatter(
            x=[r["usd"] for r in sel], y=[r["tok_per_s"] for r in sel], mode="markers", name=m,
            marker=dict(size=10, symbol=symbols[i % len(symbols)], color=[r["watts"] for r in sel], cmin=cmin,
                        cmax=cmax, colorscale="Viridis", showscale=i == 0,
                        colorbar=dict(title="loaded W") if i == 0 else None, line=dict(width=0.5, color="#333")),
            text=[f"{r['boxes']} x {r['box']} over {r['link']}, {r.get('layout', '')} {r.get('quant', '')}: "
                  f"{r['tok_per_s']:,.2f} tok/s, ${r['usd']:,.0f}, {r['watts']:,.0f} W, {r['bottleneck']}" for r in sel],
            hoverinfo="text",
        ))
    if plan is not None:
        chosen_x, chosen_y = plan["cost"]["total_usd"], plan["decode"]["tok_per_s"]
        chosen = f"the plan's {plan['cluster']['boxes']} x {plan['cluster']['box']} ({plan['plan']['layout']})"
        on = any(r["model"] == plan["model"]["name"] and r["boxes"] == plan["cluster"]["boxes"]
                 and abs(r["tok_per_s"] - chosen_y) <= 1e-6 * chosen_y and abs(r["usd"] - chosen_x) <= 1e-6 * chosen_x
                 for r in rows)
        chosen += ", on the front" if on else ", off the front"
    else:
        best = rows[0]
        chosen_x, chosen_y = best["usd"], best["tok_per_s"]
        chosen = f"the fastest row, {best['boxes']} x {best['box']} over {best['link']}"
    fig.add_trace(go.Scatter(x=[chosen_x], y=[chosen_y], mode="markers", name="chosen",
                             marker=dict(symbol="star", size=22, color="#d62728", line=dict(width=1, color="#000")),
                             text=[chosen], hoverinfo="text"))
    fig.update_layout(**_LAYOUT, xaxis_type="log", yaxis_type="log", xaxis_title="cost, boxes + switches (USD)",
                      yaxis_title="decode tokens/s (batch 1)", legend=dict(x=1.12), xaxis_dtick=1, yaxis_dtick=1)
    caption = (f"{len(rows)} configurations on the Pareto front of decode tok/s vs cost vs power "
               f"({', '.join(models)}), coloured by loaded watts; the star is {chosen}.")
    return Chart("pareto", "Pareto front", fig, caption)


# ---- per-layer timeline -----------------------------------------------------------------------------


def _segments(rows: list[tuple[str, list[tuple[int, float, float, float]]]]):
    """Bars for rows of (label, [(layer, compute_s, comm_s, wait_s), ...]) laid end to end (ms)."""
    out = {k: dict(base=[], x=[], y=[], layer=[]) for k in COLORS}
    for label, layers in rows:
        t = 0.0
        for layer, *parts in layers:
            for kind, seconds in zip(COLORS, parts):
                if seconds > 0:
                    out[kind]["base"].append(t * 1e3)
                    out[kind]["x"].append(seconds * 1e3)
                    out[kind]["y"].append(label)
                    out[kind]["layer"].append(layer)
                t += seconds
    return out


def predicted_timeline_rows(plan: dict) -> list[tuple[str, list]]:
    """Per-rank predicted layers from a plan: each layer's time on the busiest rank as compute,
    the step's collective time spread evenly over layers as communication, and other stages'
    layers as waiting (batch-1 pipeline stages take turns)."""
    per_layer = plan["decode"]["per_layer_s"]
    n_layers = len(per_layer)
    tp, pp = plan["plan"]["tp"], plan["plan"]["pp"]
    comm = plan["decode"]["collective_s"] / n_layers if n_layers else 0.0
    base, extra = divmod(n_layers, pp)
    rows = []
    for rank in range(tp * pp):
        stage = rank // tp
        start = stage * base + min(stage, extra)
        stop = start + base + (1 if stage < extra else 0)
        rows.append((f"rank {rank} predicted", [
            (i, t, comm, 0.0) if start <= i < stop else (i, 0.0, 0.0, t + comm) for i, t in enumerate(per_layer)
        ]))
    return rows


def trace_timeline_rows(run: RunDocument) -> list[tuple[str, list]]:
    """Measured and predicted rows per rank from a trace; predicted waiting is the gap to the
    slowest rank's predicted compute + communication in that layer."""
    by_layer: dict[int, list] = {}
    for e in run.layers:
        by_layer.setdefault(e.layer, []).append(e)
    predicted = all(e.has_prediction for e in run.layers)
    slowest = {
        layer: max(e.predicted_compute_s + e.predicted_comm_s for e in es) for layer, es in by_layer.items()
    } if predicted else {}
    rows = []
    for rank in sorted({e.rank for e in run.layers}):
        mine = sorted((e for e in run.layers if e.rank == rank), key=lambda e: e.layer)
        rows.append((f"rank {rank} measured", [(e.layer, e.compute_s, e.comm_s, e.wait_s) for e in mine]))
        if predicted:
            rows.append((f"rank {rank} predicted", [
                (e.layer, e.predicted_compute_s, e.predicted_comm_s,
                 slowest[e.layer] - e.predicted_compute_s - e.predicted_comm_s) for e in mine
            ]))
    return rows


def timeline(plan: dict | None, trace: RunDocument | None) -> Chart:
    """Per-layer compute / communication / waiting per rank, predicted vs measured."""
    rows = trace_timeline_rows(trace) if trace is not None else predicted_timeline_rows(plan)
    segs = _segments(rows)
    fig = go.Figure()
    names = {"compute": "compute", "comm": "communication", "wait": "waiting"}
    for kind, s in segs.items():
        fig.add_trace(go.Bar(
            base=s["base"], x=s["x"], y=s["y"], orientation="h", name=names[kind], marker_color=COLORS[kind],
            customdata=s["layer"], hovertemplate="layer %{customdata}: %{x:.3f} ms<extra>" + names[kind] + "</extra>",
        ))
    labels = [label for label, _ in rows]
    fig.update_layout(**{**_LAYOUT, "height": max(300, 22 * len(labels) + 120)}, barmode="overlay",
                      xaxis_title="time into the decode step (ms)", yaxis_title="rank",
                      yaxis=dict(categoryorder="array", categoryarray=labels[::-1]))
    if trace is not None and trace.predicted_tok_per_s is not None:
        caption = (f"Per-layer timeline of one decode step of {trace.model} on each of {len(labels) // 2} ranks: "
                   f"compute, communication and waiting for the slowest rank, measured rows above predicted ones "
                   f"({_fmt(trace.measured_tok_per_s)} tok/s measured vs {_fmt(trace.predicted_tok_per_s)} predicted).")
    elif trace is not None:
        caption = (f"Measured per-layer timeline of one decode step of {trace.model} on each of {len(labels)} ranks: "
                   f"compute, communication and waiting for the slowest rank ({_fmt(trace.measured_tok_per_s)} tok/s); "
                   f"run `shardwise bench` for the predicted rows beside them.")
    else:
        caption = (f"Predicted per-layer timeline of one decode step of {_label(plan)} on each of {len(labels)} ranks: "
                   f"compute, communication (the step's collectives spread evenly over layers) and waiting on other "
                   f"pipeline stages; pass a trace from the runtime's --trace to add measured rows.")
    return Chart("timeline", "Per-layer timeline", fig, caption)


# ---- concurrency --------------------------------------------------------------------------------


def concurrency(plan: dict) -> Chart:
    """Per-sequence and aggregate decode tok/s against the batch (the plan's ``--batch-curve``)."""
    curve = plan["decode"]["batch_curve"]
    batches = [r["batch"] for r in curve]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=batches, y=[r["aggregate_tok_per_s"] for r in curve], mode="lines+markers",
                             name="tok/s in all", line=dict(color="#2ca02c")))
    fig.add_trace(go.Scatter(x=batches, y=[r["tok_per_s"] for r in curve], mode="lines+markers",
                             name="tok/s per sequence", line=dict(color="#1f77b4"), yaxis="y2"))
    cross = plan["decode"].get("compute_bound_from_batch")
    if cross:
        fig.add_vline(x=cross, line=dict(color="#d62728", dash="dot"),
                      annotation_text=f"compute-bound from {cross}", annotation_position="top left")
    fig.update_layout(**_LAYOUT, xaxis=dict(title="sequences decoded together (batch)", type="log"),
                      yaxis=dict(title="decode tok/s, all sequences"),
                      yaxis2=dict(title="decode tok/s per sequence", overlaying="y", side="right", rangemode="tozero"),
                      legend=dict(orientation="h", y=1.08))
    most = plan["memory"]["max_batch"]
    caption = (f"{_label(plan)}: {_fmt(curve[0]['tok_per_s'])} tok/s for one sequence; at the {most} sequences whose "
               f"caches fit at {plan['memory']['context_tokens']:,} tokens, {_fmt(curve[-1]['tok_per_s'])} each and "
               f"{_fmt(curve[-1]['aggregate_tok_per_s'])} in all"
               + (f"; decode turns compute-bound from batch {cross}." if cross else "; decode stays memory-bound."))
    return Chart("concurrency", "Users at once: speed per sequence and in all", fig, caption)

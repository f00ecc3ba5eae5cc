"""One self-contained HTML report: plotly.js inline, data inline, no network needed.

The page counts the charts it drew in ``window.__charts_rendered`` (and on
``<body data-charts-rendered>``), and records script errors and ``console.error`` calls in
``window.__chart_errors`` (``<body data-chart-errors>``), so a headless browser can check it.
"""

from __future__ import annotations

import html
import json

import plotly.io as pio
from plotly.offline import get_plotlyjs

from shardwise.errors import ShardwiseError
from shardwise.report import charts
from shardwise.report.inputs import Inputs

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: .2rem; } .meta { color: #666; margin-top: 0; }
section { margin: 2rem 0; } .chart { width: 100%; min-height: 300px; }
.caption { color: #333; margin: .3rem 0 0 0; font-size: .95rem; }
.notes li { color: #555; }
"""

_GUARD = """
window.__chart_errors = [];
window.addEventListener('error', function (e) { window.__chart_errors.push(String(e.message || e)); });
(function () {
  var original = console.error;
  console.error = function () {
    window.__chart_errors.push(Array.prototype.map.call(arguments, String).join(' '));
    return original.apply(console, arguments);
  };
})();
"""

_DRAW = """
(function () {
  var specs = JSON.parse(document.getElementById('chart-data').textContent);
  window.__charts_expected = specs.length;
  window.__charts_rendered = 0;
  function finish() {
    document.body.setAttribute('data-charts-rendered', String(window.__charts_rendered));
    document.body.setAttribute('data-chart-errors', JSON.stringify(window.__chart_errors));
    document.body.setAttribute('data-done', '1');
  }
  Promise.all(specs.map(function (s) {
    return Plotly.newPlot(s.id, s.figure.data, s.figure.layout, {displaylogo: false, responsive: true})
      .then(function () { window.__charts_rendered += 1; });
  })).then(finish, function (err) { window.__chart_errors.push(String(err)); finish(); });
})();
"""


def build_charts(inputs: Inputs) -> tuple[list[charts.Chart], list[str]]:
    """The charts the inputs allow, and a note for each one they do not."""
    from shardwise.perf.profiles import get_profile

    out: list[charts.Chart] = []
    notes: list[str] = []
    plan, run = inputs.plan, inputs.run
    if plan is not None:
        out.append(charts.waterfall(plan, run))
        out.append(charts.memory(plan))
        peak = box_peak_tflops(plan)
        if peak is None:
            notes.append(f"no roofline: box '{plan['cluster']['box']}' is not in the catalog, so its peak FLOPS are unknown")
        else:
            prof = get_profile(plan["plan"]["runtime"])
            out.append(charts.roofline(plan, peak, prof.mem_efficiency, prof.compute_efficiency))
        if plan["decode"].get("batch_curve"):
            out.append(charts.concurrency(plan))
        else:
            notes.append("no concurrency chart: pass a plan made with --batch-curve")
    else:
        notes.append("no waterfall, memory or roofline chart: pass a plan (`shardwise plan --json > plan.json`)")
    if inputs.sweep is not None:
        out.append(charts.pareto(inputs.sweep, plan))
    else:
        notes.append("no Pareto chart: pass a sweep (`shardwise sweep --json > sweep.json`)")
    # A bench carries measured and predicted per-layer rows; a raw trace only measured ones.
    timed = inputs.bench if inputs.bench is not None and inputs.bench.layers else inputs.trace
    if timed is not None or plan is not None:
        out.append(charts.timeline(plan, timed))
        if timed is None:
            notes.append("the timeline is predicted only: pass a trace (the runtime's --trace JSON) to compare")
    else:
        notes.append("no timeline: pass a plan, a bench or a trace")
    if not out:
        raise ShardwiseError(
            "nothing to draw: pass a plan, sweep, bench or trace document (or no input for the default report)"
        )
    return out, notes


def box_peak_tflops(plan: dict) -> float | None:
    """The plan's box's bf16 peak from the catalog (the plan names it by key or display name)."""
    from shardwise.spec.hardware import load_catalog

    name = plan["cluster"]["box"]
    if "tflops_bf16" in plan["cluster"]:
        return float(plan["cluster"]["tflops_bf16"])
    for key, box in load_catalog().boxes.items():
        if name in (key, box.name):
            return box.tflops_bf16
    return None


def render_html(chart_list: list[charts.Chart], title: str, subtitle: str, notes: list[str]) -> str:
    """The report page (one string, no external references)."""
    specs = [{"id": f"chart-{c.id}", "figure": json.loads(pio.to_json(c.figure, validate=False))} for c in chart_list]
    data = json.dumps(specs, separators=(",", ":")).replace("</", "<\\/")
    sections = "\n".join(
        f'<section><h2>{html.escape(c.title)}</h2><div id="chart-{c.id}" class="chart"></div>'
        f'<p class="caption">{html.escape(c.caption)}</p></section>'
        for c in chart_list
    )
    note_list = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script>{_GUARD}</script><script>{get_plotlyjs()}</script></head>\n<body>"
        f"<h1>{html.escape(title)}</h1><p class=\"meta\">{html.escape(subtitle)}</p>\n{sections}\n"
        + (f'<section class="notes"><h2>Notes</h2><ul>{note_list}</ul></section>' if notes else "")
        + f'<script id="chart-data" type="application/json">{data}</script><script>{_DRAW}</script>'
        "</body></html>\n"
    )


def build_report(inputs: Inputs, subtitle: str) -> tuple[str, list[charts.Chart], list[str]]:
    """(HTML, charts, notes) for the inputs."""
    chart_list, notes = build_charts(inputs)
    title = "shardwise report"
    if inputs.plan is not None:
        title += f": {charts._label(inputs.plan)}"
    elif inputs.run is not None:
        title += f": {inputs.run.model}"
    return render_html(chart_list, title, subtitle, notes), chart_list, notes


def default_inputs(max_boxes: int = 32) -> Inputs:
    """The seed's case: its plan (``shardwise plan`` defaults) and a sweep of its model around it."""
    from shardwise.perf.estimate import estimate
    from shardwise.perf.sweep import run_sweep
    from shardwise.perf.scenario import SEED, build_request, build_scenario

    sc = build_scenario(SEED["model"], SEED["box"], SEED["boxes"], SEED["link"], None, None, None, 4096, 2048, 0,
                        None, None, "vllm", None, None, None, None, "bf16")
    plan = estimate(sc, curve=True)
    rows = run_sweep(build_request(model=SEED["model"], max_boxes=max(max_boxes, SEED["boxes"]))).rows
    return Inputs(plan=plan, sweep=rows, sources={"plan": "shardwise plan (defaults)",
                                                  "sweep": f"shardwise sweep --model {SEED['model']} --max-boxes {max_boxes}"})

"""`shardwise report`: a self-contained HTML page whose every chart renders in real headless
Chromium without console errors; input detection; a trace of another model is refused."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import run_cli
from shardwise.errors import ShardwiseError
from shardwise.perf.estimate import estimate
from shardwise.perf.sweep import run_sweep
from shardwise.perf.scenario import build_request, build_scenario
from shardwise.report.inputs import classify

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
CHART_IDS = ("waterfall", "memory", "roofline", "pareto", "timeline")


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed and could not be here (.ci/run installs it: apt-get install -y chromium)")
    return path


def _browse(html: Path, *flags: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=30000", *flags, html.resolve().as_uri()],
            capture_output=True, text=True, timeout=180,
        )


def _check_rendered(html: Path, expected: tuple[str, ...]) -> None:
    dom = _browse(html, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    assert 'data-done="1"' in body, "the page never finished drawing"
    assert f'data-charts-rendered="{len(expected)}"' in body, body
    errors = json.loads(re.search(r'data-chart-errors="([^"]*)"', body).group(1).replace("&quot;", '"'))
    assert errors == [], errors
    for chart in expected:
        div = re.search(rf'<div id="chart-{chart}"(.*?)<p class="caption">', dom.stdout, re.S)
        assert div and "main-svg" in div.group(1), f"chart {chart} has no plot"
    captions = re.findall(r'<p class="caption">(.*?)</p>', dom.stdout, re.S)
    assert len(captions) == len(expected) and all(c.strip().endswith(".") for c in captions)


def _trace_for(plan: dict, model: str | None = None, slower: float = 1.25) -> dict:
    """A trace document in the runtime's schema for the plan's configuration: every rank's
    predicted layer times from the plan, measured ones a fixed factor slower."""
    per_layer = plan["decode"]["per_layer_s"]
    comm = plan["decode"]["collective_s"] / len(per_layer)
    ranks = plan["plan"]["tp"] * plan["plan"]["pp"]
    layers = [
        {"layer": i, "kind": "moe" if i else "attention", "rank": r, "compute_s": t * slower * (1 + 0.05 * r),
         "comm_s": comm * slower, "wait_s": t * slower * 0.05 * (ranks - 1 - r),
         "predicted_compute_s": t, "predicted_comm_s": comm}
        for i, t in enumerate(per_layer) for r in range(ranks)
    ]
    return {"kind": "trace", "model": model or plan["model"]["name"], "predicted_tok_per_s": plan["decode"]["tok_per_s"],
            "measured_tok_per_s": plan["decode"]["tok_per_s"] / slower, "source": "test fixture", "layers": layers}


def _plan(model="llama-3.1-8b", box="dgx-spark", boxes=2, link="100g-roce") -> dict:
    return estimate(build_scenario(model, box, boxes, link, None, None, None, 4096, 2048, 0, None, None, "vllm",
                                   None, None, None, None, "bf16"))


def test_default_report_renders_every_chart_in_chromium(tmp_path):
    out = tmp_path / "report.html"
    res = run_cli("report", "-o", str(out))
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert "<script src" not in text and "<link " not in text, "the report must not load anything"
    assert "Kimi" in text or "kimi-k3" in text
    _check_rendered(out, CHART_IDS + ("concurrency",))
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    if shot.exists():
        shot.unlink()
    res = _browse(out, "--hide-scrollbars", "--window-size=1300,3400", f"--screenshot={shot}")
    assert res.returncode == 0 and shot.stat().st_size > 20_000, res.stderr[-2000:]
    print(f"report screenshot: {shot}")


def test_report_from_plan_sweep_bench_and_trace(tmp_path):
    plan = _plan()
    sweep = run_sweep(build_request(model="llama-3.1-8b", box="dgx-spark,rtx-4090", boxes="1-4")).rows
    trace = _trace_for(plan)
    bench = {"kind": "bench", "model": "llama-3.1-8b", "predicted_tok_per_s": plan["decode"]["tok_per_s"],
             "measured_tok_per_s": plan["decode"]["tok_per_s"] * 0.9}
    files = {}
    for name, doc in (("plan", plan), ("sweep", sweep), ("trace", trace), ("bench", bench)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(doc))
    out = tmp_path / "r.html"
    res = run_cli("report", *map(str, files.values()), "-o", str(out))
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert "measured (bench)" in text and "rank 1 measured" in text and "rank 1 predicted" in text
    _check_rendered(out, CHART_IDS)
    # a sweep alone draws the Pareto chart and says what is missing
    only = tmp_path / "only.html"
    res = run_cli("report", str(files["sweep"]), "-o", str(only))
    assert res.returncode == 0 and "note: no waterfall" in res.stdout
    _check_rendered(only, ("pareto",))


def test_trace_of_another_model_is_refused(tmp_path):
    plan, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    plan.write_text(json.dumps(_plan("llama-3.1-8b")))
    trace.write_text(json.dumps(_trace_for(_plan("llama-3.1-8b"), model="qwen3-30b-a3b")))
    res = run_cli("report", str(plan), str(trace), "-o", str(tmp_path / "x.html"))
    assert res.returncode == 2
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "'qwen3-30b-a3b'" in line and "'llama-3.1-8b'" in line
    assert not (tmp_path / "x.html").exists()


def test_input_kinds_are_detected_and_bad_documents_named():
    plan = _plan()
    assert classify(plan, "p")[0] == "plan"
    assert classify([{"model": "m", "box": "b", "boxes": 1, "link": "none", "tp": 1, "ep": 1, "pp": 1,
                      "tok_per_s": 1.0, "usd": 1.0, "watts": 1.0, "bottleneck": "compute"}], "s")[0] == "sweep"
    assert classify(_trace_for(plan), "t")[0] == "trace"
    bench = {"kind": "bench", "model": "m", "predicted_tok_per_s": 2.0, "measured_tok_per_s": 1.5}
    assert classify(bench, "b")[0] == "bench"
    with pytest.raises(ShardwiseError, match="t.json: trace document: a trace needs at least one entry"):
        classify({**bench, "kind": "trace"}, "t.json")
    with pytest.raises(ShardwiseError, match=r"b.json: bench document: measured_tok_per_s: Expected `float` > 0"):
        classify({**bench, "measured_tok_per_s": -1}, "b.json")
    layer = {"layer": 0, "kind": "moe", "rank": 0, "compute_s": 1e-3, "comm_s": 1e-4, "wait_s": 0.0}
    with pytest.raises(ShardwiseError, match=r"layers\[1\].rank: Expected `int` >= 0"):
        classify({**bench, "layers": [layer, {**layer, "rank": -1}]}, "b.json")
    with pytest.raises(ShardwiseError, match="layer 0 rank 0 is listed twice"):
        classify({**bench, "layers": [layer, layer]}, "b.json")
    with pytest.raises(ShardwiseError, match="sweep row 0 lacks watts"):
        classify([{"model": "m", "box": "b", "boxes": 1, "link": "l", "tp": 1, "ep": 1, "pp": 1, "tok_per_s": 1.0,
                   "usd": 1.0, "bottleneck": "x"}], "s.json")
    with pytest.raises(ShardwiseError, match="not a plan"):
        classify({"hello": 1}, "h.json")


def test_two_documents_of_one_kind_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    doc = json.dumps(_plan())
    a.write_text(doc)
    b.write_text(doc)
    res = run_cli("report", str(a), str(b), "-o", str(tmp_path / "x.html"))
    assert res.returncode == 2 and "two plan documents" in res.stderr


def test_report_from_a_real_runtime_trace(tmp_path):
    """`shardwise run --trace` on a tiny checkpoint, then `shardwise report` on its summary:
    the runtime's own document draws the measured timeline in Chromium."""
    ckpt = tmp_path / "ckpt"
    made = run_cli("make-checkpoint", "--model", "llama-3.1-8b", "--scale", "tiny", "--out", str(ckpt))
    assert made.returncode == 0, made.stderr
    trace = tmp_path / "t.json"
    ran = run_cli("run", str(ckpt), "--tp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--trace", str(trace))
    assert ran.returncode == 0, ran.stderr
    summary = tmp_path / "t.summary.json"
    html = tmp_path / "trace.html"
    made = run_cli("report", str(summary), "-o", str(html))
    assert made.returncode == 0, made.stderr
    _check_rendered(html, ("timeline",))
    assert "rank 1 measured" in html.read_text()

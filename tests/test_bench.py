"""`shardwise bench`: calibrated prediction terms, the bench JSON schema, and an end-to-end tp=2 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from shardwise.measure.bench import OpCounts, bench_document, calibrated_profile, layer_host_seconds, predict, with_host_probe
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.loader import load_spec

TRACE_LAYER_KEYS = {"layer", "kind", "rank", "compute_s", "comm_s", "wait_s"}


def _probe_doc(alpha=100e-6, beta_gbps=1.0, op_s=10e-6, overhead=20e-6) -> dict:
    return {
        "kind": "probe", "world_size": 2, "op_overhead_s": op_s, "tflops": {"fp32": 0.05, "bf16": 0.01},
        "collective_overhead_s": {"rd": overhead, "ring": 2 * overhead},
        "ring_fit": {"alpha_s": alpha, "beta_gbps": beta_gbps},
        "cluster": {"cluster": {"box": "cpu-host", "link": "loopback-tcp", "boxes": 2, "measured": {
            "source": "test", "memory_bandwidth_gbps": 10.0, "link_latency_s": alpha, "link_bandwidth_gbps": beta_gbps}}},
    }


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("llama"), seed=3)


def test_prediction_terms_come_from_the_probe(tiny_llama):
    spec = load_spec(tiny_llama)
    probe = _probe_doc()
    ops = OpCounts(layers=(100.0, 120.0), other=50.0)
    profile = calibrated_profile(probe, "rd", ops)
    assert profile.step_overhead_s == pytest.approx(270 * 10e-6)
    assert profile.collective_overhead_s == pytest.approx(20e-6) and profile.allreduce == ("rd",)
    pred = predict(spec, 2, 1, "float32", 16, probe, "rd", ops)
    ar = 100e-6 + 64 * 2 / 1e9  # rd over 2 ranks: α + n/β, n = hidden 64 x 2 bytes (the planner's bf16 wire)
    assert pred["allreduce_s"] == pytest.approx(ar)
    for row, n_ops in zip(pred["layers"], ops.layers):
        assert row["predicted_comm_s"] == pytest.approx(2 * (ar + 20e-6))
        assert row["predicted_compute_s"] > n_ops * 10e-6  # host ops plus the roofline term
        assert row["predicted_compute_s"] < n_ops * 10e-6 * 1.5  # a tiny model is all host overhead
    assert pred["tok_per_s"] == pytest.approx(1 / pred["step_s"])
    one = predict(spec, 1, 1, "float32", 16, probe, "builtin", ops)
    assert all(row["predicted_comm_s"] == 0 for row in one["layers"]) and one["collective_s"] == 0


def test_host_probe_figures_replace_the_probes_and_price_moe_layers_apart():
    """The run's own before/after timings of the reference blocks replace the probe's host
    figures (slowest rank), the in-decode all-reduce becomes the per-call overhead over the ring
    fit's α-β time, and MoE layers are priced at the MoE per-op cost."""
    from shardwise.runtime.host_costs import REFERENCE_MESSAGE_BYTES

    probe = _probe_doc()
    reports = [{"host_probe": {"op_overhead_s": 5e-6, "op_overhead_moe_s": 8e-6, "collective_in_decode_s": 9e-4}},
               {"host_probe": {"op_overhead_s": 6e-6, "op_overhead_moe_s": 7e-6, "collective_in_decode_s": 1e-3}}]
    doc = with_host_probe(probe, reports, "rd")
    assert doc["op_overhead_s"] == 6e-6 and doc["op_overhead_moe_s"] == 8e-6
    wire = 100e-6 + REFERENCE_MESSAGE_BYTES / 1e9  # rd over 2 ranks: α + n/β
    assert doc["collective_overhead_s"]["rd"] == pytest.approx(1e-3 - wire)
    assert doc["collective_overhead_s"]["ring"] == probe["collective_overhead_s"]["ring"]
    ops = OpCounts(layers=(100.0, 120.0), other=50.0)
    assert layer_host_seconds(doc, ops, (False, True)) == pytest.approx([100 * 6e-6, 120 * 8e-6])
    profile = calibrated_profile(doc, "rd", ops, (False, True))
    assert profile.step_overhead_s == pytest.approx(100 * 6e-6 + 120 * 8e-6 + 50 * 6e-6)


def test_bench_document_schema():
    summary = {"measured_tok_per_s": 90.0, "decode_steps": 7, "ranks": [], "layers": [
        {"layer": 0, "kind": "gqa", "mlp": "dense", "rank": r, "compute_s": 2e-3, "comm_s": 1e-3, "wait_s": 1e-4,
         "sync_s": 1e-4, "last_arrival_share": 0.5} for r in (0, 1)]}
    prediction = {"tok_per_s": 110.0, "step_s": 1 / 110, "layers": [
        {"layer": 0, "predicted_compute_s": 2.5e-3, "predicted_comm_s": 0.5e-3}]}
    doc = bench_document("tiny", 2, 1, "rd", 100.0, summary, prediction)
    assert doc["kind"] == "bench" and doc["model"] == "tiny"
    assert doc["predicted_tok_per_s"] == 110.0 and doc["measured_tok_per_s"] == 100.0
    assert doc["error"] == pytest.approx(0.1)
    for row in doc["layers"]:
        assert TRACE_LAYER_KEYS <= set(row)
        # the in-decode all-reduce cost is held against communication plus waiting: 0.5 vs 1.1 ms
        assert row["comm_wait_s"] == pytest.approx(1.1e-3)
        assert row["compute_error"] == pytest.approx(0.25) and row["comm_error"] == pytest.approx(0.5 / 1.1 - 1)
    assert [t["rank"] for t in doc["totals"]["comm"]] == [0, 1]
    assert doc["totals"]["comm"][0]["measured_s"] == pytest.approx(1.1e-3)


def test_bench_cli_tp2_writes_json_and_chrome_trace(tiny_llama, tmp_path, probe_run):
    env = {"OMP_NUM_THREADS": "1"}
    done, _, probe = probe_run
    assert done.returncode == 0, done.stderr
    out, trace = tmp_path / "bench.json", tmp_path / "bench.trace.json"
    done = run_cli("bench", str(tiny_llama), "--tp", "2", "--probe", str(probe), "--prompt-ids", "1,2,3",
                   "--max-new-tokens", "8", "--repeats", "1", "--out", str(out), "--trace", str(trace), "--json", env=env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["kind"] == "bench" and doc["model"] and doc["tp"] == 2
    assert doc["predicted_tok_per_s"] > 0 and doc["measured_tok_per_s"] > 0
    # --allreduce auto: the algorithm the probe's ring fit makes cheapest for one float32 hidden vector
    from shardwise.perf.allreduce_choice import choose_allreduce

    fit = json.loads(probe.read_text())["ring_fit"]
    want = choose_allreduce(load_spec(tiny_llama).hidden_size * 4, 2, fit["alpha_s"], fit["beta_gbps"] * 1e9).name
    assert doc["allreduce"] == want and want in ("ring", "rd", "oneshot")
    assert {(r["layer"], r["rank"]) for r in doc["layers"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for row in doc["layers"]:
        assert TRACE_LAYER_KEYS | {"predicted_compute_s", "predicted_comm_s"} <= set(row)
        assert row["predicted_comm_s"] > 0 and row["comm_s"] > 0 and row["compute_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1", "predicted (planner)"} <= names


def test_host_probe_runs_are_interleaved_with_probes_in_the_ranks(tiny_llama):
    """``host_probe=2``: two measured generations after the warm one, every step of both kept,
    the same tokens as a plain run, and the probe figures timed in each rank."""
    from shardwise.runtime.launch import launch_local
    from shardwise.runtime.runner import RunRequest, run_rank

    common = dict(checkpoint=str(tiny_llama), prompt_ids=(1, 2, 3), max_new_tokens=6, tp=2, ep=1, allreduce="rd")
    plain = launch_local(run_rank, 2, args=(RunRequest(**common),), timeout_s=120)
    probed = launch_local(run_rank, 2, args=(RunRequest(**common, host_probe=2),), timeout_s=240)
    for p, q in zip(plain, probed):
        assert q["tokens"] == p["tokens"]
        assert len(q["decode_step_s"]) == 2 * len(p["decode_step_s"]) == 2 * 5
        host = q["host_probe"]
        assert host["op_overhead_s"] > 0 and host["op_overhead_moe_s"] > 0 and host["collective_in_decode_s"] > 0
    assert "host_probe" not in plain[0]

"""`shardwise probe`: α/β fits, nccl-tests figures, cluster file round trip, unreachable peers, --allreduce auto."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import free_port, run_cli
from shardwise.measure.probe import message_sizes
from shardwise.measure.probe_fit import bus_bandwidth, fit_alpha_beta, ring_alpha_beta
from shardwise.perf.allreduce_choice import RUNNABLE_FLAT, choose_allreduce
from shardwise.perf.collectives import best_allreduce, runtime_allreduce_s
from shardwise.runtime.host_costs import REFERENCE_MESSAGE_BYTES
from shardwise.spec.hardware import load_cluster_file

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the probe's ranks share this machine's cores


def test_fit_recovers_known_alpha_beta_even_with_outliers():
    n = np.array(message_sizes(8, 1 << 22), dtype=float)
    t = 30e-6 + n / 2e9
    alpha, beta = fit_alpha_beta(n, t)
    assert alpha == pytest.approx(30e-6, rel=1e-6) and beta == pytest.approx(2e9, rel=1e-6)
    noisy = t * (1 + 0.03 * np.random.default_rng(1).standard_normal(t.size))
    noisy[[1, 6]] *= (15.0, 8.0)  # a busy host stalls two small messages
    alpha, beta = fit_alpha_beta(n, noisy)
    assert alpha == pytest.approx(30e-6, rel=0.1) and beta == pytest.approx(2e9, rel=0.1)
    ring = 2 * 3 * 40e-6 + 2 * 3 / 4 * n / 1e9  # ring all-reduce over 4 ranks
    assert ring_alpha_beta(n, ring, 4) == pytest.approx((40e-6, 1e9), rel=1e-6)


def test_fit_rejects_flat_times():
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match="do not grow"):
        fit_alpha_beta([8, 16, 32], [3e-3, 2e-3, 1e-3])


def test_nccl_tests_figures():
    assert message_sizes(8, 64) == [8, 16, 32, 64]
    assert bus_bandwidth(1.0, 4) == pytest.approx(1.5) and bus_bandwidth(1.0, 2) == pytest.approx(1.0)


@pytest.mark.parametrize("n_bytes", [8, 14336, 1 << 20, 64 << 20])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_auto_picks_what_best_allreduce_says(n_bytes, ranks):
    alpha, beta = 50e-6, 1e9
    choice = choose_allreduce(n_bytes, ranks, alpha, beta)
    best = best_allreduce(n_bytes, ranks, alpha, beta)[0]
    assert best in RUNNABLE_FLAT and choice.name == best
    assert choice.seconds == pytest.approx(best_allreduce(n_bytes, ranks, alpha, beta)[1])


def test_probe_writes_a_cluster_file_that_plan_reads(probe_run, tmp_path):
    done, out, doc_path = probe_run
    assert done.returncode == 0, done.stderr
    assert "all-reduce ring" in done.stdout and "busbw" in done.stdout
    doc = json.loads(doc_path.read_text())
    rows = doc["collectives"]["ring"]
    assert [r["bytes"] for r in rows] == message_sizes(8, 1 << 24)
    for r in rows:
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(p-1)/p = 1 at p = 2
    loopback = doc["links"][0]
    # a message between two processes takes time: the fit (α clipped at 0) found a latency, and
    # one that is part of, not more than, the slowest message's time
    assert loopback["name"] == "loopback"
    assert 0 < loopback["alpha_s"] < max(pt["time_s"] for pt in loopback["points"]), loopback
    assert doc["memory_bandwidth_gbps"] > 0 and set(doc["tflops"]) == {"fp32", "bf16"}
    assert doc["op_overhead_s"] > 0 and doc["op_overhead_moe_s"] > 0
    # per-call overhead = the all-reduce's cost inside a decode step over its α-β time at the reference size
    fit = doc["ring_fit"]
    for name in ("ring", "rd"):
        wire = runtime_allreduce_s(name, REFERENCE_MESSAGE_BYTES, 2, fit["alpha_s"], fit["beta_gbps"] * 1e9, 2)
        assert doc["collective_in_decode_s"][name] > 0
        assert doc["collective_overhead_s"][name] == pytest.approx(max(0.0, doc["collective_in_decode_s"][name] - wire))
    cluster = load_cluster_file(out)
    assert cluster.boxes == 2 and cluster.measured is not None
    assert cluster.box.memory_bandwidth_gbps == pytest.approx(doc["memory_bandwidth_gbps"], rel=1e-3)
    assert cluster.link.latency_s == pytest.approx(doc["ring_fit"]["alpha_s"], rel=1e-3)
    assert cluster.link.bandwidth_gbps == pytest.approx(doc["ring_fit"]["beta_gbps"], rel=1e-3)
    plan = run_cli("plan", "--cluster", str(out), "--model", "llama-3.1-8b", "--tp", "2", "--runtime", "shardwise", "--json",
                   env=ONE_THREAD)
    assert plan.returncode == 0, plan.stderr
    figures = json.loads(plan.stdout)["cluster"]
    assert figures["memory_bandwidth_gbps"] == cluster.box.memory_bandwidth_gbps
    assert figures["link_latency_s"] == cluster.link.latency_s

    # --allreduce auto in `run` reads the same file and picks best_allreduce's algorithm
    from shardwise.runtime.checkpoint import make_checkpoint

    folder = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "ckpt", seed=1)
    run = run_cli("run", str(folder), "--tp", "2", "--allreduce", "auto", "--cluster", str(out),
                  "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json", env=ONE_THREAD)
    assert run.returncode == 0, run.stderr
    n_bytes = 64 * 4  # tiny hidden 64 x float32
    want = best_allreduce(n_bytes, 2, cluster.link.latency_s, cluster.link.beta_bytes_per_s)[0]
    assert json.loads(run.stdout)["allreduce"] == want
    assert f"all-reduce auto -> {want}" in run.stderr
    # and `serve` the same way, answering once its ranks run with it
    from serve_process import ServeProcess, http

    with ServeProcess(str(folder), "--tp", "2", "--allreduce", "auto", "--cluster", str(out), log_dir=tmp_path,
                      env=ONE_THREAD) as server:
        assert f"all-reduce auto -> {want}" in server.stderr()
        assert http(server.base_url + "/models")[0] == 200


def test_unreachable_master_under_torchrun_env_fails_within_timeout():
    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t0 = time.monotonic()
    done = run_cli("probe", "--timeout", "3", env={**ONE_THREAD, **env}, timeout=60)
    elapsed = time.monotonic() - t0
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and "within 3 s" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert elapsed < 3 + 15  # the limit plus interpreter start-up


def test_master_address_not_on_this_host_is_named():
    done = run_cli("probe", "--master-addr", "10.254.254.254", "--timeout", "3", env=ONE_THREAD, timeout=60)
    assert done.returncode == 2 and "10.254.254.254" in done.stderr


@pytest.mark.parametrize("flag, value", [("--host-batches", "0"), ("--iters", "0")])
def test_bad_counts_are_one_line_errors(flag, value):
    done = run_cli("probe", flag, value, env=ONE_THREAD, timeout=60)
    assert done.returncode == 2 and flag in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr

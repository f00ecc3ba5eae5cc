"""`shardwise plan` end to end: the seed's arithmetic, the seed's measurement, and every error path."""

import json
from pathlib import Path
import re
import subprocess
import sys

import pytest

from conftest import plan_json, run_cli

SEED_MEASURED_TOK_PER_S = 21.71  # data/measurements.csv row S1 (16 x DGX Spark, RoCE, TP16+EP16, 7 drafts, 4k ctx)
# The vllm profile (profiles.toml) is fitted on every row of data/measurements.csv that resolves to
# it, the seed's rows S1-S7 among them, so a plan compared with one of those rows is an in-sample
# check: it shows the planner reproduces what calibration fitted, not that it predicts an unseen
# cluster. The tests below say which they are; the out-of-sample one refits without the row.


@pytest.fixture(scope="module")
def seed() -> dict:
    return plan_json()


def test_json_has_the_documented_keys(seed):
    for section, key in [
        ("model", "total_params"), ("model", "active_params"), ("memory", "min_boxes_weights"), ("memory", "min_boxes"),
        ("decode", "bytes_per_token"), ("decode", "naive_ceiling_tok_per_s"), ("decode", "ceiling_tok_per_s"),
        ("decode", "tok_per_s"), ("decode", "bottleneck"), ("decode", "waterfall"), ("prefill", "tok_per_s"),
        ("power", "rated_watts"), ("power", "load_watts"), ("cost", "usd"),
    ]:
        assert key in seed[section], (section, key)
    assert all({"step", "tok_per_s"} <= set(step) for step in seed["decode"]["waterfall"])
    assert "input embedding excluded" in seed["model"]["active_convention"]


def test_default_plan_reproduces_the_seed_arithmetic(seed):
    assert seed["cluster"] == seed["cluster"] | {"boxes": 16, "box": "NVIDIA DGX Spark (GB10 Grace Blackwell)"}
    assert seed["memory"]["min_boxes_weights"] == 13  # ~1.56 TB over 128 GB
    assert 1.50e12 < seed["memory"]["total_weight_bytes"] < 1.60e12
    assert 56e9 < seed["decode"]["naive_bytes_per_token"] < 60e9  # ~58 GB per token
    first = seed["decode"]["waterfall"][0]
    assert first["step"] == "seed arithmetic" and 74 <= first["tok_per_s"] <= 76
    assert seed["decode"]["naive_ceiling_tok_per_s"] == first["tok_per_s"]
    assert seed["cost"]["usd"] == 16 * 6950 == 111_200
    assert seed["power"]["rated_watts"] == 16 * 240 == 3840
    assert seed["plan"]["tp"] == 16 and seed["plan"]["ep"] == 16


def test_waterfall_explains_the_gap_step_by_step(seed):
    steps = seed["decode"]["waterfall"]
    names = [s["step"] for s in steps]
    assert names[:2] == ["seed arithmetic", "per-group precision"]
    assert "expert imbalance" in names and "collective latency" in names
    # BF16 attention/shared weights make the real bytes per token far more than 104 B x 4.5 bit.
    assert seed["decode"]["bytes_per_token"] > 2 * seed["decode"]["naive_bytes_per_token"]
    assert seed["decode"]["tok_per_s"] == pytest.approx(steps[-1]["tok_per_s"])
    assert seed["decode"]["ceiling_tok_per_s"] < seed["decode"]["naive_ceiling_tok_per_s"]
    assert all(s["cause"] for s in steps)


def test_seed_case_in_sample_lands_within_30_percent_of_row_s1():
    """In-sample: row S1 is one of the rows the vllm profile was fitted on
    (test_seed_rows_are_in_the_vllm_fit), so this checks the fit carries through the CLI; the
    out-of-sample check is test_seed_case_out_of_sample_refit_without_s1."""
    doc = plan_json("--spec-tokens", "7", "--workload", "code-edit", "--context", "4096", "--runtime", "vllm")
    assert abs(doc["decode"]["tok_per_s"] - SEED_MEASURED_TOK_PER_S) / SEED_MEASURED_TOK_PER_S < 0.30
    assert doc["decode"]["waterfall"][-1]["step"] == "speculative decoding"
    assert doc["decode"]["speculative"]["tokens_per_step"] > 1


MEASUREMENTS_CSV = Path(__file__).resolve().parents[1] / "data" / "measurements.csv"


def _seed_row(row_id: str) -> float:
    """Measured decode tok/s of one of the seed's rows in data/measurements.csv."""
    from shardwise.perf.measurements import read_measurements

    return next(m.decode_tok_s for m in read_measurements(MEASUREMENTS_CSV) if m.id == row_id)


def _resolved_rows(profile: str) -> list:
    """The rows of data/measurements.csv that shardwise.perf.calibrate fits ``profile`` on: every
    batch-1 row that resolves to that profile (profiles.toml stores their number as ``fitted_rows``)."""
    from shardwise.perf.measurements import read_measurements, resolve

    rows = [resolve(m) for m in read_measurements(MEASUREMENTS_CSV)]
    return [r for r in rows if not isinstance(r, str) and r.profile == profile and r.batch == 1]


def test_seed_rows_are_in_the_vllm_fit():
    """The seed-case tests that compare with rows S1, S4 and S5 are in-sample: the vllm profile's
    stored fit covers exactly the rows that resolve to it, and those include every seed row."""
    import tomllib
    from importlib import resources

    stored = tomllib.loads(resources.files("shardwise.spec.catalog").joinpath("profiles.toml").read_text())
    fitted = {r.measurement.id for r in _resolved_rows("vllm")}
    assert stored["vllm"]["fitted_rows"] == len(fitted), fitted
    assert {f"S{i}" for i in range(1, 8)} <= fitted
    assert _seed_row("S1") == SEED_MEASURED_TOK_PER_S


def test_seed_case_out_of_sample_refit_without_s1():
    """Out-of-sample: the vllm profile refitted (shardwise.perf.calibrate.fit_profile) on its rows
    less S1 predicts S1's decode speed (21.7 tok/s, 7 drafts at 4k) from below, within 40%: 38%
    today (in-sample 17%). It was within 30% while the planner split K3's latent projections over
    the ranks; held whole on every rank as vLLM's kimi_k3 model holds them, each rank reads 9.5 GB
    more per token, which the 16 x 273 GB/s of the seed's cluster pay on every step (see the #16
    note)."""
    from shardwise.perf.calibrate import fit_profile
    from shardwise.perf.estimate import decode_speed
    from shardwise.perf.profiles import get_profile
    from shardwise.perf.validate import scenario_of

    rows = _resolved_rows("vllm")
    s1 = next(r for r in rows if r.measurement.id == "S1")
    held_out = fit_profile(get_profile("vllm"), [r for r in rows if r is not s1])
    predicted = decode_speed(scenario_of(s1, held_out))[0]
    assert 0.60 * SEED_MEASURED_TOK_PER_S < predicted < SEED_MEASURED_TOK_PER_S, predicted


def test_tcp_drop_in_sample_rows_s4_s5():
    """In-sample: the seed measured 8.9 tok/s over RDMA and 1.3 over TCP (rows S4, S5, both plain
    decoding: a 6.8x drop), and both rows are among those the vllm profile was fitted on
    (test_seed_rows_are_in_the_vllm_fit); only the profile's TCP per-message overhead is not fitted
    (an estimate from data/links.csv). Plain decoding over 10 GbE TCP drops at least half as far
    (4.0x today: with vLLM's one all-reduce per layer the 16 x 273 GB/s, not the RoCE link, bound
    the RoCE step), TCP is bound by network latency (with speculation too), and the plain TCP
    estimate sits within a factor of two of S5's 1.3."""
    seed_drop = _seed_row("S4") / _seed_row("S5")
    roce = plan_json()["decode"]
    plain_tcp = plan_json("--link", "10gbe-tcp")["decode"]
    assert roce["tok_per_s"] / plain_tcp["tok_per_s"] > 0.5 * seed_drop
    assert plain_tcp["bottleneck"] == "network latency"
    assert 0.5 < plain_tcp["tok_per_s"] / _seed_row("S5") < 2.0
    tcp = plan_json("--spec-tokens", "7", "--workload", "code-edit", "--link", "10gbe-tcp")["decode"]
    assert tcp["bottleneck"] == "network latency"
    step = next(s for s in tcp["waterfall"] if s["step"] == "collective latency")
    assert "per message for vllm's socket path on TCP" in step["cause"]


def test_tcp_message_cost_rides_only_on_tcp_links():
    from shardwise.perf.profiles import get_profile, message_latency_s
    from shardwise.spec.hardware import get_link

    vllm, cpu = get_profile("vllm"), get_profile("shardwise")
    roce, tcp = get_link("100g-roce"), get_link("10gbe-tcp")
    assert message_latency_s(roce, vllm) == roce.latency_s
    assert message_latency_s(tcp, vllm) == tcp.latency_s + vllm.tcp_message_overhead_s > tcp.latency_s
    assert vllm.source_tcp_message_overhead_s
    assert message_latency_s(tcp, cpu) == tcp.latency_s  # probe-measured gloo: α already end to end


def test_more_context_reads_more_kv():
    short = plan_json("--model", "llama-3.1-70b", "--boxes", "4", "--context", "1024")["decode"]
    long = plan_json("--model", "llama-3.1-70b", "--boxes", "4", "--context", "100000")["decode"]
    assert long["busiest_rank_bytes_per_token"] > short["busiest_rank_bytes_per_token"]
    assert long["tok_per_s"] < short["tok_per_s"]


def test_quant_override_changes_bytes():
    bf16 = plan_json("--model", "qwen3-30b-a3b", "--boxes", "1", "--box", "h100-sxm")["decode"]["bytes_per_token"]
    q4 = plan_json("--model", "qwen3-30b-a3b", "--boxes", "1", "--box", "h100-sxm", "--quant", "q4_0")["decode"]
    assert q4["bytes_per_token"] < 0.4 * bf16


def test_human_output_renders_tables():
    proc = run_cli("plan", "--model", "gpt-oss-120b", "--box", "dgx-spark", "--boxes", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Decode waterfall" in proc.stdout and "bottleneck" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "kimi-k4"], "unknown model 'kimi-k4': did you mean"),
        (["--box", "dgx-sparc"], "unknown box 'dgx-sparc': did you mean"),
        (["--link", "100g-rocee"], "unknown link '100g-rocee'"),
        (["--runtime", "vllmm"], "unknown runtime profile 'vllmm'"),
        (["--quant", "mxfp5"], "unknown quantization format 'mxfp5'"),
        (["--tp", "5"], "--tp 5 does not divide"),
        (["--ep", "3"], "--ep 3"),
        (["--spec-tokens", "-1"], "--spec-tokens must be >= 0"),
        (["--spec-tokens", "3", "--acceptance", "1.5"], "--acceptance must be in (0, 1)"),
        (["--kv-dtype", "int3"], "--kv-dtype 'int3' is unknown"),
        (["--boxes", "4"], "does not fit on 4 x"),
        (["--model", "/nonexistent/config.json"], "does not exist"),
        (["--tp", "8", "--pp", "1"], "--boxes is 16"),
        (["--draft-model", "llama-3.1-8b"], "--draft-model needs --spec-tokens k"),
        (["--spec-tokens", "4", "--draft-model", "llama-3.1-8b"], "must share the target's vocabulary"),
        (["--spec-tokens", "4", "--draft-model", "llama-3.1-8c"], "unknown model 'llama-3.1-8c': did you mean"),
    ],
)
def test_errors_are_one_line_without_traceback(args, message):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_not_fitting_says_how_many_boxes_would():
    proc = run_cli("plan", "--boxes", "4")
    # 15: TP3 x PP5 (its 96 heads divide by 3 now that the latent projections are not split)
    assert proc.returncode == 2 and "it needs 15 boxes" in proc.stderr, proc.stderr
    # the shortfall is a positive amount: weights + cache + workspace + reserve less 128 GB
    from shardwise.perf.estimate import estimate
    from shardwise.perf.scenario import build_scenario

    short = float(re.search(r"\(([-\d.,]+) GB short", proc.stderr).group(1).replace(",", ""))
    sc = build_scenario("kimi-k3", "dgx-spark", 4, "100g-roce", None, None, None, 4096, 2048, 0, None, None, "vllm",
                        None, None, None, None, "bf16")
    assert short > 0 and short == pytest.approx(-estimate(sc)["memory"]["free_bytes"] / 1e9, abs=0.05)
    # and 15 is the fewest that hold it, as TP3 x PP5; 14 hold its bytes but no valid layout fits
    fifteen = plan_json("--boxes", "15")
    assert fifteen["memory"]["fits"] and (fifteen["plan"]["tp"], fifteen["plan"]["pp"]) == (3, 5)
    fourteen = run_cli("plan", "--boxes", "14")
    assert fourteen.returncode == 2 and "does not fit" in fourteen.stderr, fourteen.stderr


DRAFTED = ["--model", "llama-3.1-405b", "--boxes", "16", "--spec-tokens", "4", "--workload", "code-edit"]


def test_draft_model_costs_its_own_decode_steps_and_memory_on_every_box():
    """A draft model's cost is the same model planned alone on one box: its step time k times
    per verify step, and its weights + cache on every box."""
    free = plan_json(*DRAFTED)
    drafted = plan_json(*DRAFTED, "--draft-model", "llama-3.1-8b")
    alone = plan_json("--model", "llama-3.1-8b", "--boxes", "1")
    spec = drafted["decode"]["speculative"]
    assert spec["draft_model"] == "llama-3.1-8b" and free["decode"]["speculative"]["draft_model"] is None
    assert spec["draft_step_s"] == pytest.approx(alone["decode"]["step_s"])
    assert drafted["decode"]["tok_per_s"] == pytest.approx(
        spec["tokens_per_step"] / (spec["verify_step_s"] + 4 * alone["decode"]["step_s"]))
    assert free["decode"]["tok_per_s"] == pytest.approx(spec["tokens_per_step"] / spec["verify_step_s"])
    assert drafted["decode"]["waterfall"][-1]["step"] == "draft model"
    assert drafted["decode"]["tok_per_s"] == pytest.approx(drafted["decode"]["waterfall"][-1]["tok_per_s"])
    held = alone["memory"]["total_weight_bytes"] + alone["memory"]["kv_bytes"]
    assert drafted["memory"]["draft_bytes"] == pytest.approx(held)
    assert free["memory"]["draft_bytes"] == 0
    assert free["memory"]["free_bytes"] - drafted["memory"]["free_bytes"] == pytest.approx(held)


def test_draft_model_memory_can_need_another_box():
    base = ["--model", "llama-3.1-405b", "--boxes", "8", "--spec-tokens", "4"]
    assert plan_json(*base)["memory"]["fits"]
    proc = run_cli("plan", *base, "--draft-model", "llama-3.1-8b")
    assert proc.returncode == 2 and "does not fit on 8 x" in proc.stderr and "it needs 9 boxes" in proc.stderr


def test_malformed_and_unsupported_configs(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    proc = run_cli("plan", "--model", str(bad))
    assert proc.returncode == 2 and "missing required field" in proc.stderr
    bad.write_text('{"model_type": "rwkv", "hidden_size": 64}')
    proc = run_cli("plan", "--model", str(bad))
    assert proc.returncode == 2 and "unsupported model_type 'rwkv'" in proc.stderr


def test_planning_path_does_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "sys.argv = ['shardwise', 'plan', '--json']\n"
        "from shardwise.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main()\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_catalog_lists_everything():
    proc = run_cli("catalog", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"kimi-k3", "deepseek-v3", "gpt-oss-120b"} <= {m["key"] for m in doc["models"]}
    assert "dgx-spark" in {b["key"] for b in doc["boxes"]}
    assert "100g-roce" in {lk["key"] for lk in doc["links"]}
    assert {f["name"]: f["bits_per_weight"] for f in doc["formats"]}["mxfp4"] == 4.25
    assert {"ideal", "vllm", "llama-cpp", "mlx"} <= {p["name"] for p in doc["profiles"]}


def test_plan_on_a_cable_graph_prints_the_best_host_order():
    topo = str(Path(__file__).parent / "data" / "two_switch_8.toml")
    doc = plan_json("--model", "qwen3-235b-a22b", "--cluster", topo, "--runtime", "shardwise")
    ring = doc["plan"]["ring"]
    assert ring["listed_order"] == ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]
    best = ring["best_order"]
    crossings = sum(best[i][0] != best[(i + 1) % 8][0] for i in range(8))
    assert crossings == 2  # the slow uplink once each way
    assert ring["best_s"] < ring["listed_s"] <= ring["worst_s"]
    assert sorted(ring["rank_order"]) == list(range(8))
    assert doc["cluster"]["boxes"] == 8

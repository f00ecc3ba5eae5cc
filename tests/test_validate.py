"""The model against published measurements, and the calibration that fits the runtime profiles."""

import csv
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import cli_json
from shardwise.errors import ShardwiseError
from shardwise.perf.calibrate import DEFAULT_CSV, calibrate
from shardwise.perf.measurements import parse_number, read_measurements, resolve
from shardwise.perf.profiles import load_profiles
from shardwise.perf.validate import validate_file

REPO = Path(__file__).resolve().parents[1]


def test_default_csv_is_the_repo_copy_with_sources():
    assert DEFAULT_CSV == REPO / "data" / "measurements.csv"
    rows = list(csv.DictReader(DEFAULT_CSV.open()))
    assert rows and all(r["source"].strip() for r in rows)


def test_parse_number_handles_published_forms():
    assert parse_number("~70") == 70
    assert parse_number("5-9") == 7
    assert parse_number("1,155.40") == 1155.4
    assert parse_number("not stated") is None


@pytest.fixture(scope="module")
def report() -> dict:
    return validate_file(DEFAULT_CSV)


def test_calibrated_model_beats_the_pure_roofline(report):
    assert report["resolved"] >= 30
    assert report["median_ape"] < report["baseline_median_ape"]
    ids = {r["id"] for r in report["rows"]}
    assert {"S1", "S4", "S5"} <= ids


def test_unresolvable_rows_are_listed_with_a_reason_not_guessed(report):
    reasons = {u["id"]: u["reason"] for u in report["unresolved"]}
    assert "87" not in reasons  # Llama 3.2 3B Instruct: bundled since session 12
    assert "38" not in reasons  # Gemma-3-4B-it (QAT): bundled since session 13
    assert "121" not in reasons  # "MLX mixed 3.6-bit": its card's stated 3.578 bits per weight, a format since session 24
    mixed = replace(next(m for m in read_measurements(DEFAULT_CSV) if m.id == "121"), quant_format="MLX mixed 2.9-bit")
    assert "quantization 'MLX mixed 2.9-bit' is not a known format" == resolve(mixed)  # another mix is not guessed
    assert "2" not in reasons  # LLaMA-2 7B on an M1 Pro: bundled config and box since session 7
    assert "39" not in reasons  # batch 32, aggregate: resolved now (see the batched test)
    assert all(u["reason"] for u in report["unresolved"])
    # a batch > 1 row that does not say aggregate or per stream is not guessed
    row = next(m for m in read_measurements(DEFAULT_CSV) if m.id == "39")
    silent = replace(row, batch_size="32", metric_notes="llama-batched-bench B=32")
    assert "does not say whether decode tok/s is the aggregate or per stream" in resolve(silent)


def test_resolution_of_the_seed_rows():
    rows = {m.id: m for m in read_measurements(DEFAULT_CSV)}
    s1 = resolve(rows["S1"])
    assert s1.model.name == "kimi-k3" and s1.box_key == "dgx-spark" and s1.link_key == "100g-roce"
    assert (s1.plan.tp, s1.plan.ep) == (16, 16) and s1.spec_tokens == 7
    assert resolve(rows["S5"]).link_key == "10gbe-tcp"


def test_stored_profiles_equal_a_fresh_fit():
    fitted = calibrate(DEFAULT_CSV)
    stored = load_profiles()
    for name in ("vllm", "llama-cpp", "mlx"):
        for field in ("mem_efficiency", "compute_efficiency", "step_overhead_s", "collective_overhead_s"):
            assert getattr(fitted[name], field) == pytest.approx(getattr(stored[name], field)), (name, field)


def test_missing_column_is_named(tmp_path):
    bad = tmp_path / "m.csv"
    bad.write_text("id,model\n1,x\n")
    with pytest.raises(ShardwiseError, match="lacks column"):
        read_measurements(bad)


def test_validate_cli_json():
    doc = cli_json("validate", str(DEFAULT_CSV))
    assert {"median_ape", "baseline_median_ape", "resolved", "unresolved", "rows"} <= set(doc)
    row = doc["rows"][0]
    assert {"measured_tok_per_s", "predicted_tok_per_s", "ape", "roofline_ape"} <= set(row)


def test_batched_rows_are_resolved_and_reported_apart():
    """Rows measured at batch > 1 are predicted at their batch (x batch when the row is an
    aggregate over streams) and summarised apart from the batch-1 rows."""
    from shardwise.perf.estimate import decode_speed
    from shardwise.perf.measurements import read_measurements, resolve
    from shardwise.perf.profiles import get_profile
    from shardwise.perf.validate import scenario_of, validate_file

    doc = validate_file(DEFAULT_CSV)
    batched = [r for r in doc["rows"] if r["batch"] > 1]
    assert doc["batched"]["resolved"] == len(batched) >= 2
    assert doc["resolved"] == sum(1 for r in doc["rows"] if r["batch"] == 1)
    assert all(r["aggregate"] for r in batched)  # every published batched row gives the aggregate
    assert {r["batch"] for r in batched} >= {2, 4, 8, 16, 32}
    by_id = {m.id: m for m in read_measurements(DEFAULT_CSV)}
    for row in batched:
        resolved = resolve(by_id[row["id"]])
        assert resolved.batch == row["batch"] == int(by_id[row["id"]].batch_size.split()[0])
        per_sequence = decode_speed(scenario_of(resolved, get_profile(resolved.profile)))[0]
        assert row["predicted_tok_per_s"] == pytest.approx(row["batch"] * per_sequence)
        assert per_sequence < decode_speed(scenario_of(replace(resolved, batch=1), get_profile(resolved.profile)))[0]


def test_cross_validation_never_fits_on_the_row_it_predicts(tmp_path):
    """`validate --cv`: each batch-1 row is predicted by profiles fitted on the other sources only. So
    making one fitted row's measurement wildly wrong moves the in-sample fit (and the other rows'
    held-out predictions of that profile) but not that row's own held-out prediction."""
    doc = validate_file(DEFAULT_CSV, cv=True)
    cv = doc["cv"]
    assert cv["rows"] == doc["resolved"] and cv["no_other_source"] == 0
    scored = [r for r in doc["rows"] if r["batch"] == 1]
    assert cv["median_ape"] == statistics.median(r["cv_ape"] for r in scored)
    assert cv["median_ape"] > doc["median_ape"]  # out of sample cannot beat the fit on its own rows here
    victim = next(r for r in scored if r["id"] == "S1")  # a vllm row: that profile is fitted on several sources
    with DEFAULT_CSV.open(newline="") as f:
        table = list(csv.reader(f))
    column = table[0].index("decode_tok_s")
    vllm = {r["id"] for r in doc["rows"] if r["profile"] == "vllm"}  # the victim's profile's rows suffice
    table = table[:1] + [row for row in table[1:] if row and row[0] in vllm]
    for row in table[1:]:
        if row[0] == victim["id"]:
            row[column] = str(victim["measured_tok_per_s"] * 20)
    changed = tmp_path / "changed.csv"
    with changed.open("w", newline="") as f:
        csv.writer(f).writerows(table)
    again = validate_file(changed, cv=True)
    by_id = {r["id"]: r for r in again["rows"]}
    assert by_id[victim["id"]]["measured_tok_per_s"] == victim["measured_tok_per_s"] * 20
    assert by_id[victim["id"]]["cv_predicted_tok_per_s"] == victim["cv_predicted_tok_per_s"]
    others = [r for r in scored if r["profile"] == "vllm" and r["id"] != victim["id"]]
    assert any(by_id[r["id"]]["cv_predicted_tok_per_s"] != r["cv_predicted_tok_per_s"] for r in others)


def test_layer_overhead_scales_with_the_layer_count_not_the_bytes():
    """The per-layer launch term: a step pays ``layer_overhead_s`` once per decoder layer on top of
    ``step_overhead_s``, whatever the layer's bytes; so a 32-layer model pays 32 of it and an
    80-layer one 80, and removing the term removes exactly that time from the step."""
    from shardwise.perf.estimate import decode_speed
    from shardwise.perf.profiles import get_profile
    from shardwise.perf.validate import scenario_of

    by_id = {m.id: resolve(m) for m in read_measurements(DEFAULT_CSV)}
    base = get_profile("llama-cpp")
    assert base.layer_overhead_s > 0  # the fit finds one: per-step time that scales with layers
    for row_id in ("24", "142"):  # llama-2-7b (32 layers) and llama-2-70b (80 layers) on an A100
        row = by_id[row_id]
        with_term = decode_speed(scenario_of(row, replace(base, step_overhead_s=0.002, layer_overhead_s=1e-4)))[1]
        without = decode_speed(scenario_of(row, replace(base, step_overhead_s=0.002, layer_overhead_s=0.0)))[1]
        layers = row.model.num_layers
        assert layers == {"24": 32, "142": 80}[row_id]
        assert with_term.overhead_s == pytest.approx(0.002 + layers * 1e-4)
        assert with_term.total_s - without.total_s == pytest.approx(layers * 1e-4)
        assert with_term.layers_s == without.layers_s and with_term.bytes_busiest == without.bytes_busiest

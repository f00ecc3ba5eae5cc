"""One error path for the whole CLI: usage errors are one `error:` line with exit 2, no traceback
(issue #18's first reproduction; Ctrl-C exiting 130 with one line is tests/test_runtime_failures.py's); and on the planning side
bad flags, configs, cluster files, measurement CSVs and report inputs refused where they are read
(classes 3, 5 and 7). The fuzzing of the same edges is tests/test_fuzz_cli.py."""

import csv
import json
import time
from pathlib import Path

import pytest

from conftest import cli_in_process, run_cli

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "src" / "shardwise" / "spec" / "catalog" / "models"


@pytest.mark.parametrize("args,needle", [
    (("plan", "--boxes", "abc"), "'--boxes': 'abc' is not a valid int"),
    (("plan", "--context", "nan"), "'--context'"),
    (("run", "--frobnicate"), "No such option: --frobnicate"),
    (("make-checkpoint", "--out", "x"), "Missing option '--model'"),
    (("frob",), "No such command 'frob'"),
])
def test_usage_errors_are_one_line(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "--help" in lines[0]


def test_no_arguments_prints_help():
    proc = run_cli()
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "COMMAND" in proc.stdout and not proc.stderr.strip()


def test_context_beyond_the_models_positions_is_refused_at_once():
    """--context past max_position_embeddings is one line naming the limit (it used to run the
    box search for more than a minute); a context that fits no layout says how far it searched."""
    proc = run_cli("plan", "--context", "1000000000", timeout=30)
    assert proc.returncode == 2 and "exceeds kimi-k3's 1,048,576 positions" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    far = run_cli("plan", "--model", "deepseek-v3", "--boxes", "8", "--box", "rtx-4090", "--context", "163840",
                  "--link", "10gbe-tcp", timeout=60)
    assert far.returncode == 2 and "error:" in far.stderr and "Traceback" not in far.stderr


# ---- issue #18 on the planning side: bad input refused at the edge, in one line ------------------


def one_line_error(*args: str) -> str:
    """``shardwise ARGS`` (in this process) must exit 2 with one stderr line; that line."""
    code, _, err = cli_in_process(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    # silent accepts: each printed a plan ($-16 for the boxes, $nan, the acceptance ignored ...)
    (("--price", "-1"), "--price must be >= 0"),
    (("--price", "nan"), "--price must be >= 0"),
    (("--price", "inf"), "(a finite number), got inf"),
    (("--acceptance", "0.7"), "--acceptance has no effect without --spec-tokens"),
    (("--workload", "chat"), "--workload has no effect without --spec-tokens"),
    (("--spec-tokens", "3", "--acceptance", "0.7", "--workload", "chat"), "--acceptance and --workload both given"),
    (("--prompt-tokens", "0"), "--prompt-tokens must be >= 1, got 0"),  # printed 'prefill (0 tokens): 0 tok/s'
    (("--quant", "fp8", "--experts", "mxfp4", "--dense", "fp8"), "--quant fp8 has no effect with both --experts and --dense"),
    # large numbers: the fewest-boxes search went on for over 8 minutes and 24 GB
    (("--batch", "1000000"), "no layout of up to 4,096 boxes holds it"),
    # unbounded: 1e9 draft tokens planned as if fine; 2e8 boxes was refused with a --pp never passed
    (("--spec-tokens", "1000000000"), "--spec-tokens must be at most 64 draft tokens per step, got 1000000000"),
    (("--boxes", "200000000"), "--boxes must be a count in 1..4096, got 200000000"),
])
def test_plan_refuses(args, needle):
    start = time.monotonic()
    assert needle in one_line_error("plan", *args)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("args,needle", [
    (("--budget", "nan"), "--budget must be > 0"),  # was an internal TypeError
    (("--budget", "inf"), "--budget must be > 0 (a finite number), got inf"),
    (("--max-watts", "nan"), "--max-watts must be > 0"),
    (("--max-watts", "-1"), "--max-watts must be > 0"),
    (("--min-tok-per-s", "nan"), "--min-tok-per-s must be > 0"),
    (("--min-tok-per-s", "-3"), "--min-tok-per-s must be > 0"),
    (("--acceptance", "0.7"), "--acceptance has no effect without --spec-tokens"),
    (("--boxes", "1-100000000"), "--boxes 1-100000000 must be a count or a rising range within 1..4096"),  # 9 GB
    (("--boxes", "4,16-8"), "--boxes 16-8 (in '4,16-8')"),
    (("--max-boxes", "100000000"), "--max-boxes must be in 1..4096"),
    (("--limit", "-1"), "--limit must be >= 1"),  # showed every row but the last
    (("--explain", "dgx-spark:0"), "with N >= 1"),
    (("--spec-tokens", "1000000000"), "--spec-tokens must be at most 64 draft tokens per step"),
    # an unknown link (or box) answered "outside this sweep"
    (("--explain", "dgx-spark:4:unknown-link"), "--explain 'dgx-spark:4:unknown-link': unknown link 'unknown-link'"),
    (("--explain", "no-such-box:4"), "unknown box 'no-such-box'"),
])
def test_sweep_refuses(args, needle):
    start = time.monotonic()
    assert needle in one_line_error("sweep", "--model", "llama-3.1-8b", *args)
    assert time.monotonic() - start < 10


def _config(tmp_path: Path, **changes) -> Path:
    config = json.loads((MODELS / "qwen3-30b-a3b.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes,needle", [
    ({"num_attention_heads": 0}, "'num_attention_heads' must be a whole number in 1..4,096, got 0"),  # ZeroDivisionError
    ({"hidden_size": 0}, "'hidden_size' must be a whole number in 1..4,294,967,296, got 0"),  # planned an empty model
    ({"num_hidden_layers": -2}, "'num_hidden_layers' must be a whole number in 1..1,024"),
    ({"num_hidden_layers": 10**9}, "'num_hidden_layers' must be a whole number in 1..1,024"),  # built layers for minutes
    ({"vocab_size": 0}, "'vocab_size' must be a whole number in 1"),
    ({"num_key_value_heads": 5}, "'num_key_value_heads' (5) must divide num_attention_heads (32)"),
    ({"num_experts_per_tok": 1000}, "'num_experts_per_tok' must be a whole number in 1..64"),
    ({"num_experts_per_tok": 64, "num_experts": 32}, "'num_experts_per_tok' must be at most the 32 experts"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a whole number in 1"),  # ZeroDivisionError
    ({"hidden_size": 3, "head_dim": None}, "'hidden_size' (3) is below num_attention_heads (32)"),
    ({"max_position_embeddings": "big"}, "'max_position_embeddings' must be a whole number in 0"),  # TypeError
    ({"rms_norm_eps": "x"}, "'rms_norm_eps' must be a finite number"),  # ValueError
    ({"mlp_only_layers": 5}, "'mlp_only_layers' must be a list of ints"),  # TypeError
])
def test_impossible_config_values_name_the_file_and_field(tmp_path, changes, needle):
    path = _config(tmp_path, **changes)
    line = one_line_error("plan", "--model", str(path), "--boxes", "1")
    assert f"model config '{path}'" in line and needle in line, line


def test_corrupt_files_name_the_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_bytes(b'{"model_type": "\xff\xfe"}')
    assert "is not UTF-8 text (byte 16)" in one_line_error("plan", "--model", str(config))
    config.write_text("[" * 100_000)  # nested past Python's recursion limit
    assert f"model config '{config}' is not JSON shardwise can read" in one_line_error("plan", "--model", str(config))
    cluster = tmp_path / "cluster.toml"
    cluster.write_bytes(b'[cluster]\nbox = "dgx-spark\xff"\nlink = "100g-roce"\nboxes = 2\n')
    assert f"{cluster}: cluster file is not UTF-8 text (byte 26)" in one_line_error("plan", "--cluster", str(cluster))
    # an unknown name holding a control character is still one line (it is printed escaped)
    cluster.write_text('[cluster]\nbox = "\\u001e"\nlink = "100g-roce"\nboxes = 2\n')
    assert "unknown box '\\x1e'" in one_line_error("plan", "--cluster", str(cluster))


def test_cluster_file_box_count_is_bounded_where_the_file_is_read(tmp_path):
    """boxes = 2e8 in a cluster file was refused with a message about --pp, a flag never passed."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[cluster]\nbox = "dgx-spark"\nlink = "100g-roce"\nboxes = 200000000\n')
    line = one_line_error("plan", "--cluster", str(cluster))
    assert f"{cluster}: [cluster] boxes must be a whole number in 1..4096, got 200000000" in line and "--pp" not in line


def _measurements(tmp_path: Path, decode_tok_s: str | None, rows: int = 1) -> Path:
    header, *body = csv.reader((REPO / "data" / "measurements.csv").open(encoding="utf-8"))
    body = [r for r in body if r[0] == "28"][:rows]
    if body and decode_tok_s is not None:
        body[0][header.index("decode_tok_s")] = decode_tok_s
    path = tmp_path / "m.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *body])
    return path


@pytest.mark.parametrize("cell", ["-5", "0", "nan", "inf", "-1e3"])
def test_validate_refuses_impossible_measurements(tmp_path, cell):
    """-5 was read as 5 (an 1832 % error in the median), 0 divided by zero, nan was 'no decode tok/s'."""
    path = _measurements(tmp_path, cell)
    line = one_line_error("validate", str(path))
    assert f"measurements file '{path}' line 2, column decode_tok_s: '{cell}' must be a finite number > 0" in line


def test_validate_refuses_files_without_rows_or_text(tmp_path):
    path = _measurements(tmp_path, None, rows=0)
    assert "has a header but no rows" in one_line_error("validate", str(path))  # was exit 0 with an empty table
    path.write_bytes(b"id,model\xff\n1,2\n")
    assert "is not UTF-8 text (byte 8)" in one_line_error("validate", str(path))
    good = _measurements(tmp_path, None).read_text().splitlines()
    path.write_text(good[0] + "\n" + good[1][:40] + "\n")  # a row cut short
    assert "line 2: the row ends before column" in one_line_error("validate", str(path))


def test_report_refuses_a_plan_with_a_string_in_its_waterfall(tmp_path):
    code, out, err = cli_in_process("plan", "--model", "llama-3.1-8b", "--boxes", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    doc["decode"]["waterfall"][1] = "oops"  # a TypeError in the chart
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    line = one_line_error("report", str(path), "-o", str(tmp_path / "r.html"))
    assert f"{path}: plan document: decode.waterfall[1]: Expected `object`, got `str`" in line
    path.write_bytes(b"\xff\xfe{}")
    assert "is not UTF-8 text (byte 0)" in one_line_error("report", str(path), "-o", str(tmp_path / "r.html"))


def test_help_texts_survive_rich_markup():
    """`ring --help` printed 'Cluster TOML file with [], [], [].': rich ate [[hosts]] as a tag."""
    import typer.main
    from rich.text import Text

    from shardwise.cli import build_app

    group = typer.main.get_command(build_app())
    for name, command in group.commands.items():
        for text in [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]:
            assert "[]" not in Text.from_markup(text).plain, (name, text)
    code, out, _ = cli_in_process("ring", "--help")
    assert code == 0 and "[[hosts]]" in out and "[[links]]" in out


def test_bench_refuses_zero_repeats():
    """``bench --repeats 0`` would time no generation: refused in one line before anything runs."""
    start = time.monotonic()
    assert "--repeats must be >= 1 (measured generations), got 0" in one_line_error("bench", "--repeats", "0")
    assert time.monotonic() - start < 10

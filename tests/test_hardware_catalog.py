"""Issue #16 item 4, every common box: the catalog's boxes carry a source for every figure, every
hardware name in the published measurements resolves to a box, and ``--box-spec FILE`` plans any
box without editing the catalog (the same answer as the catalog entry it copies; one-line errors)."""

import csv
import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import tomli_w

from conftest import cli_in_process
from shardwise.errors import ShardwiseError
from shardwise.perf.calibrate import DEFAULT_CSV
from shardwise.perf.measurements import match_alias
from shardwise.spec.box_spec import BOX_SPEC_REQUIRED, load_box_spec
from shardwise.spec.hardware import Box, get_box, load_catalog

# Hardware texts in data/measurements.csv that resolve to no box, each with the reason (none today).
UNRESOLVED_HARDWARE: dict[str, str] = {}

# Boxes the issue names (chips of every family, GB10 under each brand, cloud and CPU servers).
NAMED_BOXES = [
    "mac-mini-m1-16", "macbook-pro-m1-pro-32", "mac-studio-m1-max-64", "mac-studio-m1-ultra-128",
    "mac-mini-m2-24", "mac-mini-m2-pro-32", "mac-studio-m2-max-96", "mac-studio-m2-ultra-192",
    "macbook-air-m3-24", "macbook-pro-m3-pro-36", "macbook-pro-m3-max-128", "mac-studio-m3-ultra-512",
    "mac-mini-m4-32", "mac-mini-m4-pro-64", "mac-studio-m4-max-128",
    "macbook-pro-m5-32", "macbook-pro-m5-pro-64", "macbook-pro-m5-max-128",
    "rtx-3060-12gb", "rtx-4060-ti-16gb", "rtx-3090", "rtx-4080", "rtx-4090", "rtx-5070-ti", "rtx-5080", "rtx-5090",
    "rtx-pro-6000", "a100-40gb", "a100-80gb", "h100-pcie", "h100-sxm", "h100-nvl", "h200-sxm", "b200", "gb200",
    "dgx-spark", "asus-ascent-gx10", "dell-pro-max-gb10", "lenovo-thinkstation-pgx", "hp-zgx-nano",
    "strix-halo-128", "mi300x", "raspberry-pi-4-8gb", "raspberry-pi-5-8gb", "jetson-agx-orin-64",
    "jetson-orin-nano-super-8", "aws-m7i-48xlarge", "x86-server-ddr5-8ch",
]  # fmt: skip


def catalog_table(key: str) -> dict:
    """The hardware.toml table of ``key``, as written (sources included)."""
    text = resources.files("shardwise.spec").joinpath("catalog", "hardware.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)[key]


def test_the_named_boxes_are_in_the_catalog():
    assert set(NAMED_BOXES) <= set(load_catalog().boxes)


@pytest.mark.parametrize("box", load_catalog().boxes.values(), ids=lambda b: b.key)
def test_every_box_gives_a_source_for_every_figure(box: Box):
    for figure in box.FIGURES:
        if getattr(box, figure) is not None:
            assert len(box.sources.get(figure, "")) > 10, f"{box.key}.{figure} has no source"
    for figure in box.estimates:
        source = box.sources[figure]
        assert "estimate" in source.lower() or "EST" in source, f"{box.key}.{figure} is an estimate without saying why"
    assert box.idle_watts < box.load_watts <= box.rated_watts, box.key
    if box.memory_options is not None:
        assert box.memory_gb in box.memory_options


def test_every_measured_hardware_name_resolves_to_a_box():
    with open(DEFAULT_CSV, newline="", encoding="utf-8") as f:
        names = sorted({row["hardware"] for row in csv.DictReader(f)})
    assert names
    unresolved = {}
    for name in names:
        alias = match_alias("boxes", name)
        try:
            if alias is None or get_box(alias["key"]).key != alias["key"]:
                unresolved[name] = None
        except ShardwiseError:  # an alias naming no box, nor a memory option of one
            unresolved[name] = alias["key"]
    assert set(unresolved) == set(UNRESOLVED_HARDWARE), unresolved


@pytest.mark.parametrize("text,key", [
    ("Apple M1 Pro (16-core GPU)", "macbook-pro-m1-pro-32"),
    ("Apple M2 Max (38-core GPU)", "mac-studio-m2-max-96"),
    ("Apple M3 Ultra (80-core GPU)", "mac-studio-m3-ultra-512"),
    ("Apple M4 (10-core GPU)", "mac-mini-m4-32"),
    ("Apple MacBook Pro M5 Max 128GB", "macbook-pro-m5-max-128"),
    ("NVIDIA H100 PCIe 80GB", "h100-pcie"),
    ("NVIDIA H100 NVL 94GB", "h100-nvl"),
    ("NVIDIA GB200 NVL72", "gb200"),
    ("NVIDIA B200 (DGX/HGX B200)", "b200"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
    ("Framework Desktop (Ryzen AI Max+ 395, 128GB)", "strix-halo-128"),
    ("GMKtec EVO-X2", "strix-halo-128"),
    ("Dell Pro Max with GB10", "dell-pro-max-gb10"),
    ("HP ZGX Nano G1n", "hp-zgx-nano"),
    ("NVIDIA DGX Spark (GB10, 128GB)", "dgx-spark"),
])  # fmt: skip
def test_hardware_aliases(text, key):
    alias = match_alias("boxes", text)
    assert alias is not None and alias["key"] == key
    assert key in load_catalog().boxes


# ---- --box-spec ---------------------------------------------------------------------------------


def plan_doc(*args: str) -> dict:
    code, out, err = cli_in_process("plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def same_plan(a: dict, b: dict) -> None:
    """Two plan documents agree on everything the box decides (names aside)."""
    for section in ("memory", "decode", "prefill", "power", "plan"):
        assert a[section] == b[section], section
    assert a["cost"]["usd"] == b["cost"]["usd"]
    for field in ("tflops_bf16", "memory_bandwidth_gbps", "boxes", "link_key"):
        assert a["cluster"][field] == b["cluster"][field]


@pytest.mark.parametrize("key,args", [
    ("dgx-spark", ()),
    ("mac-studio-m3-ultra-512", ("--model", "deepseek-v3", "--boxes", "2", "--link", "tb5-rdma", "--runtime", "mlx")),
    ("rtx-4090", ("--model", "llama-3.1-8b", "--boxes", "1")),
])  # fmt: skip
def test_box_spec_plans_as_the_catalog_entry_it_copies(tmp_path: Path, key: str, args: tuple[str, ...]):
    catalog = plan_doc("--box", key, *args)
    whole = tmp_path / "whole.toml"  # the catalog entry pasted as it is, [key] header and sources
    whole.write_text(tomli_w.dumps({key: catalog_table(key)}))
    flat = tmp_path / "flat.toml"  # the figures alone, at the top level
    flat.write_text(tomli_w.dumps({k: v for k, v in catalog_table(key).items()
                                   if not k.startswith("source_") and k != "estimates"}))
    from_whole, from_flat = plan_doc("--box-spec", str(whole), *args), plan_doc("--box-spec", str(flat), *args)
    same_plan(from_whole, catalog)
    same_plan(from_flat, catalog)
    assert from_whole["cluster"]["box_key"] == key and from_flat["cluster"]["box_key"] == "flat"
    assert load_box_spec(whole) == load_catalog().boxes[key]


def test_a_minimal_box_spec_fills_what_it_leaves_out_as_stated_estimates(tmp_path: Path):
    spec = tmp_path / "mybox.toml"
    spec.write_text("memory_gb = 128\nmemory_bandwidth_gbps = 273\ntflops_bf16 = 100\nload_watts = 150\n"
                    'list_price_usd = 4000\nsource_memory_bandwidth_gbps = "my STREAM run"\n')
    box = load_box_spec(spec)
    assert box.key == "mybox" and box.memory_bandwidth_gbps == 273
    assert box.sources["memory_bandwidth_gbps"] == "my STREAM run"
    assert box.sources["memory_gb"] == f"box spec {spec}"
    assert box.estimates == {"nic_gbit_s", "idle_watts", "rated_watts"}
    assert box.rated_watts == box.load_watts == 150
    doc = plan_doc("--box-spec", str(spec), "--model", "llama-3.1-70b", "--boxes", "2", "--link", "200g-roce")
    spark = plan_doc("--box", "dgx-spark", "--model", "llama-3.1-70b", "--boxes", "2", "--link", "200g-roce")
    assert doc["decode"] == spark["decode"]  # same bandwidth and compute as the Spark
    assert doc["cost"]["usd"] == 2 * 4000


def test_sweep_takes_a_box_spec(tmp_path: Path):
    spec = tmp_path / "spark.toml"
    spec.write_text(tomli_w.dumps({"dgx-spark": catalog_table("dgx-spark")}))
    args = ("sweep", "--model", "llama-3.1-8b", "--boxes", "1-2", "--json")
    code, out, err = cli_in_process(*args, "--box-spec", str(spec))
    assert code == 0, err
    rows = json.loads(out)
    code, out, err = cli_in_process(*args, "--box", "dgx-spark")
    assert code == 0, err
    assert rows == json.loads(out)
    spec.write_text(tomli_w.dumps({"other": catalog_table("rtx-4090")}))
    code, out, err = cli_in_process(*args, "--box-spec", str(spec), "--box", "dgx-spark")
    assert code == 0, err
    assert {r["box"] for r in json.loads(out)} <= {"dgx-spark", "other"}


def one_line_error(*args: str) -> str:
    """``shardwise ARGS`` must exit 2 with one stderr line; that line."""
    code, _, err = cli_in_process(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


GOOD = {"memory_gb": 128, "memory_bandwidth_gbps": 273, "tflops_bf16": 100, "load_watts": 150, "list_price_usd": 4000}


def _without(field: str) -> str:
    return tomli_w.dumps({k: v for k, v in GOOD.items() if k != field})


@pytest.mark.parametrize("text,needle", [
    (_without("memory_bandwidth_gbps"), "missing memory_bandwidth_gbps; add memory_bandwidth_gbps = <GB/s>"),
    (_without("list_price_usd"), "missing list_price_usd; add list_price_usd = <USD>"),
    (tomli_w.dumps({**GOOD, "memory_bandwidth_gbps": -5}), "memory_bandwidth_gbps must be a finite number > 0 (GB/s), got -5"),
    (tomli_w.dumps({**GOOD, "memory_bandwidth_gbps": 0}), "memory_bandwidth_gbps must be a finite number > 0 (GB/s), got 0"),
    (tomli_w.dumps(GOOD) + "tflops_fp8 = nan\n", "tflops_fp8 must be a finite number > 0"),
    (tomli_w.dumps({**GOOD, "memory_gb": "128"}), "memory_gb must be a number (GB), got '128'; write it unquoted"),
    (tomli_w.dumps({**GOOD, "load_watts": True}), "load_watts must be a number (W), got True"),
    (tomli_w.dumps({**GOOD, "memory_bandwith_gbps": 5}), "unknown key 'memory_bandwith_gbps'; did you mean 'memory_bandwidth_gbps'?"),
    (tomli_w.dumps({**GOOD, "colour": "red"}), "unknown key 'colour'"),
    (tomli_w.dumps({**GOOD, "memory_options": [64, 96]}), "memory_gb = 128 is not one of memory_options"),
    (tomli_w.dumps({**GOOD, "source_tflops_fp8": "vendor"}), "source_tflops_fp8 names tflops_fp8, which the spec does not set"),
    (tomli_w.dumps({**GOOD, "estimates": ["tflops_fp4"]}), "estimates lists 'tflops_fp4', which the spec does not set"),
    (tomli_w.dumps({"a": GOOD, "b": GOOD}), "[a] is a table; a box spec holds one box"),
    ("memory_gb = = 3\n", "not valid TOML"),
])  # fmt: skip
def test_bad_box_specs_are_one_line_errors_naming_the_field(tmp_path: Path, text: str, needle: str):
    spec = tmp_path / "box.toml"
    spec.write_text(text)
    line = one_line_error("plan", "--box-spec", str(spec))
    assert needle in line and str(spec) in line, line
    with pytest.raises(ShardwiseError, match="box.toml"):
        load_box_spec(spec)


def test_box_spec_file_and_flag_errors(tmp_path: Path):
    assert "cannot read box spec" in one_line_error("plan", "--box-spec", str(tmp_path / "missing.toml"))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "box spec is not UTF-8 text" in one_line_error("plan", "--box-spec", str(binary))
    spec = tmp_path / "box.toml"
    spec.write_text(tomli_w.dumps(GOOD))
    assert "--box-spec and --box both name the box" in one_line_error("plan", "--box-spec", str(spec), "--box", "dgx-spark")
    assert "--box-spec and --cluster both" in one_line_error("plan", "--box-spec", str(spec), "--cluster", str(spec))
    assert "cannot read box spec" in one_line_error("sweep", "--model", "llama-3.1-8b", "--box-spec", str(tmp_path / "no.toml"))


def test_required_fields_are_the_box_figures_without_defaults():
    assert set(BOX_SPEC_REQUIRED) <= set(Box.FIGURES)

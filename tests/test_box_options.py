"""Issue #16 item 4, every Apple memory option: ``--box mac-studio-m4-max-64`` plans the 64 GB
Mac Studio from the ``[mac-studio-m4-max-128]`` entry's ``memory_options`` (shardwise.spec.box_options),
with the option's own memory (GB), bandwidth (GB/s) and list price (USD), each sourced; a size Apple
does not sell is a one-line error naming the sizes it does."""

import json
from pathlib import Path

import pytest

from conftest import cli_in_process, plan_json
from shardwise.errors import ShardwiseError
from shardwise.perf.measurements import match_alias
from shardwise.spec.box_options import OPTION_FIGURES, option_box, option_index, option_keys, size_label
from shardwise.spec.hardware import Box, get_box, load_catalog, load_cluster_file

APPLE = [b for b in load_catalog().boxes.values() if b.name.startswith("Apple")]


# Hand-written from the sources in hardware.toml: key -> (GB, GB/s, list USD, name).
@pytest.mark.parametrize("key,gb,gbps,usd,name", [
    ("mac-studio-m4-max-36", 36, 410, 1999, "Apple Mac Studio M4 Max (14c CPU / 32c GPU), 36 GB"),
    ("mac-studio-m4-max-48", 48, 546, 2499, "Apple Mac Studio M4 Max (40c GPU), 48 GB"),
    ("mac-studio-m4-max-64", 64, 546, 2699, "Apple Mac Studio M4 Max (40c GPU), 64 GB"),
    ("macbook-pro-m3-max-36", 36, 300, 3499, "Apple MacBook Pro 16 M3 Max (14c CPU / 30c GPU), 36 GB"),
    ("macbook-pro-m3-max-96", 96, 300, 4299, "Apple MacBook Pro 16 M3 Max (14c CPU / 30c GPU), 96 GB"),
    ("macbook-pro-m3-max-64", 64, 400, 4199, "Apple MacBook Pro 16 M3 Max (16c CPU / 40c GPU), 64 GB"),
    ("macbook-pro-m5-max-36", 36, 460, 3599, "Apple MacBook Pro M5 Max (18c CPU / 32c GPU), 36 GB"),
    ("mac-studio-m3-ultra-96", 96, 819, 5499, "Apple Mac Studio M3 Ultra (32c CPU / 80c GPU), 96 GB"),
    ("mac-studio-m2-ultra-64", 64, 800, 4999, "Apple Mac Studio M2 Ultra (24c CPU / 76c GPU), 64 GB"),
    ("mac-mini-m4-16", 16, 120, 599, "Apple Mac mini M4 (10c CPU / 10c GPU), 16 GB"),
    ("mac-mini-m4-pro-24", 24, 273, 1599, "Apple Mac mini M4 Pro (20c GPU), 24 GB"),
    ("mac-mini-m2-8", 8, 100, 599, "Apple Mac mini M2 (8c CPU / 10c GPU), 8 GB"),
])  # fmt: skip
def test_an_option_key_gives_the_options_figures(key: str, gb: float, gbps: float, usd: float, name: str):
    box = get_box(key)
    assert (box.key, box.memory_gb, box.memory_bandwidth_gbps, box.list_price_usd, box.name) == (key, gb, gbps, usd, name)
    entry = load_catalog().box_options[key.rsplit("-", 1)[0]]
    assert box.sources["memory_gb"].startswith(f"{gb} GB option of [{entry.key}]")
    assert box.sources["list_price_usd"] == f"{gb} GB option: {entry.sources['option_list_price_usd']}"
    assert box.is_estimate("list_price_usd") == entry.is_estimate("option_list_price_usd")
    assert box.memory_options is None and all(getattr(box, f) is None for f in OPTION_FIGURES)


def test_an_option_without_its_own_bandwidth_keeps_the_entrys_and_its_source():
    box, entry = get_box("mac-studio-m4-max-64"), get_box("mac-studio-m4-max-128")
    assert box.memory_bandwidth_gbps == entry.memory_bandwidth_gbps
    assert box.sources["memory_bandwidth_gbps"] == entry.sources["memory_bandwidth_gbps"]
    assert box.tflops_bf16 == entry.tflops_bf16 and box.nic == entry.nic and box.load_watts == entry.load_watts


def test_binned_options_say_where_their_bandwidth_comes_from():
    box = get_box("mac-studio-m4-max-36")
    assert box.sources["memory_bandwidth_gbps"].startswith("36 GB option: Macworld")
    assert "410" in box.sources["memory_bandwidth_gbps"]
    assert box.is_estimate("tflops_bf16") and not box.is_estimate("memory_bandwidth_gbps")


@pytest.mark.parametrize("name,needle", [
    ("mac-studio-m4-max-256", "mac-studio-m4-max-256: this box comes with 36, 48, 64 or 128 GB"),
    ("mac-mini-m1-32", "mac-mini-m1-32: this box comes with 8 or 16 GB"),
    ("macbook-pro-m3-max-0128", "this box comes with 36, 48, 64, 96 or 128 GB"),
])  # fmt: skip
def test_a_size_that_is_not_an_option_is_a_one_line_error_naming_the_options(name: str, needle: str):
    with pytest.raises(ShardwiseError, match=needle):
        get_box(name)
    code, _, err = cli_in_process("plan", "--box", name, "--model", "llama-3.1-8b", "--boxes", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err


def test_an_unknown_prefix_suggests_option_keys():
    with pytest.raises(ShardwiseError, match="unknown box 'mac-studio-m4-max': did you mean .*mac-studio-m4-max-"):
        get_box("mac-studio-m4-max")


def test_a_plan_on_a_smaller_option_needs_more_boxes():
    args = ("--model", "llama-3.1-70b", "--quant", "q8_0", "--link", "tb5-rdma")
    big = plan_json("--box", "mac-studio-m4-max-128", "--boxes", "1", *args)
    assert big["cluster"]["box_key"] == "mac-studio-m4-max-128"
    for key, needed in (("mac-studio-m4-max-64", 2), ("mac-studio-m4-max-36", 3)):
        code, _, err = cli_in_process("plan", "--box", key, "--boxes", "1", *args, "--json")
        assert code == 2 and f"it needs {needed} boxes" in err, err
    small = plan_json("--box", "mac-studio-m4-max-36", "--boxes", "3", *args)
    assert small["cluster"]["box_key"] == "mac-studio-m4-max-36"
    assert small["cluster"]["memory_bandwidth_gbps"] == 410 and small["cluster"]["tflops_bf16"] == 13.7
    assert small["cost"]["price_per_box_usd"] == 1999 and small["cost"]["usd"] == 3 * 1999


def test_sweep_cluster_files_and_baselines_take_option_keys(tmp_path: Path):
    code, out, err = cli_in_process("sweep", "--model", "llama-3.1-8b", "--box", "mac-mini-m4-16,mac-mini-m4-32",
                                    "--boxes", "1", "--json")
    assert code == 0, err
    rows = {r["box"]: r for r in json.loads(out)}
    assert rows["mac-mini-m4-16"]["price_per_box_usd"] == 599 and rows["mac-mini-m4-32"]["price_per_box_usd"] == 999
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[cluster]\nbox = "mac-studio-m4-max-36"\nlink = "tb5-rdma"\nboxes = 2\n')
    spec = load_cluster_file(cluster)
    assert spec.box == get_box("mac-studio-m4-max-36")
    from shardwise.spec.hardware import cluster_to_toml

    assert cluster_to_toml(spec)["cluster"]["box"] == "mac-studio-m4-max-36"
    cluster.write_text('[cluster]\nbox = "mac-studio-m4-max-256"\nlink = "tb5-rdma"\nboxes = 2\n')
    with pytest.raises(ShardwiseError, match=r"\[cluster\] box: mac-studio-m4-max-256: this box comes with"):
        load_cluster_file(cluster)


@pytest.mark.parametrize("text,key", [
    ("Mac Studio M4 Max 64GB", "mac-studio-m4-max-64"),
    ("Apple M4 Max (36GB)", "mac-studio-m4-max-36"),
    ("M3 Max 36GB", "macbook-pro-m3-max-36"),
    ("Apple M3 Max (40-core GPU, 64GB)", "macbook-pro-m3-max-64"),
    ("MacBook Pro M4 Pro 48GB", "mac-mini-m4-pro-48"),
    ("Mac mini M4 24 GB", "mac-mini-m4-24"),
    ("Apple M1 Max (24-core GPU, 32GB)", "mac-studio-m1-max-32"),
    ("Apple Mac Studio M3 Ultra 96GB", "mac-studio-m3-ultra-96"),
    ("Apple Mac Studio M3 Ultra (80-core GPU, 512GB)", "mac-studio-m3-ultra-512"),
    ("Apple Mac Studio M3 Ultra (32-core CPU/80-core GPU); cluster = 2x512GB + 2x256GB", "mac-studio-m3-ultra-512"),
    ("Apple M4 Max (40-core GPU)", "mac-studio-m4-max-128"),
    ("Apple MacBook Pro M4 Max 128GB + M5 Max 128GB", "mac-studio-m4-max-128"),
])  # fmt: skip
def test_box_aliases_with_memory_pick_the_option(text: str, key: str):
    alias = match_alias("boxes", text)
    assert alias is not None and alias["key"] == key
    assert get_box(key).key == key


@pytest.mark.parametrize("entry", APPLE, ids=lambda b: b.key)
def test_every_apple_entry_lists_its_options_each_priced_and_sourced(entry: Box):
    if entry.memory_options is None:  # the 256 GB M3 Ultra: an option of the 512 GB entry (see below)
        assert entry.key in option_keys(load_catalog().box_options)
        return
    assert entry.memory_gb in entry.memory_options
    assert len(entry.memory_options) >= 2 and list(entry.memory_options) == sorted(entry.memory_options)
    for field in ("memory_options", *OPTION_FIGURES):
        if getattr(entry, field) is not None:
            assert len(entry.sources.get(field, "")) > 10, f"{entry.key}.{field} has no source"
    others = {size_label(gb) for gb in entry.memory_options} - {size_label(entry.memory_gb)}
    assert set(entry.option_list_price_usd or {}) == others
    for gb in entry.memory_options:
        box = get_box(f"{entry.key.rsplit('-', 1)[0]}-{size_label(gb)}")
        assert box.memory_gb == gb and box.name.endswith(f", {size_label(gb)} GB")
        for figure in Box.FIGURES:
            if getattr(box, figure) is not None:
                assert len(box.sources.get(figure, "")) > 10, f"{box.key}.{figure} has no source"
        assert box.idle_watts < box.load_watts <= box.rated_watts


def test_an_exact_entry_and_the_option_it_shadows_agree():
    """``mac-studio-m3-ultra-256`` is its own entry and an option of the 512 GB one: the same box."""
    catalog = load_catalog()
    exact = catalog.boxes["mac-studio-m3-ultra-256"]
    from shardwise.spec.box_options import with_option

    shadowed = with_option(catalog.boxes["mac-studio-m3-ultra-512"], 256, exact.key)
    for figure in ("memory_gb", "memory_bandwidth_gbps", "tflops_bf16", "list_price_usd", "name"):
        assert getattr(shadowed, figure) == getattr(exact, figure), figure
    assert get_box("mac-studio-m3-ultra-256") is exact


def test_two_entries_offering_the_same_prefix_are_refused():
    entry = load_catalog().boxes["mac-mini-m4-32"]
    import msgspec

    twin = msgspec.structs.replace(entry, key="mac-mini-m4-24", name="Apple Mac mini M4, 24 GB", memory_gb=24,
                                  option_list_price_usd={"16": 599, "32": 999})
    with pytest.raises(ShardwiseError, match=r"\[mac-mini-m4-32\] and \[mac-mini-m4-24\] both offer mac-mini-m4-<GB>"):
        option_index({entry.key: entry, twin.key: twin})
    assert option_box(option_index({entry.key: entry}), "mac-mini-m4-24").memory_gb == 24
    assert set(option_keys(option_index({entry.key: entry}))) == {"mac-mini-m4-16", "mac-mini-m4-24", "mac-mini-m4-32"}


def test_the_catalog_lists_the_options(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the tables to the terminal's width
    code, out, err = cli_in_process("catalog", "--json")
    assert code == 0, err
    boxes = {b["key"]: b for b in json.loads(out)["boxes"]}
    options = {o["key"]: o for o in boxes["mac-studio-m4-max-128"]["memory_options"]}
    assert list(options) == ["mac-studio-m4-max-36", "mac-studio-m4-max-48", "mac-studio-m4-max-64", "mac-studio-m4-max-128"]
    assert options["mac-studio-m4-max-36"]["memory_bandwidth_gbps"] == 410
    assert options["mac-studio-m4-max-36"]["list_price_usd"] == 1999
    assert boxes["dgx-spark"]["memory_options"] is None
    code, out, err = cli_in_process("catalog")
    assert code == 0, err
    assert "36/48/64/128" in out and "mac-studio-m4-max-36" in out and "Memory options" in out


def test_an_estimated_price_says_so_in_the_plan():
    """A box whose list price is an estimate (most memory options) is priced with a note saying so;
    a published price is plain "list price"."""
    estimated = plan_json("--model", "gpt-oss-20b", "--box", "mac-studio-m4-max-64", "--boxes", "1")["cost"]
    assert estimated["price_per_box_usd"] == get_box("mac-studio-m4-max-64").list_price_usd
    assert estimated["price_note"].startswith("list price, an estimate")
    published = plan_json("--model", "gpt-oss-20b", "--box", "rtx-4090", "--boxes", "1")["cost"]
    assert published["price_note"] == "list price (--price to change)"

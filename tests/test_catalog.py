"""Bundled catalog: every figure sourced, DGX Spark figures, names, cluster file round trip."""

import msgspec
import pytest

from shardwise.errors import ShardwiseError
from shardwise.spec.hardware import (
    ClusterSpec,
    Link,
    Measured,
    apply_measured,
    get_box,
    get_link,
    load_catalog,
    load_cluster_file,
    write_cluster_file,
)
from shardwise.spec.topology import Edge, Topology

REQUIRED_BOXES = [
    "dgx-spark", "mac-studio-m3-ultra-512", "mac-studio-m3-ultra-256", "mac-mini-m4-pro-64",
    "mac-studio-m4-max-128", "rtx-4090", "rtx-5090", "rtx-3090", "h100-sxm", "h200-sxm", "b200",
    "a100-80gb", "strix-halo-128", "raspberry-pi-5-8gb", "rtx-pro-6000",
]  # fmt: skip
REQUIRED_LINKS = [
    "1gbe-tcp", "10gbe-tcp", "25gbe-tcp", "25gbe-roce", "100g-roce", "200g-roce",
    "tb5-tcp", "tb5-rdma", "pcie4-x16", "pcie5-x16", "nvlink4", "nvlink5",
]  # fmt: skip


def entries():
    catalog = load_catalog()
    return [*catalog.boxes.values(), *catalog.links.values()]


def test_required_names_present():
    catalog = load_catalog()
    assert set(REQUIRED_BOXES) <= set(catalog.boxes)
    assert set(REQUIRED_LINKS) <= set(catalog.links)


@pytest.mark.parametrize("entry", entries(), ids=lambda e: e.key)
def test_every_figure_has_a_source_and_estimates_say_so(entry):
    for figure in entry.FIGURES:
        if getattr(entry, figure) is not None:
            assert len(entry.sources[figure]) > 10, figure
    for figure in entry.estimates:
        assert "estimate" in entry.sources[figure].lower() or "EST" in entry.sources[figure], figure
    for figure, source in entry.sources.items():
        if source.lower().startswith("estimate"):
            assert entry.is_estimate(figure), f"{entry.key}.{figure} reads like an estimate but is not flagged"


def test_box_figures_are_positive_never_silent_zero():
    for box in load_catalog().boxes.values():
        assert box.memory_gb > 0 and box.memory_bandwidth_gbps > 0 and box.tflops_bf16 > 0
        assert box.idle_watts < box.load_watts <= box.rated_watts, box.key


def test_dgx_spark_figures():
    spark = get_box("dgx-spark")
    assert (spark.memory_gb, spark.memory_bandwidth_gbps) == (128, 273)
    assert spark.memory_bytes == 128e9
    assert spark.nic_gbit_s == 200 and "ConnectX-7" in spark.nic
    assert spark.rated_watts == 240 and spark.load_watts == 150
    assert spark.list_price_usd == 4699 and spark.builder_price_usd == 6950
    assert "111,200" in spark.sources["builder_price_usd"]
    assert "144 W" in spark.sources["load_watts"]
    assert spark.is_estimate("tflops_bf16") and not spark.is_estimate("memory_bandwidth_gbps")


def test_links_and_aliases():
    roce = get_link("roce-100g")
    assert roce is get_link("100g-roce")
    assert roce.kind == "rdma" and roce.latency_s == pytest.approx(11e-6)
    assert roce.beta_bytes_per_s == pytest.approx(12.25e9)
    assert roce.switch_price_usd == 1295 and roce.switch_watts == 123
    assert get_link("tb5-tcp").latency_s == pytest.approx(300e-6)
    assert get_link("tb5-rdma").latency_s == pytest.approx(50e-6)


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ShardwiseError, match="unknown box 'dgx-sprak': did you mean dgx-spark"):
        get_box("dgx-sprak")
    with pytest.raises(ShardwiseError, match="unknown link 'roce-200g': did you mean .*200g-roce"):
        get_link("roce-200g")


def test_missing_source_is_rejected():
    spark = get_box("dgx-spark")
    sources = dict(spark.sources)
    del sources["memory_gb"]
    with pytest.raises(ValueError, match="memory_gb has no source_memory_gb"):
        msgspec.structs.replace(spark, sources=sources)


def spark_cluster(measured=None):
    hosts = ("spark-01", "spark-02", "spark-03")
    edges = tuple(Edge(h, "sw-a", 12.25, 1.1e-5) for h in hosts)
    topology = Topology(hosts=hosts, switches=("sw-a",), edges=edges)
    box, link = apply_measured(get_box("dgx-spark"), get_link("100g-roce"), measured)
    return ClusterSpec(box=box, boxes=3, link=link, topology=topology, measured=measured)


def test_cluster_file_round_trip(tmp_path):
    path = tmp_path / "cluster.toml"
    cluster = spark_cluster()
    write_cluster_file(cluster, path)
    assert load_cluster_file(path) == cluster


def test_measured_figures_round_trip_and_replace_catalog(tmp_path):
    measured = Measured(source="probe 2026-03-01", memory_bandwidth_gbps=221.5, link_latency_s=1.3e-5)
    cluster = spark_cluster(measured)
    assert cluster.box.memory_bandwidth_gbps == 221.5
    assert cluster.box.sources["memory_bandwidth_gbps"] == "measured: probe 2026-03-01"
    assert cluster.link.latency_s == 1.3e-5 and cluster.link.bandwidth_gbps == 12.25
    path = tmp_path / "cluster.toml"
    write_cluster_file(cluster, path)
    assert "[cluster.measured]" in path.read_text()
    assert load_cluster_file(path) == cluster


def test_cluster_file_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nbox = "dgx-spark"\nlink = "100g-roce"\nboxes = 4\n[[hosts]]\nname = "a"\n')
    with pytest.raises(ShardwiseError, match="boxes = 4 but 1 \\[\\[hosts\\]\\] are listed"):
        load_cluster_file(path)
    path.write_text('[cluster]\nbox = "dgx-spark"\nboxes = 2\n')
    with pytest.raises(ShardwiseError, match="needs link"):
        load_cluster_file(path)
    head = '[cluster]\nbox = "dgx-spark"\nlink = "100g-roce"\nboxes = 2\n[cluster.measured]\nsource = "probe"\n'
    path.write_text(head + "memory_bandwidth_gbps = -221\n")
    with pytest.raises(ShardwiseError, match=r"\[cluster.measured\] memory_bandwidth_gbps: Expected `float` > 0"):
        load_cluster_file(path)
    path.write_text(head + "link_latency = 1e-5\n")
    with pytest.raises(ShardwiseError, match=r"\[cluster.measured\] Object contains unknown field `link_latency`"):
        load_cluster_file(path)
    path.write_text('[cluster]\nbox = "spark"\nlink = "100g-roce"\nboxes = 2\n')
    with pytest.raises(ShardwiseError, match="box: unknown box 'spark': did you mean dgx-spark"):
        load_cluster_file(path)


def test_writer_refuses_silent_changes(tmp_path):
    cluster = spark_cluster()
    tampered = msgspec.structs.replace(cluster, box=msgspec.structs.replace(cluster.box, memory_gb=64))
    with pytest.raises(ShardwiseError, match="not the catalog box"):
        write_cluster_file(tampered, tmp_path / "x.toml")


def test_link_model_fields():
    assert set(Link.FIGURES) >= {"bandwidth_gbps", "latency_s", "switch_watts", "switch_price_usd"}

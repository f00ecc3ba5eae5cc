"""Boxes, links and clusters: the bundled catalog and user cluster files.

Units: ``*_gb`` gigabytes (1e9 bytes), ``*_gbps`` gigabytes per second (GB/s, one
direction), ``nic_gbit_s`` gigabits per second (the NIC's port speed as sold),
``tflops_*`` 1e12 dense operations per second, ``*_s`` seconds, ``*_watts`` watts,
``*_usd`` US dollars.

The catalog (``catalog/hardware.toml``, ``catalog/links.toml``) gives every figure a
``source_<field>`` string next to it, and lists in ``estimates`` the fields that are
estimates rather than published or measured numbers; both land in ``sources`` and
``estimates`` on the models.

A cluster file is TOML (see ``shardwise.spec.topology`` for ``[[hosts]]``, ``[[switches]]``
and ``[[links]]``)::

    [cluster]
    box = "dgx-spark"           # hardware catalog key
    link = "200g-roce"          # link catalog key or alias
    boxes = 16                  # optional when [[hosts]] are listed (then = their count)

    [cluster.measured]          # optional, written by `shardwise probe`
    memory_bandwidth_gbps = 221.0
    link_bandwidth_gbps = 19.6
    link_latency_s = 1.15e-5
    source = "shardwise probe 2026-03-01, spark-01..spark-16"

Measured figures replace the catalog's in ``ClusterSpec.box`` / ``ClusterSpec.link``
(their source then reads ``measured: ...``). Files are written with ``tomli_w``.

A box outside the catalog: ``shardwise.spec.box_spec``.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import tomli_w
from msgspec import Meta, Struct

from shardwise.errors import ShardwiseError, unknown_name, validation_message
from shardwise.spec.box_options import check_option_tables, option_box, option_index, option_keys
from shardwise.spec.topology import Topology, topology_from_toml, topology_to_toml

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
MAX_CLUSTER_BOXES = 4096  # a cluster file's boxes, bounded like --boxes (2e8 got as far as a --pp error)


class _Sourced(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A catalog entry whose figures each carry a source and maybe an estimate flag."""

    key: str
    name: str
    sources: dict[str, str]
    estimates: frozenset[str] = frozenset()

    FIGURES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        present = {f for f in self.FIGURES if getattr(self, f) is not None}
        missing = sorted(present - set(self.sources))
        if missing:
            raise ValueError(f"{missing[0]} has no source_{missing[0]}")
        orphan = sorted(set(self.sources) - present)
        if orphan:
            raise ValueError(f"source_{orphan[0]} names a field that is not set")
        bad = sorted(self.estimates - present)
        if bad:
            raise ValueError(f"estimates lists '{bad[0]}', which is not a set figure")

    def is_estimate(self, figure: str) -> bool:
        """True when ``figure`` is an estimate rather than a published/measured number."""
        return figure in self.estimates


class Box(_Sourced, frozen=True, kw_only=True):
    """One machine that runs ranks.

    ``memory_gb`` (GB) and ``memory_bandwidth_gbps`` (GB/s) are what one rank can use
    and read; ``tflops_*`` are dense peak TFLOPS (None: no such unit or not known);
    ``nic_gbit_s`` is the fastest port's speed in Gb/s; watts are for the whole box at
    the wall where known (a GPU card's entry: the card, see its sources);
    ``builder_price_usd`` is what the seed cluster's builder paid, where known;
    ``memory_options`` (GB) and the ``option_*`` tables: ``shardwise.spec.box_options``.
    """

    memory_gb: Positive
    memory_bandwidth_gbps: Positive
    tflops_bf16: Positive
    tflops_fp8: Positive | None = None
    tflops_fp4: Positive | None = None
    nic: str
    nic_gbit_s: Positive
    idle_watts: Positive
    load_watts: Positive
    rated_watts: Positive
    list_price_usd: Positive
    builder_price_usd: Positive | None = None
    memory_options: tuple[Positive, ...] | None = None
    option_memory_bandwidth_gbps: dict[str, Positive] | None = None
    option_tflops_bf16: dict[str, Positive] | None = None
    option_list_price_usd: dict[str, Positive] | None = None
    option_chip: dict[str, str] | None = None

    FIGURES: ClassVar[tuple[str, ...]] = (
        "memory_gb", "memory_bandwidth_gbps", "tflops_bf16", "tflops_fp8", "tflops_fp4", "nic", "nic_gbit_s",
        "idle_watts", "load_watts", "rated_watts", "list_price_usd", "builder_price_usd", "memory_options",
        "option_memory_bandwidth_gbps", "option_tflops_bf16", "option_list_price_usd", "option_chip",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_options is not None and self.memory_gb not in self.memory_options:
            raise ValueError(f"memory_gb = {self.memory_gb:g} is not one of memory_options {list(self.memory_options)}")
        check_option_tables(self)

    @property
    def memory_bytes(self) -> float:
        """Memory in bytes (``memory_gb`` × 1e9)."""
        return self.memory_gb * 1e9

    @property
    def memory_bandwidth_bytes_per_s(self) -> float:
        """Memory bandwidth in bytes per second."""
        return self.memory_bandwidth_gbps * 1e9


class Link(_Sourced, frozen=True, kw_only=True):
    """A kind of interconnect between boxes.

    ``bandwidth_gbps`` is effective GB/s per direction, ``latency_s`` the per-message
    (per collective step) cost in seconds with the software stack included. The switch
    fields describe one switch of the kind the link needs (absent for direct cables):
    its wall watts, price, and ports at this link's speed (breakouts counted).
    """

    kind: Literal["tcp", "rdma", "pcie", "nvlink"]
    aliases: tuple[str, ...] = ()
    bandwidth_gbps: Positive
    latency_s: NonNegative
    switch: str | None = None
    switch_ports: Annotated[int, Meta(gt=0)] | None = None
    switch_watts: Positive | None = None
    switch_price_usd: Positive | None = None

    FIGURES: ClassVar[tuple[str, ...]] = (
        "bandwidth_gbps",
        "latency_s",
        "switch",
        "switch_ports",
        "switch_watts",
        "switch_price_usd",
    )

    @property
    def beta_bytes_per_s(self) -> float:
        """Bandwidth in bytes per second (the β of the α-β model)."""
        return self.bandwidth_gbps * 1e9


class Measured(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Figures measured on a cluster (by ``shardwise probe``) that replace catalog ones.

    ``memory_bandwidth_gbps`` GB/s, ``link_bandwidth_gbps`` GB/s per direction,
    ``link_latency_s`` seconds per message, ``memory_gb`` GB, ``tflops_bf16`` dense
    TFLOPS; ``source`` says when and how.
    """

    source: Annotated[str, Meta(min_length=1)]
    memory_gb: Positive | None = None
    memory_bandwidth_gbps: Positive | None = None
    tflops_bf16: Positive | None = None
    link_bandwidth_gbps: Positive | None = None
    link_latency_s: NonNegative | None = None


class Catalog(Struct, frozen=True, kw_only=True):
    """Every bundled box and link, by key; ``link_aliases`` maps alias → key; ``box_options``
    maps an option prefix (``mac-studio-m4-max``) to the entry offering its memory options."""

    boxes: dict[str, Box]
    box_options: dict[str, Box]
    links: dict[str, Link]
    link_aliases: dict[str, str]


class ClusterSpec(Struct, frozen=True, kw_only=True):
    """``boxes`` identical ``box`` machines joined by ``link``, optionally wired as ``topology``.

    ``box`` and ``link`` already carry ``measured`` figures where there are any.
    """

    box: Box
    boxes: int
    link: Link
    topology: Topology | None = None
    measured: Measured | None = None

    def __post_init__(self) -> None:
        if isinstance(self.boxes, bool) or not isinstance(self.boxes, int) or self.boxes < 1:
            raise ValueError(f"boxes must be a whole number >= 1, got {self.boxes!r}")
        if self.topology is not None and len(self.topology.hosts) != self.boxes:
            raise ValueError(f"boxes = {self.boxes} but the topology lists {len(self.topology.hosts)} hosts")

    @property
    def memory_gb(self) -> float:
        """Memory of all boxes together, GB."""
        return self.box.memory_gb * self.boxes


def _entry(model: type[_Sourced], key: str, table: Any, origin: str) -> Any:
    if not isinstance(table, dict):
        raise ShardwiseError(f"{origin}: [{key}] must be a table")
    fields: dict[str, Any] = {"key": key, "sources": {}}
    for name, value in table.items():
        if name.startswith("source_"):
            fields["sources"][name.removeprefix("source_")] = value
        else:
            fields[name] = value
    try:
        return msgspec.convert(fields, model)
    except msgspec.ValidationError as exc:
        raise ShardwiseError(f"{origin}: [{key}] {validation_message(exc)}") from None


def _read_catalog_file(name: str) -> dict[str, Any]:
    text = resources.files("shardwise.spec").joinpath("catalog", name).read_text(encoding="utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The bundled catalog (read once, then cached)."""
    boxes = {key: _entry(Box, key, table, "hardware.toml") for key, table in _read_catalog_file("hardware.toml").items()}
    links = {key: _entry(Link, key, table, "links.toml") for key, table in _read_catalog_file("links.toml").items()}
    aliases: dict[str, str] = {}
    for key, link in links.items():
        for alias in link.aliases:
            if alias in links or alias in aliases:
                raise ShardwiseError(f"links.toml: [{key}] alias '{alias}' is already a link name or alias")
            aliases[alias] = key
    return Catalog(boxes=boxes, box_options=option_index(boxes), links=links, link_aliases=aliases)


def get_box(name: str) -> Box:
    """Catalog box by key, or a memory option of one (``mac-studio-m4-max-64``, see
    ``shardwise.spec.box_options``); unknown names raise ShardwiseError suggesting close ones."""
    catalog = load_catalog()
    if name in catalog.boxes:
        return catalog.boxes[name]
    box = option_box(catalog.box_options, name)
    if box is None:
        raise unknown_name("box", name, {*catalog.boxes, *option_keys(catalog.box_options)})
    return box


def get_link(name: str) -> Link:
    """Catalog link by key or alias; unknown names raise ShardwiseError suggesting close ones."""
    catalog = load_catalog()
    key = catalog.link_aliases.get(name, name)
    if key not in catalog.links:
        raise unknown_name("link", name, [*catalog.links, *catalog.link_aliases])
    return catalog.links[key]


def _measured_box(box: Box, measured: Measured | None) -> Box:
    if measured is None:
        return box
    updates = {
        "memory_gb": measured.memory_gb,
        "memory_bandwidth_gbps": measured.memory_bandwidth_gbps,
        "tflops_bf16": measured.tflops_bf16,
    }
    return _updated(box, updates, measured)


def _measured_link(link: Link, measured: Measured | None) -> Link:
    if measured is None:
        return link
    updates = {"bandwidth_gbps": measured.link_bandwidth_gbps, "latency_s": measured.link_latency_s}
    return _updated(link, updates, measured)


def apply_measured(box: Box, link: Link, measured: Measured | None) -> tuple[Box, Link]:
    """``box`` and ``link`` with ``measured`` figures in place of the catalog's."""
    return _measured_box(box, measured), _measured_link(link, measured)


def _updated(entry: _Sourced, updates: dict[str, float | None], measured: Measured):
    changes = {field: value for field, value in updates.items() if value is not None}
    if not changes:
        return entry
    sources = dict(entry.sources)
    sources.update({field: f"measured: {measured.source}" for field in changes})
    return msgspec.structs.replace(entry, **changes, sources=sources, estimates=entry.estimates - set(changes))


def read_toml(path: str | Path, what: str = "cluster file") -> tuple[dict[str, Any], str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ShardwiseError(f"{path}: cannot read {what} ({exc.strerror}); check the path") from None
    except UnicodeDecodeError as exc:
        raise ShardwiseError(f"{path}: {what} is not UTF-8 text (byte {exc.start}); is it a TOML file?") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise ShardwiseError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ShardwiseError(f"{path}: not TOML shardwise can read: arrays or tables nested too deep") from None


def _cluster_table(doc: dict[str, Any], where: str, required: bool) -> dict[str, Any]:
    table = doc.get("cluster")
    if table is None:
        if required:
            raise ShardwiseError(f'{where}: missing [cluster] table; add [cluster] with box = "..." and link = "..."')
        return {}
    if not isinstance(table, dict):
        raise ShardwiseError(f"{where}: cluster must be a table written [cluster]")
    extra = sorted(set(table) - {"box", "link", "boxes", "measured"})
    if extra:
        raise ShardwiseError(f"{where}: [cluster] unknown key '{extra[0]}'; keys are box, link, boxes, measured")
    unknown = sorted(set(doc) - {"cluster", "hosts", "switches", "links"})
    if unknown:
        raise ShardwiseError(f"{where}: unknown top-level key '{unknown[0]}'; use [cluster], [[hosts]], [[switches]], [[links]]")
    return table


def _catalog_name(table: dict[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str):
        raise ShardwiseError(f'{where}: [cluster] {key} must be a catalog name like {key} = "..."; got {value!r}')
    return value


def _link_for(table: dict[str, Any], where: str) -> Link | None:
    if "link" not in table:
        return None
    try:
        return get_link(_catalog_name(table, "link", where))
    except ShardwiseError as exc:
        raise ShardwiseError(f"{where}: [cluster] link: {exc}") from None


def load_topology_file(path: str | Path) -> Topology:
    """Topology from a cluster file (``[cluster]`` optional; its ``link`` gives cable defaults)."""
    where = str(path)
    doc, text = read_toml(path)
    table = _cluster_table(doc, where, required=False)
    link = _link_for(table, where)
    if link is not None:
        link = _measured_link(link, _measured(table, where))
    topology = topology_from_toml(
        doc,
        text,
        where,
        default_bandwidth_gbps=link.bandwidth_gbps if link else None,
        default_latency_s=link.latency_s if link else None,
    )
    if topology is None:
        raise ShardwiseError(f'{where}: no [[hosts]]; list each box as [[hosts]] name = "..."')
    return topology


def _measured(table: dict[str, Any], where: str) -> Measured | None:
    raw = table.get("measured")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ShardwiseError(f"{where}: [cluster.measured] must be a table")
    try:
        return msgspec.convert(raw, Measured)
    except msgspec.ValidationError as exc:
        raise ShardwiseError(f"{where}: [cluster.measured] {validation_message(exc)}") from None


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """ClusterSpec from a user cluster TOML file (format in the module docstring)."""
    where = str(path)
    doc, text = read_toml(path)
    table = _cluster_table(doc, where, required=True)
    try:
        box = get_box(_catalog_name(table, "box", where))
    except ShardwiseError as exc:
        raise ShardwiseError(f"{where}: [cluster] box: {exc}") from None
    link = _link_for(table, where)
    if link is None:
        raise ShardwiseError(f'{where}: [cluster] needs link = "..." (a links catalog name, e.g. "200g-roce")')
    measured = _measured(table, where)
    box, link = apply_measured(box, link, measured)
    topology = topology_from_toml(doc, text, where, link.bandwidth_gbps, link.latency_s)
    boxes = table.get("boxes")
    if boxes is None:
        if topology is None:
            raise ShardwiseError(f"{where}: [cluster] needs boxes = N, or list the boxes as [[hosts]]")
        boxes = len(topology.hosts)
    if isinstance(boxes, bool) or not isinstance(boxes, int) or not 1 <= boxes <= MAX_CLUSTER_BOXES:
        raise ShardwiseError(
            f"{where}: [cluster] boxes must be a whole number in 1..{MAX_CLUSTER_BOXES}, got {boxes!r}: "
            f"set boxes = N to the cluster's box count")
    if topology is not None and boxes != len(topology.hosts):
        raise ShardwiseError(
            f"{where}: [cluster] boxes = {boxes} but {len(topology.hosts)} [[hosts]] are listed; make them agree"
        )
    return ClusterSpec(box=box, boxes=boxes, link=link, topology=topology, measured=measured)


def cluster_to_toml(cluster: ClusterSpec) -> dict[str, Any]:
    """The TOML document ``write_cluster_file`` writes (catalog keys, measured figures, topology)."""
    catalog = load_catalog()
    box, link = cluster.box, cluster.link
    try:
        listed = get_box(box.key)
    except ShardwiseError:
        listed = None
    if listed is None or _measured_box(listed, cluster.measured) != box:
        raise ShardwiseError(
            f"cluster box '{box.key}' is not the catalog box plus [cluster.measured]; "
            "record measured figures in ClusterSpec.measured (see apply_measured)"
        )
    if link.key not in catalog.links or _measured_link(catalog.links[link.key], cluster.measured) != link:
        raise ShardwiseError(
            f"cluster link '{link.key}' is not the catalog link plus [cluster.measured]; "
            "record measured figures in ClusterSpec.measured (see apply_measured)"
        )
    table: dict[str, Any] = {"box": cluster.box.key, "link": cluster.link.key, "boxes": cluster.boxes}
    if cluster.measured is not None:
        table["measured"] = {k: v for k, v in msgspec.structs.asdict(cluster.measured).items() if v is not None}
    doc: dict[str, Any] = {"cluster": table}
    if cluster.topology is not None:
        doc.update(topology_to_toml(cluster.topology))
    return doc


def write_cluster_file(cluster: ClusterSpec, path: str | Path) -> None:
    """Write ``cluster`` as a cluster TOML file that ``load_cluster_file`` reads back equal."""
    text = tomli_w.dumps(cluster_to_toml(cluster))
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ShardwiseError(f"{path}: cannot write cluster file ({exc.strerror}); check the path") from None

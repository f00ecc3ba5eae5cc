"""What can be built: which links a box can use, switches, prices, the valid layouts of a box
count and the quantization variants a sweep tries (the rules are stated in ``perf.sweep``'s
docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from shardwise.plan import ParallelPlan, default_ep, is_valid_plan, valid_tp_degrees
from shardwise.quant.formats import get_format
from shardwise.spec.hardware import Box, Link
from shardwise.spec.model import MATMUL_GROUPS, ROUTED_EXPERTS, ModelSpec

NO_LINK = "none"
DEFAULT_QUANTS = ("native", "fp8", "mxfp4")
HOST_GPUS_MAX = 8  # GPUs on one NVLink board or in one PCIe host


def link_capacity(box: Box, link: Link) -> int:
    """Most boxes of ``box`` that ``link`` can join (0: this box cannot use this link)."""
    nic = box.nic
    if link.kind == "nvlink":
        want = re.search(r"NVLink (\d+)", link.name)
        have = re.search(r"NVLink (\d+)", nic)
        return HOST_GPUS_MAX if want and have and want.group(1) == have.group(1) else 0
    if link.kind == "pcie":
        want = re.search(r"PCIe (\d+)", link.name)
        have = re.search(r"PCIe (\d+)", nic)
        return HOST_GPUS_MAX if want and have and int(have.group(1)) >= int(want.group(1)) else 0
    if "Thunderbolt 5" in link.name:
        ports = re.search(r"Thunderbolt 5 x(\d+)", nic)
        return int(ports.group(1)) + 1 if ports else 0
    rdma_nic = re.search(r"ConnectX|RoCE", nic) is not None
    if link.kind == "rdma" and not rdma_nic:
        return 0
    ports = [float(x) for x in re.findall(r"(\d+)\s*GbE", nic)] + ([box.nic_gbit_s] if rdma_nic else [])
    if link.bandwidth_gbps * 8 > max(ports or [box.nic_gbit_s]):
        return 0
    return 1 << 30


def switches_needed(boxes: int | np.ndarray, link: Link | None) -> np.ndarray:
    """Switches for ``boxes`` boxes on ``link``: none for 1-2 boxes or switchless links."""
    n = np.asarray(boxes)
    if link is None or not link.switch_ports:
        return np.zeros(n.shape, dtype=np.int64)
    return np.where(n > 2, -(-n // link.switch_ports), 0)


def box_price(box: Box, list_prices: bool = False) -> tuple[float, str]:
    """(USD per box, which price) under the sweep's price rule."""
    if box.builder_price_usd and not list_prices:
        return box.builder_price_usd, "builder"
    return box.list_price_usd, "list"


def enumerate_layouts(model: ModelSpec, counts: tuple[int, ...], formats: dict[str, str] | None = None) -> list[ParallelPlan]:
    """Every (tp, ep, pp) with tp·pp in ``counts`` (one rank per box) that ``plan.validate_plan``
    accepts at ``formats`` (default the checkpoint's)."""
    out = []
    for n in sorted(set(counts)):
        for tp in valid_tp_degrees(model):
            if n % tp or n // tp > model.num_layers:
                continue
            for ep in range(1, default_ep(model, tp) + 1):
                plan = ParallelPlan(tp=tp, ep=ep, pp=n // tp)
                if is_valid_plan(model, plan, formats):
                    out.append(plan)
    return out


@dataclass(frozen=True)
class QuantVariant:
    """One quantization of a model: a label and the format of every tensor group."""

    label: str
    formats: tuple[tuple[str, str], ...]

    @property
    def format_map(self) -> dict[str, str]:
        """Format name per tensor group."""
        return dict(self.formats)


def quant_variants(model: ModelSpec, quants: tuple[str, ...] | None, experts: tuple[str, ...] | None) -> list[QuantVariant]:
    """The quantizations to sweep for ``model`` (see module docstring), deduplicated.

    ``quants`` None: the defaults, capped at the checkpoint's precision. Given explicitly,
    each format is applied to every matmul group as given (as ``shardwise plan --quant``).
    ``experts``: formats for the routed experts, crossed with each variant.
    """
    native = model.group_formats()
    explicit = quants is not None
    out: dict[tuple, QuantVariant] = {}
    for q in quants if explicit else DEFAULT_QUANTS:
        formats = dict(native)
        if q != "native":
            bits = get_format(q).bits_per_weight
            for g in MATMUL_GROUPS:
                if explicit or bits < get_format(native[g]).bits_per_weight:
                    formats[g] = q
        for e in experts or (None,):
            f = dict(formats)
            label = q
            if e is not None:
                get_format(e)
                f[ROUTED_EXPERTS] = e
                label = f"{q}, experts {e}"
            key = tuple(sorted(f.items()))
            out.setdefault(key, QuantVariant(label, key))
    return list(out.values())


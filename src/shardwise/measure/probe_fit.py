"""Parent side of ``shardwise probe`` (numpy only): fits and the probe document.

``fit_alpha_beta`` / ``ring_alpha_beta`` fit a link's α (seconds per message) and β (bytes
per second) to timed points; ``summarize`` turns every rank's raw figures from
``measure.probe.probe_rank`` into the probe document: nccl-tests-style tables (algbw =
bytes / time, busbw = algbw · 2(p−1)/p), α/β per link and for the ring, the per-call
software overhead of each algorithm (from the in-decode cost where measured, else from
the tight-loop table), memory bandwidth, matmul TFLOPS and seconds per eager op;
``measured_of`` / ``cluster_of`` make the cluster file ``shardwise plan --cluster`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.perf.collectives import runtime_allreduce_s
from shardwise.runtime.host_costs import REFERENCE_MESSAGE_BYTES

if TYPE_CHECKING:
    from shardwise.measure.probe import ProbeConfig

OVERHEAD_MAX_BYTES = 16384
"""Sizes up to this are latency-bound: the per-call overhead is read from them."""


def bus_bandwidth(algbw: float, p: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: ``algbw · 2(p−1)/p`` (0 for one rank)."""
    return algbw * 2 * (p - 1) / p


def fit_alpha_beta(
    n_bytes: Sequence[float], seconds: Sequence[float], messages: float = 1.0, volume: float = 1.0
) -> tuple[float, float]:
    """Robust least-squares (α s, β bytes/s) of ``t = messages·α + volume·n/β``.

    ``messages`` and ``volume`` adapt the fit to an algorithm: a point-to-point message
    is (1, 1), a ring all-reduce over p ranks (2(p−1), 2(p−1)/p). Each point's residual is
    relative to its time, so the latency-bound small sizes fix α as firmly as the large
    ones fix β; Huber reweighting (a few rounds) keeps a point a busy host slowed down
    from dragging the line. α is clipped at 0; a β that comes out non-positive (times
    that do not grow with size) is an error naming the range.
    """
    n = np.asarray(n_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.size < 2 or len(set(n.tolist())) < 2:
        raise ShardwiseError("fitting alpha/beta needs at least 2 points with different message sizes")
    if np.any(t <= 0):
        raise ShardwiseError("fitting alpha/beta needs positive times")
    design = np.stack([np.full_like(n, messages), volume * n], axis=1) / t[:, None]
    weights = np.ones_like(t)
    for _ in range(8):
        sw = np.sqrt(weights)
        (alpha, inv_beta), *_ = np.linalg.lstsq(design * sw[:, None], sw, rcond=None)
        if alpha < 0:  # α at its bound: fit 1/β alone
            alpha = 0.0
            inv_beta = float(np.sum(weights * design[:, 1]) / np.sum(weights * design[:, 1] ** 2))
        residual = np.abs(design @ np.array([alpha, inv_beta]) - 1.0)
        scale = 1.4826 * float(np.median(residual)) or 1e-12
        weights = np.minimum(1.0, 1.345 * scale / np.maximum(residual, 1e-300))
    if inv_beta <= 0:
        raise ShardwiseError(
            f"times do not grow with message size ({t.min():.3g}-{t.max():.3g} s over "
            f"{int(n.min())}-{int(n.max())} B): probe larger sizes with --max-bytes"
        )
    return float(alpha), 1.0 / float(inv_beta)


def ring_alpha_beta(n_bytes: Sequence[float], seconds: Sequence[float], p: int) -> tuple[float, float]:
    """(α, β) of the link from ring all-reduce points over ``p`` ranks (``fit_alpha_beta``)."""
    if p < 2:
        raise ShardwiseError("a ring fit needs at least 2 ranks")
    return fit_alpha_beta(n_bytes, seconds, messages=2 * (p - 1), volume=2 * (p - 1) / p)


def in_decode_overhead_s(name: str, in_decode_s: float, p: int, local: int, alpha: float, beta: float) -> float:
    """Per-call software overhead of all-reduce ``name``: its measured in-decode seconds over
    its α-β time (``collectives.runtime_allreduce_s``) at the reference message size, at least 0."""
    return max(0.0, in_decode_s - runtime_allreduce_s(name, REFERENCE_MESSAGE_BYTES, p, alpha, beta, local))


def _table(points: list[tuple[int, float]], p: int) -> list[dict[str, float]]:
    rows = []
    for n, t in points:
        algbw = n / t / 1e9
        rows.append({"bytes": n, "time_s": t, "algbw_gbps": algbw, "busbw_gbps": bus_bandwidth(algbw, p)})
    return rows


def summarize(reports: list[dict[str, Any]], cfg: ProbeConfig, backend: str) -> dict[str, Any]:
    """The probe document from every rank's raw figures: nccl-tests-style tables, α/β fits
    per link and for the ring, per-call software overhead per algorithm, memory bandwidth
    (the slowest rank's triad), matmul TFLOPS and seconds per eager op (the slowest rank)."""
    first = reports[0]
    p = len(reports)
    local = first["local_world_size"]
    doc: dict[str, Any] = {
        "kind": "probe", "world_size": p, "hosts": sorted(set(first["hosts"])), "backend": backend,
        "threads_per_rank": first["threads"], "iters": cfg.iters,
        "collectives": {name: _table(points, p) for name, points in first["collectives"].items()},
        "links": [], "ring_fit": None, "collective_overhead_s": {},
    }
    for link in first["links"]:
        n, t = zip(*link["points"])
        alpha, beta = fit_alpha_beta(n, t)
        doc["links"].append({"name": link["name"], "ranks": link["ranks"], "alpha_s": alpha, "beta_gbps": beta / 1e9,
                             "points": [{"bytes": a, "time_s": b} for a, b in link["points"]]})
    ring = first["collectives"].get("ring")
    if ring and len(ring) >= 2:
        n, t = zip(*ring)
        alpha, beta = ring_alpha_beta(n, t, p)
        doc["ring_fit"] = {"alpha_s": alpha, "beta_gbps": beta / 1e9}
        doc["collective_in_decode_s"] = {}
        for name, points in first["collectives"].items():
            in_decode = [r["collective_in_decode_s"][name] for r in reports if name in r["collective_in_decode_s"]]
            if in_decode:  # the slowest rank's: every rank waits for it
                doc["collective_in_decode_s"][name] = max(in_decode)
                overhead = in_decode_overhead_s(name, max(in_decode), p, local, alpha, beta)
            else:
                small = [t - runtime_allreduce_s(name, n, p, alpha, beta, local) for n, t in points if n <= OVERHEAD_MAX_BYTES]
                overhead = max(0.0, float(np.median(small))) if small else 0.0
            doc["collective_overhead_s"][name] = overhead
    doc["memory_bandwidth_gbps"] = min(r["triad_gbps"] for r in reports)
    doc["memory_bandwidth_gbps_per_rank"] = [r["triad_gbps"] for r in reports]
    doc["tflops"] = {d: min(r["tflops"][d] for r in reports) for d in first["tflops"]}
    doc["op_overhead_s"] = max(r["op_overhead_s"] for r in reports)
    doc["op_overhead_moe_s"] = max(r["op_overhead_moe_s"] for r in reports)
    doc["reference_block_ops"] = first["reference_block_ops"]
    doc["memory_gb_per_rank"] = first["host_memory_bytes"] / local / 1e9
    return doc


def measured_of(doc: dict[str, Any], source: str):
    """``Measured`` figures for a cluster file from a probe document."""
    from shardwise.spec.hardware import Measured

    ring = doc.get("ring_fit")
    return Measured(
        source=source,
        memory_gb=round(doc["memory_gb_per_rank"], 3),
        memory_bandwidth_gbps=round(doc["memory_bandwidth_gbps"], 3),
        tflops_bf16=round(doc["tflops"]["bf16"], 5) if "bf16" in doc["tflops"] else None,
        link_bandwidth_gbps=round(ring["beta_gbps"], 4) if ring else None,
        link_latency_s=float(f"{ring['alpha_s']:.4g}") if ring else None,
    )


def cluster_of(doc: dict[str, Any], box: str, link: str, source: str):
    """A ``ClusterSpec`` of ``world_size`` boxes (one per rank) with the probe's figures."""
    from shardwise.spec.hardware import ClusterSpec, apply_measured, get_box, get_link

    measured = measured_of(doc, source)
    box_obj, link_obj = apply_measured(get_box(box), get_link(link), measured)
    return ClusterSpec(box=box_obj, boxes=doc["world_size"], link=link_obj, measured=measured)

"""Hold the performance model against published measurements, row by row.

For each resolved row: the decode tok/s predicted under the row's runtime profile and under
the pure roofline (``ideal``), the measured figure, and the absolute percentage error (APE).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from shardwise.perf.estimate import Scenario, decode_speed
from shardwise.perf.measurements import ResolvedRow, read_measurements, resolve
from shardwise.perf.profiles import RuntimeProfile, get_profile
from shardwise.spec.hardware import get_box, get_link


def scenario_of(row: ResolvedRow, profile: RuntimeProfile) -> Scenario:
    """The planner's scenario for a resolved measurement row."""
    box = get_box(row.box_key)
    return Scenario(
        model=row.model, box=box, boxes=row.plan.world_size, link=get_link(row.link_key), plan=row.plan,
        formats=row.formats, profile=profile, context_tokens=row.context_tokens,
        spec_tokens=row.spec_tokens, acceptance=row.acceptance,
    )


def ape(predicted: float, measured: float) -> float:
    """Absolute percentage error, percent."""
    return abs(predicted - measured) / measured * 100.0


def validate_file(path: str | Path) -> dict:
    """Per-row predicted vs measured decode tok/s, the median APE, and the roofline baseline's."""
    resolved, unresolved = [], []
    for m in read_measurements(path):
        r = resolve(m)
        if isinstance(r, str):
            unresolved.append({"id": m.id, "model": m.model, "hardware": m.hardware, "reason": r})
        else:
            resolved.append(r)
    rows = []
    ideal = get_profile("ideal")
    for r in resolved:
        measured = r.measurement.decode_tok_s
        predicted = decode_speed(scenario_of(r, get_profile(r.profile)))[0]
        roofline = decode_speed(scenario_of(r, ideal))[0]
        rows.append({
            "id": r.measurement.id, "model": r.model.name, "box": r.box_key, "boxes": r.plan.world_size,
            "link": r.link_key if r.plan.world_size > 1 else None, "layout": r.plan.describe(),
            "profile": r.profile, "context_tokens": r.context_tokens, "spec_tokens": r.spec_tokens,
            "measured_tok_per_s": measured, "predicted_tok_per_s": predicted, "ape": ape(predicted, measured),
            "roofline_tok_per_s": roofline, "roofline_ape": ape(roofline, measured), "notes": list(r.notes),
        })
    return {
        "median_ape": statistics.median(r["ape"] for r in rows) if rows else None,
        "baseline_median_ape": statistics.median(r["roofline_ape"] for r in rows) if rows else None,
        "resolved": len(rows),
        "unresolved": unresolved,
        "rows": rows,
    }

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
        spec_tokens=row.spec_tokens, acceptance=row.acceptance, batch=row.batch,
    )


def ape(predicted: float, measured: float) -> float:
    """Absolute percentage error, percent."""
    return abs(predicted - measured) / measured * 100.0


def validate_file(path: str | Path, cv: bool = False) -> dict:
    """Per-row predicted vs measured decode tok/s, the median APE, and the roofline baseline's:
    over the batch-1 rows (``median_ape``, ``resolved``) and, apart, over rows measured at batch
    > 1 (``batched``: the prediction at the row's batch, aggregate or per stream as it says).
    With ``cv`` also each batch-1 row's prediction by profiles fitted without its source's rows
    (``calibrate.leave_one_source_out``) and their median APE (``cv``)."""
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
        scale = r.batch if r.aggregate else 1  # tok/s per sequence -> what the row measured
        predicted = scale * decode_speed(scenario_of(r, get_profile(r.profile)))[0]
        roofline = scale * decode_speed(scenario_of(r, ideal))[0]
        rows.append({
            "id": r.measurement.id, "model": r.model.name, "box": r.box_key, "boxes": r.plan.world_size,
            "link": r.link_key if r.plan.world_size > 1 else None, "layout": r.plan.describe(),
            "profile": r.profile, "context_tokens": r.context_tokens, "spec_tokens": r.spec_tokens,
            "batch": r.batch, "aggregate": r.aggregate,
            "measured_tok_per_s": measured, "predicted_tok_per_s": predicted, "ape": ape(predicted, measured),
            "roofline_tok_per_s": roofline, "roofline_ape": ape(roofline, measured), "notes": list(r.notes),
        })
    single = [r for r in rows if r["batch"] == 1]
    batched = [r for r in rows if r["batch"] > 1]
    held_out = None
    if cv:
        from shardwise.perf.calibrate import leave_one_source_out

        predicted = leave_one_source_out([r for r in resolved if r.batch == 1])
        for row in single:
            row["cv_predicted_tok_per_s"] = predicted[row["id"]]
            row["cv_ape"] = None if predicted[row["id"]] is None else ape(predicted[row["id"]], row["measured_tok_per_s"])
        scored = [r for r in single if r["cv_ape"] is not None]
        held_out = {"median_ape": _median(scored, "cv_ape"), "rows": len(scored), "no_other_source": len(single) - len(scored),
                    "method": "leave one source out: each row predicted by profiles fitted on the other sources' rows"}
    return {
        "median_ape": _median(single, "ape"),
        "baseline_median_ape": _median(single, "roofline_ape"),
        "resolved": len(single),
        "batched": {"resolved": len(batched), "median_ape": _median(batched, "ape"),
                    "baseline_median_ape": _median(batched, "roofline_ape")},
        "cv": held_out,
        "unresolved": unresolved,
        "rows": rows,
    }


def _median(rows: list[dict], key: str) -> float | None:
    return statistics.median(r[key] for r in rows) if rows else None

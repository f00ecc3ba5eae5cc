"""One configuration against a sweep's front: on it, dominated (by what), or excluded (by what)."""

from __future__ import annotations

import numpy as np

from shardwise.perf import core, grid
from shardwise.perf.configurations import NO_LINK, box_price, enumerate_layouts, link_capacity, quant_variants, switches_needed
from shardwise.perf.estimate import formats_bits
from shardwise.perf.profiles import get_profile, message_latency_s
from shardwise.perf.sweep import SweepRequest, SweepResult, draft_terms

GB = 1e9


def explain(result: SweepResult, req: SweepRequest, model: str, box: str, boxes: int, link: str | None) -> str:
    """One line: is this configuration (native quantization, its fastest layout) on the front,
    and if not, what dominates it or which constraint removes it."""
    from shardwise.spec.parse import load_model

    spec = load_model(model)
    box_obj = next((b for b in req.boxes if b.key == box), None)
    link_obj = next((lk for lk in req.links if lk.key == link), None) if link else None
    label = f"{boxes} x {box}" + (f" over {link}" if link else "") + f" ({model}, native)"
    if box_obj is None or boxes not in req.counts or (link and link_obj is None) or model not in req.models:
        return f"{label} is outside this sweep"
    plans = enumerate_layouts(spec, (boxes,))
    if not plans:
        return f"{label}: no tp x pp layout of {model} uses exactly {boxes} boxes"
    variant = quant_variants(spec, ("native",), None)[0]
    table = core.build_layout_table(spec, plans, formats_bits(variant.format_map, spec), req.kv_bytes)
    prof = get_profile(req.runtime)
    drafting, replicated = draft_terms(req, (box_obj,))
    out = grid.evaluate(
        spec, table, np.arange(len(plans)),
        core.Hardware(box_obj.memory_bandwidth_gbps * GB, box_obj.tflops_bf16 * 1e12,
                      message_latency_s(link_obj, prof) if link_obj else 0.0,
                      link_obj.bandwidth_gbps * GB if link_obj else 1.0,
                      network=bool(link_obj and link_obj.kind in ("tcp", "rdma"))),
        box_obj.memory_gb * GB, req.context_tokens, profile=prof, reserve_fraction=req.reserve_fraction, spec_tokens=req.spec_tokens, acceptance=req.acceptance,
        drafting_s=drafting[0], replicated_bytes=replicated,
    )
    if link_obj is not None and boxes > link_capacity(box_obj, link_obj):
        return f"{label} cannot be cabled: {box} cannot use {link} for {boxes} boxes"
    fits = out["fits"]
    if not fits.any():
        return f"{label} does not fit: {-out['free_bytes'].max() / GB:,.1f} GB short on the fullest box at --context {req.context_tokens}"
    best = int(np.argmax(np.where(fits, out["tok_per_s"], -np.inf)))
    tok = float(out["tok_per_s"][best])
    usd = boxes * box_price(box_obj, req.list_prices)[0] + int(switches_needed(boxes, link_obj)) * (
        (link_obj.switch_price_usd or 0.0) if link_obj else 0.0)
    watts = boxes * box_obj.load_watts + int(switches_needed(boxes, link_obj)) * (
        (link_obj.switch_watts or 0.0) if link_obj else 0.0)
    what = f"{label}, {plans[best].describe()}: {tok:,.2f} tok/s, ${usd:,.0f}, {watts:,.0f} W"
    misses = []
    if req.budget_usd is not None and usd > req.budget_usd:
        misses.append(f"over --budget by ${usd - req.budget_usd:,.0f}")
    if req.max_watts is not None and watts > req.max_watts:
        misses.append(f"over --max-watts by {watts - req.max_watts:,.0f} W")
    if req.min_tok_per_s is not None and tok < req.min_tok_per_s:
        misses.append(f"under --min-tok-per-s by {req.min_tok_per_s - tok:,.2f}")
    if misses:
        return f"{what} is excluded: {'; '.join(misses)}"
    for i, row in enumerate(result.rows, 1):
        if (row["model"], row["box"], row["boxes"], row["link"], row["quant"]) == (model, box, boxes, link or NO_LINK, "native") \
                and abs(row["tok_per_s"] - tok) <= 1e-9 * tok:
            return f"{what} is on the front (row {i} of {len(result.rows)})"
    bits = table.bits_per_weight
    for row in result.rows:
        if row["model"] != model:
            continue
        if row["tok_per_s"] >= tok and row["usd"] <= usd and row["watts"] <= watts and row["bits_per_weight"] >= bits - 1e-12:
            gains = []
            if row["tok_per_s"] > tok:
                gains.append(f"{row['tok_per_s'] / tok - 1:.0%} faster")
            if row["usd"] < usd:
                gains.append(f"${usd - row['usd']:,.0f} cheaper")
            if row["watts"] < watts:
                gains.append(f"{watts - row['watts']:,.0f} W less")
            return (f"{what} is dominated by {row['boxes']} x {row['box']} over {row['link']}, {row['layout']} "
                    f"({row['quant']}): {row['tok_per_s']:,.2f} tok/s, ${row['usd']:,.0f}, {row['watts']:,.0f} W "
                    f"({', '.join(gains) or 'equal'})")
    return f"{what} is dominated by a configuration outside the listed rows"


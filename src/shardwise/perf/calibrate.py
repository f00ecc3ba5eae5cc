"""Fit each runtime profile's efficiency factors to published measurements.

``python -m shardwise.perf.calibrate [CSV]`` fits, per profile (vllm, llama-cpp, mlx), on the
rows of ``data/measurements.csv`` whose software maps to it, minimising the median absolute
percentage error of decode tok/s by grid search:
1. ``mem_efficiency`` × ``step_overhead_s`` × ``collective_overhead_s`` × ``layer_overhead_s``
   jointly (the collective overhead only where the profile has rows over a network link; else 0);
   every parameter on a bounded physical grid: 30-100% of peak bandwidth, 0-8 ms per step, 0-250 us
   per collective, 0-200 us per layer;
2. ``compute_efficiency`` on the rows' prefill tok/s.
It rewrites ``spec/catalog/profiles.toml`` with the fitted values, the row count and the fit's
median APE. A test re-runs the fit and checks the stored values, so nobody tunes them by hand.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.perf.decode import layout_table, overhead_seconds, step_terms
from shardwise.perf.estimate import decode_speed, formats_bits, hardware_of, prefill_speed
from shardwise.perf.speculative import tokens_per_step
from shardwise.perf.measurements import ResolvedRow, read_measurements, resolve
from shardwise.perf.profiles import RuntimeProfile, load_profiles
from shardwise.perf.validate import ape, scenario_of

FITTED = ("vllm", "llama-cpp", "mlx")
MEM_EFFICIENCY_GRID = np.round(0.3 + 0.025 * np.arange(29), 3)
STEP_OVERHEAD_GRID_S = np.array([0.0, 0.25e-3, 0.5e-3, 1e-3, 2e-3, 3e-3, 5e-3, 8e-3])
COLLECTIVE_OVERHEAD_GRID_S = np.round(np.array([0, 5, 10, 20, 30, 40, 60, 80, 100, 130, 160, 200, 250]) * 1e-6, 9)
LAYER_OVERHEAD_GRID_S = np.round(np.array([0, 5, 10, 20, 30, 50, 75, 100, 150, 200]) * 1e-6, 9)
COMPUTE_EFFICIENCY_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))
DEFAULT_CSV = Path(__file__).resolve().parents[3] / "data" / "measurements.csv"


def _row_terms(row: ResolvedRow, profile: RuntimeProfile):
    """(terms of the step that yields tokens, tokens per step, network link?, decoder layers) for one row."""
    sc = scenario_of(row, profile)
    hw = hardware_of(sc.box, sc.link, sc.profile)
    table = layout_table(sc.model, sc.plan, formats_bits(sc.formats, sc.model), sc.kv_bytes)
    positions = sc.spec_tokens + 1
    tokens = tokens_per_step(sc.spec_tokens, sc.acceptance) if sc.spec_tokens else 1.0
    terms = step_terms(sc.model, table, hw, sc.context_tokens, positions, allreduce=profile.allreduce)
    return terms, tokens, hw.network, terms.launch_layers


def _row_ape_grid(r: ResolvedRow, prior: RuntimeProfile) -> tuple[np.ndarray, bool]:
    """APE (%) of one row on the grid mem_eff x step_overhead x collective_overhead x layer_overhead
    [E, O, K, L], and whether the row crosses a network."""
    terms, tokens, network, layers = _row_terms(r, prior)
    comp = terms.compute_s / prior.compute_efficiency
    layers_s = np.maximum(terms.memory_s[None, :] / MEM_EFFICIENCY_GRID[:, None], comp[None, :]).sum(axis=1)
    coll = terms.collective_s + terms.collectives * COLLECTIVE_OVERHEAD_GRID_S * (1.0 if network else 0.0)
    overhead = overhead_seconds(STEP_OVERHEAD_GRID_S[:, None], LAYER_OVERHEAD_GRID_S[None, :], layers)
    step = layers_s[:, None, None, None] + overhead[None, :, None, :] + coll[None, None, :, None]
    ape_grid = np.abs(tokens / step - r.measurement.decode_tok_s) / r.measurement.decode_tok_s * 100
    return ape_grid, bool(network) and r.plan.world_size > 1


def fit_profile(prior: RuntimeProfile, rows: list[ResolvedRow], memo: dict | None = None) -> RuntimeProfile:
    """Fit ``prior``'s factors on ``rows``: a joint grid over memory efficiency, step overhead,
    per-collective overhead and per-layer overhead minimising the median APE of decode tok/s (ties to the earliest grid
    point), then compute efficiency on the rows' prefill tok/s. ``memo`` (a dict the caller keeps)
    holds each row's grid and prefill layout across fits of the same prior on overlapping rows."""
    memo = {} if memo is None else memo
    for r in rows:
        if ("grid", id(r)) not in memo:
            memo["grid", id(r)] = _row_ape_grid(r, prior)
    grids = [memo["grid", id(r)] for r in rows]
    apes, networked = np.stack([g for g, _ in grids]), any(n for _, n in grids)
    grid = np.median(apes, axis=0)
    if not networked:
        grid = grid[:, :, :1]  # no network row: the per-call overhead is not identifiable, keep 0
    e, o, k, n = np.unravel_index(np.argmin(grid), grid.shape)
    best = replace(
        prior, mem_efficiency=float(MEM_EFFICIENCY_GRID[e]), step_overhead_s=float(STEP_OVERHEAD_GRID_S[o]),
        collective_overhead_s=float(COLLECTIVE_OVERHEAD_GRID_S[k]), layer_overhead_s=float(LAYER_OVERHEAD_GRID_S[n]),
    )
    prefill_rows = [r for r in rows if r.measurement.prefill_tok_s and r.measurement.prompt_tokens]
    if prefill_rows:
        cases = []  # (row, scenario, layout table): the bytes do not depend on the profile, so built once
        for r in prefill_rows:
            sc = replace(scenario_of(r, best), prompt_tokens=r.measurement.prompt_tokens)
            if ("table", id(r)) not in memo:
                memo["table", id(r)] = layout_table(sc.model, sc.plan, formats_bits(sc.formats, sc.model), sc.kv_bytes)
            cases.append((r, sc, memo["table", id(r)]))

        def prefill_ape(p: RuntimeProfile) -> float:
            return statistics.median(
                ape(prefill_speed(replace(sc, profile=p), table, hardware_of(sc.box, sc.link, p))["tok_per_s"],
                    r.measurement.prefill_tok_s)
                for r, sc, table in cases)

        best = min((replace(best, compute_efficiency=c) for c in COMPUTE_EFFICIENCY_GRID), key=prefill_ape)
    final = statistics.median(ape(decode_speed(scenario_of(r, best))[0], r.measurement.decode_tok_s) for r in rows)
    return replace(best, fitted_rows=len(rows), fit_median_ape=round(final, 2))


def leave_one_source_out(rows: list[ResolvedRow]) -> dict[str, float | None]:
    """Decode tok/s predicted for each row (by id) under its profile fitted, as ``fit_profile`` fits,
    on the other sources' rows only (a source: the page the row was published on), so no fit sees
    the rows it predicts. Unfitted profiles predict as they are; None where no other source has rows
    of the row's profile to fit on."""
    profiles = load_profiles()
    out: dict[str, float | None] = {}
    memos: dict[str, dict] = {}  # per profile: each row's grid and prefill layout, computed once for all folds
    for source in sorted({r.measurement.source for r in rows}):
        fitted: dict[str, RuntimeProfile | None] = {}
        for r in (r for r in rows if r.measurement.source == source):
            if r.profile not in FITTED:
                out[r.measurement.id] = decode_speed(scenario_of(r, profiles[r.profile]))[0]
                continue
            if r.profile not in fitted:
                train = [t for t in rows if t.measurement.source != source and t.profile == r.profile]
                memo = memos.setdefault(r.profile, {})
                fitted[r.profile] = fit_profile(profiles[r.profile], train, memo) if train else None
            profile = fitted[r.profile]
            out[r.measurement.id] = None if profile is None else decode_speed(scenario_of(r, profile))[0]
    return out


def calibrate(path: str | Path = DEFAULT_CSV) -> dict[str, RuntimeProfile]:
    """Fitted profiles (the unfitted ones unchanged), by name."""
    profiles = load_profiles()
    rows = [r for r in (resolve(m) for m in read_measurements(path)) if not isinstance(r, str) and r.batch == 1]
    out = dict(profiles)
    for name in FITTED:
        mine = [r for r in rows if r.profile == name]
        if mine:
            out[name] = fit_profile(profiles[name], mine)
    return out


def _toml_value(v) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def render_profiles(profiles: dict[str, RuntimeProfile], csv_name: str) -> str:
    """profiles.toml text for ``profiles``."""
    lines = [
        "# Runtime profiles: efficiency factors per inference runtime (see shardwise/perf/profiles.py).",
        f"# vllm, llama-cpp and mlx are fitted by `python -m shardwise.perf.calibrate` on {csv_name};",
        "# do not edit them by hand (tests/test_calibrate.py re-fits and compares).",
        "",
    ]
    for p in profiles.values():
        fitted = p.name in FITTED and p.fitted_rows
        source = (
            f"fitted on {p.fitted_rows} rows of {csv_name} (median APE {p.fit_median_ape}%)" if fitted else p.source
        )
        lines += [
            f"[{p.name}]",
            f"description = {_toml_value(p.description)}",
            f"mem_efficiency = {p.mem_efficiency!r}",
            f"compute_efficiency = {p.compute_efficiency!r}",
            f"step_overhead_s = {p.step_overhead_s!r}",
            f"collective_overhead_s = {p.collective_overhead_s!r}",
            f"layer_overhead_s = {p.layer_overhead_s!r}",
            f"allreduce = {_toml_value(list(p.allreduce))}",
        ]
        if p.tcp_message_overhead_s:
            lines += [f"tcp_message_overhead_s = {p.tcp_message_overhead_s!r}",
                      f"source_tcp_message_overhead_s = {_toml_value(p.source_tcp_message_overhead_s)}"]
        if fitted:
            lines += [f"fitted_rows = {p.fitted_rows}", f"fit_median_ape = {p.fit_median_ape!r}"]
        lines += [f"source = {_toml_value(source)}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Fit and rewrite the bundled profiles.toml (``python -m shardwise.perf.calibrate [CSV]``)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0].startswith("-"):
        raise SystemExit("usage: python -m shardwise.perf.calibrate [measurements.csv]  (refits profiles.toml)")
    path = Path(args[0]) if args else DEFAULT_CSV
    try:
        fitted = calibrate(path)
    except ShardwiseError as exc:
        raise SystemExit(f"error: {exc}") from None
    target = resources.files("shardwise.spec.catalog").joinpath("profiles.toml")
    Path(str(target)).write_text(render_profiles(fitted, "data/measurements.csv"))
    for p in fitted.values():
        print(f"{p.name:10s} mem {p.mem_efficiency:.3f} compute {p.compute_efficiency:.1f} "
              f"step {p.step_overhead_s * 1e3:.2f} ms layer {p.layer_overhead_s * 1e6:.0f} us "
              f"coll {p.collective_overhead_s * 1e6:.0f} us "
              f"rows {p.fitted_rows} median APE {p.fit_median_ape}")


if __name__ == "__main__":
    main()

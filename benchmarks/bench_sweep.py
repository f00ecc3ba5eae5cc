"""Speed of the sweep: configurations per second of the vectorized core, and the wall time of a
sweep of at least 1 M configurations (every catalog model, box and link, 1..N boxes).

    PYTHONPATH=src python benchmarks/bench_sweep.py [--max-boxes 256]

Not a unit test: prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from shardwise.perf import core, grid
from shardwise.perf.estimate import formats_bits
from shardwise.perf.configurations import enumerate_layouts
from shardwise.perf.sweep import run_sweep
from shardwise.perf.profiles import get_profile
from shardwise.perf.scenario import build_request
from shardwise.spec.hardware import load_catalog
from shardwise.spec.parse import load_model

GB = 1e9


def core_rate(model_name: str, max_boxes: int, repeats: int = 5, batches=1) -> tuple[int, float]:
    """(configurations per evaluate call, seconds per call) on layouts × boxes × links of one model
    (× batch sizes when ``batches`` is a sequence)."""
    catalog = load_catalog()
    boxes, links = list(catalog.boxes.values()), list(catalog.links.values())
    model = load_model(model_name)
    plans = enumerate_layouts(model, tuple(range(1, max_boxes + 1)))
    table = core.build_layout_table(model, plans, formats_bits(model.group_formats(), model))
    prof = get_profile("vllm")
    layout = np.arange(len(plans))[:, None, None]
    bw = np.array([b.memory_bandwidth_gbps * GB for b in boxes])[None, :, None]
    peak = np.array([b.tflops_bf16 * 1e12 for b in boxes])[None, :, None]
    mem = np.array([b.memory_gb * GB for b in boxes])[None, :, None]
    alpha = np.array([lk.latency_s for lk in links])[None, None, :]
    beta = np.array([lk.bandwidth_gbps * GB for lk in links])[None, None, :]
    net = np.array([lk.kind in ("tcp", "rdma") for lk in links])[None, None, :]
    hw = core.Hardware(bw, peak, alpha, beta, network=net)
    grid.evaluate(model, table, layout, hw, mem, 4096, profile=prof, batch=batches)  # warm caches
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = grid.evaluate(model, table, layout, hw, mem, 4096, profile=prof, batch=batches)
    seconds = (time.perf_counter() - t0) / repeats
    return int(out["tok_per_s"].size), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-boxes", type=int, default=256)
    args = parser.parse_args()

    for name in ("kimi-k3", "llama-3.1-70b"):
        n, s = core_rate(name, args.max_boxes)
        print(f"core evaluate, {name}: {n:,} configurations (layouts x boxes x links) in {s * 1e3:.1f} ms "
              f"= {n / s / 1e6:.2f} M configurations/s")
        batches = (1, 2, 4, 8, 16, 32, 64, 128)
        n, s = core_rate(name, args.max_boxes, batches=batches)
        print(f"core evaluate, {name}, batch {batches[0]}..{batches[-1]} as a dimension: {n:,} configurations "
              f"in {s * 1e3:.1f} ms = {n / s / 1e6:.2f} M configurations/s")

    req = build_request(max_boxes=args.max_boxes)
    t0 = time.perf_counter()
    result = run_sweep(req)
    wall = time.perf_counter() - t0
    print(f"full sweep, {len(req.models)} models x {len(req.boxes)} boxes x {len(req.links)} links x 1..{args.max_boxes} "
          f"boxes x layouts x quantizations: {result.configurations:,} configurations in {wall:.2f} s wall "
          f"({result.configurations / wall / 1e6:.2f} M/s end to end; {result.fitting:,} fit, "
          f"{len(result.rows)} on the fronts)")
    t0 = time.perf_counter()
    result = run_sweep(build_request(max_boxes=args.max_boxes, prefill=True))
    wall = time.perf_counter() - t0
    print(f"same with --prefill: {result.configurations:,} configurations in {wall:.2f} s wall ({len(result.rows)} on the fronts)")


if __name__ == "__main__":
    main()

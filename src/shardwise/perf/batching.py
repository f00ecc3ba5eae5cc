"""Decode at batch > 1: what the batch changes in a step, where decode turns compute-bound, and
the concurrency curve (per-sequence and aggregate tok/s for B = 1 … max_batch).

A step of B sequences reads every weight once for all of them, the union of the experts their
tokens picked (uniform routing: E·(1 − (1 − k/E)^B) per MoE layer, the busiest expert-parallel
rank more), and each sequence's own cache; compute and collective messages grow with B.
Per-sequence speed falls as B grows while aggregate speed rises until the step turns
compute-bound (or the caches fill the memory: ``memory.max_batch``).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.perf.decode import StepCost
from shardwise.perf.imbalance import load_percentiles

CURVE_DENSE_UP_TO = 32  # every batch size up to this, then doublings, then max_batch


def batch_figures(sc, final: StepCost, single_tok_per_s: float, tok_per_s: float) -> dict:
    """What batching ``sc.batch`` sequences does to the final step, for the plan document."""
    b, m = sc.batch, sc.model
    positions = sc.spec_tokens + 1
    out = {
        "batch": b, "tok_per_s": tok_per_s, "aggregate_tok_per_s": b * tok_per_s,
        "single_sequence_tok_per_s": single_tok_per_s, "compute_bound": final.compute_s > final.memory_s,
        "experts_busiest_rank": None,
    }
    experts = ""
    if m.moe is not None:
        mc = load_percentiles(m.moe.num_experts, m.moe.top_k, sc.plan.ep, tokens=b * positions, samples=2000)
        out["experts_busiest_rank"] = {"expected": final.experts_busiest, "average": final.experts_average,
                                       "monte_carlo_mean": mc["mean"], "p99": mc["p99"]}
        experts = (f"; the busiest rank reads {final.experts_busiest:.2f} distinct experts per MoE layer "
                   f"(p99 {mc['p99']:.0f}) for {b * positions} tokens")
    out["cause"] = (f"{b} sequences per step: {b} x {tok_per_s:.2f} = {b * tok_per_s:.2f} tok/s in all "
                    f"(1 sequence: {single_tok_per_s:.2f}); weights read once per step{experts}; "
                    + ("compute-bound" if out["compute_bound"] else "still memory-bound"))
    return out


def crossover_batch(step_at: Callable[[int], StepCost], most: int) -> int | None:
    """Smallest batch in 1..``most`` whose step is compute-bound (compute > memory seconds), by
    bisection (the ratio grows with the batch: compute is linear in it, reads sublinear); None
    when the step stays memory-bound up to ``most``."""
    if most < 1 or not _compute_bound(step_at(most)):
        return None
    lo, hi = 0, most  # step_at(lo) memory-bound (0: nothing), step_at(hi) compute-bound
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _compute_bound(step_at(mid)) else (mid, hi)
    return hi


def _compute_bound(step: StepCost) -> bool:
    return step.compute_s > step.memory_s


def curve_batches(most: int) -> list[int]:
    """Batch sizes of the concurrency curve: every size up to ``CURVE_DENSE_UP_TO``, then
    doublings, then ``most`` itself."""
    sizes = list(range(1, min(most, CURVE_DENSE_UP_TO) + 1))
    b = CURVE_DENSE_UP_TO * 2
    while b < most:
        sizes.append(b)
        b *= 2
    if most > CURVE_DENSE_UP_TO:
        sizes.append(most)
    return sizes


def batch_curve(speed_at: Callable[[int], tuple[float, StepCost]], most: int) -> list[dict]:
    """Per-sequence and aggregate tok/s (and whether the step is compute-bound) at each batch of
    ``curve_batches(most)``; ``speed_at(b)`` gives (tok/s per sequence, final step)."""
    rows = []
    for b in curve_batches(most):
        tok, step = speed_at(b)
        rows.append({"batch": b, "tok_per_s": tok, "aggregate_tok_per_s": b * tok, "step_s": step.total_s,
                     "compute_bound": _compute_bound(step)})
    return rows

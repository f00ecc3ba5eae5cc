"""Memory fit per box: weights at their real bits/weight, KV cache at the target context,
workspace, and an OS/runtime reserve.

Reserve: a fraction of each box's memory is kept for the OS, the runtime and fragmentation
(default 10%, the headroom vLLM leaves at its default ``gpu_memory_utilization = 0.9``).
Workspace: activations and logits of one prefill chunk (``core.PREFILL_CHUNK_TOKENS``) in fp32.
Weights, cache and workspace per rank come from the cost core (``perf.core``).
Replicated: bytes every box holds whole besides its shard (a speculative draft model's
weights and cache: the runtime runs the drafter on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardwise.perf import core
from shardwise.plan import ParallelPlan, default_plan, valid_tp_degrees
from shardwise.spec.model import ModelSpec

DEFAULT_RESERVE_FRACTION = 0.10
GB = 1e9
LAYOUT_SEARCH_MAX_BOXES = 4096  # the fewest-boxes search stops here (a batch of 1e6 asked for ~1e6 boxes)


@dataclass(frozen=True)
class MemoryFit:
    """Bytes per box (the fullest rank) and box counts."""

    box_bytes: float
    weights_bytes: float  # fullest rank's weights
    kv_bytes: float  # fullest rank's cache at the target context
    workspace_bytes: float
    reserve_bytes: float
    replicated_bytes: float  # held whole on every box (draft model weights + cache)
    total_weight_bytes: float  # whole model at its formats
    min_boxes_weights: int  # weights alone over box memory (less replicated bytes), no reserves
    min_boxes: int  # weights + cache + workspace + reserve, split evenly
    min_boxes_layout: int | None  # smallest count whose default layout fits (None: none up to layout_search_max)
    fits: bool
    batch: int = 1  # sequences whose caches ``kv_bytes`` holds
    max_batch: int = 0  # most sequences of the context whose caches fit beside the weights
    layout_search_max: int = 0  # the most boxes the min_boxes_layout search tried

    @property
    def used_bytes(self) -> float:
        """Bytes the fullest rank needs."""
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.reserve_bytes + self.replicated_bytes

    @property
    def free_bytes(self) -> float:
        """Bytes left on the fullest box (negative when it does not fit)."""
        return self.box_bytes - self.used_bytes


def total_weight_bytes(model: ModelSpec, formats_bits: dict[str, float]) -> float:
    """Bytes of the whole model at its formats."""
    return model.weight_bytes(formats_bits)


def rank_weight_bytes(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], rank: int) -> float:
    """Bytes of weights rank ``rank`` holds (the cost core's stage weights)."""
    table = core.build_layout_table(model, [plan], formats_bits)
    return float(table.stage_weights_bytes[0, rank // plan.tp])


def rank_group_bytes(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], rank: int) -> dict[str, float]:
    """Bytes of weights rank ``rank`` holds per tensor group (biases of packed groups unpacked)."""
    table = core.build_layout_table(model, [plan], formats_bits)
    return core.stage_group_bytes(table, formats_bits, 0, rank // plan.tp)


def rank_cache_bytes(model: ModelSpec, plan: ParallelPlan, context_tokens: int, kv_bytes: float, rank: int,
                     step_tokens: int = 1) -> float:
    """Cache bytes rank ``rank`` holds for one sequence of ``context_tokens`` (the mixer table's
    figures per layer of its stage: see ``shardwise.spec.mixers``; ``step_tokens``: positions one
    step writes, k+1 with k speculative drafts, which sliding-window rings hold beyond the window)."""
    table = core.build_layout_table(model, [plan], {g: 0.0 for g in model.params_by_group}, kv_bytes)
    return float(core.stage_bytes(table, context_tokens, step_tokens)[1][0, rank // plan.tp])


def _fullest_rank(table: core.LayoutTable, context_tokens: int, step_tokens: int,
                  batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(weights, cache of ``batch`` sequences) of each layout's fullest rank (bytes, per layout)."""
    weights, cache = core.stage_bytes(table, context_tokens, step_tokens, batch)
    stage = np.argmax(weights + cache, axis=1)[:, None]
    return np.take_along_axis(weights, stage, 1)[:, 0], np.take_along_axis(cache, stage, 1)[:, 0]


def _first_fitting_count(model, formats_bits, context_tokens, kv_bytes, box_bytes, reserve_fraction,
                         replicated_bytes, step_tokens: int, batch: int, lowest: int, highest: int) -> int | None:
    """Smallest box count in [lowest, highest] whose default layout fits: counts priced a block at
    a time (8, then doubling), each block in one table, so the usual answer near ``lowest`` costs
    one small table however far ``highest`` is."""
    tps = valid_tp_degrees(model)
    start, block = lowest, 8
    while start <= highest:
        counts = [n for n in range(start, min(start + block, highest + 1)) if any(n % t == 0 for t in tps)]
        if counts:
            table = core.build_layout_table(model, [default_plan(model, n) for n in counts], formats_bits, kv_bytes)
            w, kv = _fullest_rank(table, context_tokens, step_tokens, batch)
            used = w + kv + table.counts.workspace_bytes + reserve_fraction * box_bytes + replicated_bytes
            fitting = np.flatnonzero(used <= box_bytes)
            if len(fitting):
                return counts[int(fitting[0])]
        start, block = start + block, block * 2
    return None


def memory_fit(
    model: ModelSpec,
    plan: ParallelPlan,
    formats_bits: dict[str, float],
    context_tokens: int,
    kv_bytes: float,
    box_bytes: float,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    replicated_bytes: float = 0.0,
    step_tokens: int = 1,
    batch: int = 1,
) -> MemoryFit:
    """Per-box memory of ``plan`` with the caches of ``batch`` sequences and the minimum box
    counts for this model on this box (``replicated_bytes``: held whole on every box, e.g. a
    draft model; ``step_tokens``: positions one step writes, k+1 with k drafts)."""
    table = core.build_layout_table(model, [plan], formats_bits, kv_bytes)
    w, kv = (float(x[0]) for x in _fullest_rank(table, context_tokens, step_tokens, batch))
    work = float(table.counts.workspace_bytes[0])
    reserve = reserve_fraction * box_bytes
    total = total_weight_bytes(model, formats_bits)
    room = box_bytes - replicated_bytes
    min_weights = math.ceil(total / room) if room > 0 else 0
    whole_cache = batch * model.cache_bytes(context_tokens, kv_bytes)
    usable = room - reserve - work
    min_boxes = math.ceil((total + whole_cache) / usable) if usable > 0 else 0
    search_max = min(max(4 * max(min_boxes, 1), 64), LAYOUT_SEARCH_MAX_BOXES)
    layout_count = _first_fitting_count(model, formats_bits, context_tokens, kv_bytes, box_bytes, reserve_fraction,
                                        replicated_bytes, step_tokens, batch, max(min_boxes, 1), search_max)
    most = core.max_batch(table, context_tokens, box_bytes - reserve - work - replicated_bytes, step_tokens)
    return MemoryFit(
        box_bytes=box_bytes, weights_bytes=w, kv_bytes=kv, workspace_bytes=work, reserve_bytes=reserve,
        replicated_bytes=replicated_bytes, total_weight_bytes=total, min_boxes_weights=min_weights,
        min_boxes=min_boxes, min_boxes_layout=layout_count,
        fits=w + kv + work + reserve + replicated_bytes <= box_bytes, batch=batch, max_batch=int(most[0]),
        layout_search_max=search_max,
    )

"""Memory fit per box: weights at their real bits/weight, KV cache at the target context,
workspace, and an OS/runtime reserve.

Reserve: a fraction of each box's memory is kept for the OS, the runtime and fragmentation
(default 10%, the headroom vLLM leaves at its default ``gpu_memory_utilization = 0.9``).
Workspace: activations and logits of one prefill chunk (2048 tokens) in fp32.
Replicated: bytes every box holds whole besides its shard (a speculative draft model's
weights and cache: the runtime runs the drafter on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.plan import ParallelPlan, default_plan, rank_param_counts, valid_tp_degrees
from shardwise.spec.model import ModelSpec

DEFAULT_RESERVE_FRACTION = 0.10
PREFILL_CHUNK_TOKENS = 2048
GB = 1e9


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
    min_boxes_layout: int | None  # smallest count whose default layout fits
    fits: bool

    @property
    def used_bytes(self) -> float:
        """Bytes the fullest rank needs."""
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.reserve_bytes + self.replicated_bytes

    @property
    def free_bytes(self) -> float:
        """Bytes left on the fullest box (negative when it does not fit)."""
        return self.box_bytes - self.used_bytes


def weight_bytes(counts: dict[str, int], formats_bits: dict[str, float]) -> float:
    """Bytes of parameter counts per group at each group's bits/weight."""
    return sum(n * formats_bits[g] / 8 for g, n in counts.items())


def total_weight_bytes(model: ModelSpec, formats_bits: dict[str, float]) -> float:
    """Bytes of the whole model at its formats."""
    return weight_bytes(model.params_by_group, formats_bits)


def rank_weight_bytes(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], rank: int) -> float:
    """Bytes of weights rank ``rank`` holds."""
    return weight_bytes(rank_param_counts(model, plan, rank), formats_bits)


def rank_cache_bytes(model: ModelSpec, plan: ParallelPlan, context_tokens: int, kv_bytes: float, rank: int) -> float:
    """Cache bytes rank ``rank`` holds for one sequence of ``context_tokens``.

    GQA heads split by TP (replicated when fewer KV heads than ranks); MLA's latent cache is
    replicated on every TP rank; sliding layers cap at their window; linear layers hold a
    constant fp32 state split by heads.
    """
    stage_layers = plan.stage_layers(model.num_layers, rank // plan.tp)
    total = 0.0
    for i in stage_layers:
        layer = model.layers[i]
        ctx = context_tokens if layer.window is None else min(context_tokens, layer.window)
        if layer.attention in ("gqa", "sliding", "gated_attention"):
            total += 2 * max(model.num_kv_heads // plan.tp, 1) * model.head_dim * kv_bytes * ctx
        elif layer.attention in ("mla", "gated_mla"):
            assert model.mla is not None
            total += (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes * ctx
        else:
            la = model.linear_attention
            assert la is not None
            state = la.num_value_heads * la.key_head_dim * la.value_head_dim
            conv = (la.conv_kernel - 1) * (2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim)
            total += (state + conv) * 4.0 / plan.tp
    return total


def workspace_bytes(model: ModelSpec, plan: ParallelPlan) -> float:
    """Activation and logits buffers for one prefill chunk (fp32), per rank."""
    width = 8 * model.hidden_size + model.vocab_size // plan.tp
    return PREFILL_CHUNK_TOKENS * width * 4.0


def _fullest_rank(model: ModelSpec, plan: ParallelPlan, formats_bits, context_tokens, kv_bytes) -> tuple[float, float]:
    best = (0.0, 0.0)
    for stage in range(plan.pp):
        rank = stage * plan.tp
        w = rank_weight_bytes(model, plan, formats_bits, rank)
        kv = rank_cache_bytes(model, plan, context_tokens, kv_bytes, rank)
        if w + kv > sum(best):
            best = (w, kv)
    return best


def fits(model, plan, formats_bits, context_tokens, kv_bytes, box_bytes, reserve_fraction, replicated_bytes=0.0) -> bool:
    """True when the fullest rank's weights, cache, workspace, reserve and replicated bytes fit in ``box_bytes``."""
    w, kv = _fullest_rank(model, plan, formats_bits, context_tokens, kv_bytes)
    return w + kv + workspace_bytes(model, plan) + reserve_fraction * box_bytes + replicated_bytes <= box_bytes


def memory_fit(
    model: ModelSpec,
    plan: ParallelPlan,
    formats_bits: dict[str, float],
    context_tokens: int,
    kv_bytes: float,
    box_bytes: float,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    replicated_bytes: float = 0.0,
) -> MemoryFit:
    """Per-box memory of ``plan`` and the minimum box counts for this model on this box
    (``replicated_bytes``: held whole on every box, e.g. a draft model)."""
    w, kv = _fullest_rank(model, plan, formats_bits, context_tokens, kv_bytes)
    work = workspace_bytes(model, plan)
    reserve = reserve_fraction * box_bytes
    total = total_weight_bytes(model, formats_bits)
    room = box_bytes - replicated_bytes
    min_weights = math.ceil(total / room) if room > 0 else 0
    whole_cache = model.cache_bytes(context_tokens, kv_bytes)
    usable = room - reserve - work
    min_boxes = math.ceil((total + whole_cache) / usable) if usable > 0 else 0
    layout_count = None
    limit = max(4 * max(min_boxes, 1), 64)
    for n in range(max(min_boxes, 1), limit + 1):
        if not any(n % t == 0 for t in valid_tp_degrees(model)):
            continue
        candidate = default_plan(model, n)
        if fits(model, candidate, formats_bits, context_tokens, kv_bytes, box_bytes, reserve_fraction, replicated_bytes):
            layout_count = n
            break
    return MemoryFit(
        box_bytes=box_bytes, weights_bytes=w, kv_bytes=kv, workspace_bytes=work, reserve_bytes=reserve,
        replicated_bytes=replicated_bytes, total_weight_bytes=total, min_boxes_weights=min_weights,
        min_boxes=min_boxes, min_boxes_layout=layout_count,
        fits=w + kv + work + reserve + replicated_bytes <= box_bytes,
    )

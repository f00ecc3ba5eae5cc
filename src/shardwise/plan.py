"""ParallelPlan: how a model is cut across ranks, validated up front.

Layout semantics (shared by the planner's byte counts and the runtime's loader):
- ``world = tp · pp`` ranks; a rank's stage is ``rank // tp`` and its tensor rank ``rank % tp``.
- Non-expert tensors: split on ``TensorSpec.tp_dim`` in whole units (heads); when a tensor has
  fewer units than ``tp`` (e.g. 8 KV heads at tp 16) each rank holds one unit, unit index
  ``tp_rank // (tp / units)`` (replication). Tensors with ``tp_dim`` None are replicated.
- Routed experts: ``ep`` divides ``tp``; expert-tensor-parallel degree ``etp = tp / ep``.
  Tensor rank r belongs to expert group ``r // etp``, owning experts
  ``[g·E/ep, (g+1)·E/ep)``, and holds slice ``r % etp`` of each owned expert on ``tp_dim``.
- Pipeline: layers split into ``pp`` contiguous stages (earlier stages take the remainder);
  the embedding lives on stage 0, the final norm and LM head on the last stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shardwise.errors import ShardwiseError
from shardwise.quant.formats import get_format
from shardwise.spec.model import EMBEDDING, ModelSpec, TensorSpec



@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of tensor (tp), expert (ep) and pipeline (pp) parallelism, and the rank order.

    rank_order: box index for each rank (rank i runs on box rank_order[i]); None = listed order.
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    rank_order: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        """Number of ranks (one per box)."""
        return self.tp * self.pp

    @property
    def etp(self) -> int:
        """Tensor-parallel degree inside each expert (tp / ep)."""
        return self.tp // self.ep

    def describe(self) -> str:
        """Short label like 'TP16 EP16' or 'TP4 PP2'."""
        parts = [f"TP{self.tp}"]
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        return " ".join(parts)

    # ---- stages ------------------------------------------------------------------------
    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Layer indices of pipeline ``stage``."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: int, candidates: list[int]) -> int:
    return min(candidates, key=lambda c: (abs(c - value), -c))


def valid_tp_degrees(model: ModelSpec) -> list[int]:
    """TP degrees the model accepts (``tp_problem`` finds nothing)."""
    splits = _split_tensors(model)
    return [tp for tp in range(1, model.num_heads + 1) if _tp_problem(model, tp, splits) is None]


def _split_tensors(model: ModelSpec) -> list[TensorSpec]:
    """The non-expert tensors TP splits into whole units (one layer per structure, and the
    globals); padded (vocabulary) tensors need no whole cut."""
    return [t for t in model.distinct_tensors if t.tp_dim is not None and not t.is_routed and not t.tp_pad]


def _tp_problem(model: ModelSpec, tp: int, splits: list[TensorSpec]) -> str | None:
    """Why ``tp`` cannot cut ``model``, or None: attention heads must divide (KV heads divide or
    replicate), linear-attention value heads divide (key heads divide or replicate), and every
    other TP-split tensor is cut into whole units (heads, channels) or replicated."""
    if model.num_heads % tp:
        return f"{model.num_heads} attention heads"
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        return f"{kv} KV heads"
    la = model.linear_attention
    if la is not None and la.num_value_heads % tp:
        return f"{la.num_value_heads} {la.value_heads_name}"
    replicable = la is not None and (la.key_heads_replicate or la.num_key_heads == 1)  # fewer key heads than ranks
    if la is not None and la.num_key_heads % tp and (tp % la.num_key_heads or not replicable):
        return f"{la.num_key_heads} {la.key_heads_name}"
    for t in splits:
        for length, unit in t.tp_parts or ((t.shape[t.tp_dim], t.tp_unit),):
            units = length // unit
            if units % tp and not (units < tp and tp % units == 0):
                return f"{units} {'units of ' + str(unit) if unit > 1 else 'rows'} of '{t.name}'"
    return None


def validate_plan(model: ModelSpec, plan: ParallelPlan, formats: Mapping[str, str] | None = None) -> None:
    """Raise a one-line ShardwiseError naming the nearest valid layout when ``plan`` cannot cut ``model``.

    The one validity check ``plan``, ``sweep`` and ``run`` share: degrees >= 1; attention, KV and
    linear-attention heads divisible by tp (KV heads may replicate); experts divisible by ep,
    ep dividing tp and the expert intermediate size divisible by tp/ep; no more stages than
    layers; a rank order that is a permutation; and routed experts stored in a block format
    (``formats``, default the checkpoint's: MXFP4, NVFP4, int4 groups stay packed in memory)
    never cut inside a block. The vocabulary needs no check: it is padded to a multiple of tp.
    """
    for name, value in (("tp", plan.tp), ("ep", plan.ep), ("pp", plan.pp)):
        if value < 1:
            raise ShardwiseError(f"--{name} must be >= 1, got {value}")
    problem = _tp_problem(model, plan.tp, _split_tensors(model)) if plan.tp <= model.num_heads else "its heads"
    if problem is not None:
        tps = valid_tp_degrees(model)
        raise ShardwiseError(
            f"--tp {plan.tp} does not divide {model.name}'s {problem}: nearest valid is --tp "
            f"{_nearest(plan.tp, tps)} (valid: {', '.join(map(str, tps))})"
        )
    if plan.ep > 1 and model.moe is None:
        raise ShardwiseError(f"--ep {plan.ep} needs routed experts but {model.name} is dense: use --ep 1")
    if plan.tp % plan.ep:
        near = _nearest(plan.ep, _divisors(plan.tp))
        raise ShardwiseError(f"--ep {plan.ep} must divide --tp {plan.tp}: nearest valid is --ep {near}")
    if model.moe is not None and model.moe.num_experts % plan.ep:
        options = [d for d in _divisors(plan.tp) if model.moe.num_experts % d == 0]
        raise ShardwiseError(
            f"--ep {plan.ep} does not divide {model.moe.num_experts} experts: nearest valid is --ep {_nearest(plan.ep, options)}"
        )
    if model.moe is not None and plan.etp > 1:
        inter = model.moe.intermediate_size
        if inter % plan.etp:
            raise ShardwiseError(
                f"expert intermediate size {inter} is not divisible by tp/ep = {plan.etp}: use --ep {plan.tp}"
            )
    if plan.pp > model.num_layers:
        raise ShardwiseError(f"--pp {plan.pp} exceeds {model.name}'s {model.num_layers} layers: use --pp {model.num_layers} or fewer")
    if plan.rank_order is not None and sorted(plan.rank_order) != list(range(plan.world_size)):
        raise ShardwiseError(
            f"rank order {list(plan.rank_order)} must be a permutation of 0..{plan.world_size - 1}"
        )
    _check_packed_blocks(model, plan, formats if formats is not None else model.group_formats())


def _check_packed_blocks(model: ModelSpec, plan: ParallelPlan, formats: Mapping[str, str]) -> None:
    """Weights in a 1-D block format that stay packed (routed experts; every group held as
    weight-only int): a rank's slice of their inputs must hold whole blocks (groups)."""
    for tensor in model.distinct_tensors:
        fmt = get_format(formats.get(tensor.group, model.dtype))
        routed = tensor.is_routed and model.moe is not None and plan.etp > 1
        if not fmt.packed or not (routed or (fmt.weight_only_int and not tensor.is_routed and plan.tp > 1)):
            continue
        if len(tensor.shape) - (tensor.expert_dim is not None) < 2:
            continue
        full, local = tensor.shape[-1], shard_shape(tensor, plan, 0)[-1]
        if full % fmt.block_size == 0 and local % fmt.block_size:
            raise ShardwiseError(
                f"{fmt.name} tensor '{tensor.name}' would be split into {local}-element slices of its {full} "
                f"inputs at --tp {plan.tp} --ep {plan.ep}, expected a multiple of {fmt.block_size} (whole blocks): "
                + (f"use --ep {plan.tp}" if routed else "use a smaller --tp, or quantize with a smaller --group-size")
            )


def is_valid_plan(model: ModelSpec, plan: ParallelPlan, formats: Mapping[str, str] | None = None) -> bool:
    """True when ``validate_plan`` accepts ``plan``."""
    try:
        validate_plan(model, plan, formats)
    except ShardwiseError:
        return False
    return True


def default_plan(model: ModelSpec, boxes: int) -> ParallelPlan:
    """The layout a vLLM user would pick on ``boxes`` boxes: the largest valid TP that divides
    the box count, experts split over all TP ranks (EP = TP) when the experts allow, PP for the rest."""
    tps = [t for t in valid_tp_degrees(model) if boxes % t == 0]
    tp = max(tps) if tps else 1
    return ParallelPlan(tp=tp, ep=default_ep(model, tp), pp=boxes // tp)


def default_ep(model: ModelSpec, tp: int) -> int:
    """Experts spread over all ``tp`` ranks when they divide evenly, else the largest divisor of
    ``tp`` that divides the expert count (1 for dense models)."""
    if model.moe is None:
        return 1
    return max(d for d in _divisors(tp) if model.moe.num_experts % d == 0)


# ---- shards --------------------------------------------------------------------------------


def shard_shape(tensor: TensorSpec, plan: ParallelPlan, tp_rank: int) -> tuple[int, ...]:
    """Shape of ``tensor``'s slice on tensor rank ``tp_rank`` (one expert's copy for templates;
    the expert dimension already cut for fused expert tensors)."""
    shape = list(tensor.shape)
    if tensor.is_routed:
        if tensor.expert_dim is not None:
            shape[tensor.expert_dim] //= plan.ep
        if tensor.tp_dim is not None and plan.etp > 1:
            shape[tensor.tp_dim] = shape[tensor.tp_dim] // plan.etp
        return tuple(shape)
    if tensor.tp_dim is not None and plan.tp > 1:
        shape[tensor.tp_dim] = tensor.tp_shard_len(plan.tp)
    return tuple(shape)


def shard_slice(tensor: TensorSpec, plan: ParallelPlan, tp_rank: int) -> tuple[int, int] | None:
    """(start, stop) along ``tp_dim`` held by ``tp_rank``, or None when the tensor is not cut by TP."""
    if tensor.tp_dim is None:
        return None
    full = tensor.shape[tensor.tp_dim]
    if tensor.is_routed:
        if plan.etp == 1:
            return None
        size = full // plan.etp
        start = (tp_rank % plan.etp) * size
        return start, start + size
    if plan.tp == 1:
        return None
    units = full // tensor.tp_unit
    size = tensor.tp_shard_len(plan.tp)
    if units >= plan.tp:
        start = tp_rank * size
    else:
        start = (tp_rank // (plan.tp // units)) * tensor.tp_unit
    return start, min(start + size, full)  # a padded (tp_pad) slice may end past the tensor


def shard_spans(tensor: TensorSpec, plan: ParallelPlan, tp_rank: int) -> list[tuple[int, int]]:
    """(start, stop) ranges along ``tp_dim`` that ``tp_rank`` holds, in order: one per part of a
    fused tensor (``tp_parts``, each cut like a tensor of its own), else ``shard_slice``'s range
    (the whole dimension when TP does not cut it)."""
    if not tensor.tp_parts:
        cut = shard_slice(tensor, plan, tp_rank)
        return [cut if cut is not None else (0, tensor.shape[tensor.tp_dim])]
    spans, offset = [], 0
    for length, unit in tensor.tp_parts:
        part = TensorSpec(tensor.name, (length,), tensor.group, tp_dim=0, tp_unit=unit)
        cut = shard_slice(part, plan, tp_rank)
        start, stop = cut if cut is not None else (0, length)
        spans.append((offset + start, offset + stop))
        offset += length
    return spans


def local_experts(num_experts: int, plan: ParallelPlan, tp_rank: int) -> range:
    """Routed experts owned by ``tp_rank``."""
    per = num_experts // plan.ep
    group = tp_rank // plan.etp
    return range(group * per, (group + 1) * per)


def stage_globals(model: ModelSpec, plan: ParallelPlan, stage: int) -> list[TensorSpec]:
    """The non-layer tensors pipeline ``stage`` holds: the embedding on the first stage, the final
    norm and LM head on the last (the tied embedding there too)."""
    last = stage == plan.pp - 1
    return [
        t for t in model.globals
        if (t.group == EMBEDDING and (stage == 0 or (last and model.tie_word_embeddings)))
        or (t.group != EMBEDDING and last)
    ]


def rank_tensors(model: ModelSpec, plan: ParallelPlan, rank: int) -> list[TensorSpec]:
    """The tensors rank ``rank`` holds (its stage's layers plus its stage's globals)."""
    stage = rank // plan.tp
    out = stage_globals(model, plan, stage)
    for i in plan.stage_layers(model.num_layers, stage):
        out.extend(model.layers[i].tensors)
    return out


def held_numel(tensor: TensorSpec, plan: ParallelPlan) -> int:
    """Elements of ``tensor`` one tensor rank holds: its shard, times its local experts for
    per-expert templates (fused expert tensors have the expert dimension already cut)."""
    n = math.prod(shard_shape(tensor, plan, 0))
    if tensor.is_routed and tensor.expert_dim is None:
        n *= tensor.experts // plan.ep
    return n


def picked_expert_numel(tensor: TensorSpec, plan: ParallelPlan) -> int:
    """Elements of one routed expert's shard of ``tensor`` (what one picked expert reads)."""
    shape = shard_shape(tensor, plan, 0)
    n = math.prod(shape)
    return n if tensor.expert_dim is None else n // shape[tensor.expert_dim]


def _tensor_counts(tensors, plan: ParallelPlan, counts: dict[str, int]) -> None:
    for t in tensors:
        counts[t.group] = counts.get(t.group, 0) + held_numel(t, plan)


def rank_param_counts(model: ModelSpec, plan: ParallelPlan, rank: int) -> dict[str, int]:
    """Parameters (elements) rank ``rank`` holds, per tensor group (equal on every rank of a stage)."""
    stage = rank // plan.tp
    counts: dict[str, int] = {}
    _tensor_counts(stage_globals(model, plan, stage), plan, counts)
    per_structure: dict[int, dict[str, int]] = {}
    for i in plan.stage_layers(model.num_layers, stage):
        sid = model.layer_structure[i]
        if sid not in per_structure:
            per_structure[sid] = {}
            _tensor_counts(model.layers[i].tensors, plan, per_structure[sid])
        for group, n in per_structure[sid].items():
            counts[group] = counts.get(group, 0) + n
    return counts

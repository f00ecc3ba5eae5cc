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
from dataclasses import dataclass

from shardwise.errors import ShardwiseError
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
    """TP degrees the model's heads accept (attention heads divisible; KV heads divisible or replicable)."""
    out = []
    for tp in range(1, model.num_heads + 1):
        if model.num_heads % tp:
            continue
        kv = model.num_kv_heads
        if kv % tp and tp % kv:
            continue
        la = model.linear_attention
        if la is not None and (la.num_value_heads % tp or la.num_key_heads % tp and tp % la.num_key_heads):
            continue
        out.append(tp)
    return out


def validate_plan(model: ModelSpec, plan: ParallelPlan) -> None:
    """Raise a one-line ShardwiseError naming the nearest valid layout when ``plan`` cannot cut ``model``."""
    for name, value in (("tp", plan.tp), ("ep", plan.ep), ("pp", plan.pp)):
        if value < 1:
            raise ShardwiseError(f"--{name} must be >= 1, got {value}")
    tps = valid_tp_degrees(model)
    if plan.tp not in tps:
        near = _nearest(plan.tp, tps)
        raise ShardwiseError(
            f"--tp {plan.tp} does not divide {model.name}'s {model.num_heads} attention heads / "
            f"{model.num_kv_heads} KV heads: nearest valid is --tp {near} (valid: {', '.join(map(str, tps))})"
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


def default_plan(model: ModelSpec, boxes: int) -> ParallelPlan:
    """The layout a vLLM user would pick on ``boxes`` boxes: the largest valid TP that divides
    the box count, experts split over all TP ranks (EP = TP) when the experts allow, PP for the rest."""
    tps = [t for t in valid_tp_degrees(model) if boxes % t == 0]
    tp = max(tps) if tps else 1
    ep = 1
    if model.moe is not None:
        ep = max(d for d in _divisors(tp) if model.moe.num_experts % d == 0)
    return ParallelPlan(tp=tp, ep=ep, pp=boxes // tp)


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
    return start, start + size


def local_experts(num_experts: int, plan: ParallelPlan, tp_rank: int) -> range:
    """Routed experts owned by ``tp_rank``."""
    per = num_experts // plan.ep
    group = tp_rank // plan.etp
    return range(group * per, (group + 1) * per)


def rank_tensors(model: ModelSpec, plan: ParallelPlan, rank: int) -> list[TensorSpec]:
    """The tensors rank ``rank`` holds (its stage's layers plus its stage's globals)."""
    stage = rank // plan.tp
    layers = plan.stage_layers(model.num_layers, stage)
    out: list[TensorSpec] = []
    last = stage == plan.pp - 1
    for t in model.globals:
        if t.group == EMBEDDING:
            if stage == 0 or (last and model.tie_word_embeddings):
                out.append(t)
        elif last:
            out.append(t)
    for i in layers:
        out.extend(model.layers[i].tensors)
    return out


def _tensor_counts(tensors, plan: ParallelPlan, tp_rank: int, counts: dict[str, int]) -> None:
    for t in tensors:
        n = math.prod(shard_shape(t, plan, tp_rank))
        if t.is_routed and t.expert_dim is None:
            n *= t.experts // plan.ep
        counts[t.group] = counts.get(t.group, 0) + n


def rank_param_counts(model: ModelSpec, plan: ParallelPlan, rank: int) -> dict[str, int]:
    """Parameters (elements) rank ``rank`` holds, per tensor group."""
    tp_rank = rank % plan.tp
    stage = rank // plan.tp
    last = stage == plan.pp - 1
    counts: dict[str, int] = {}
    globals_ = [
        t for t in model.globals
        if (t.group == EMBEDDING and (stage == 0 or (last and model.tie_word_embeddings)))
        or (t.group != EMBEDDING and last)
    ]
    _tensor_counts(globals_, plan, tp_rank, counts)
    per_structure: dict[int, dict[str, int]] = {}
    for i in plan.stage_layers(model.num_layers, stage):
        sid = model.layer_structure[i]
        if sid not in per_structure:
            per_structure[sid] = {}
            _tensor_counts(model.layers[i].tensors, plan, tp_rank, per_structure[sid])
        for group, n in per_structure[sid].items():
            counts[group] = counts.get(group, 0) + n
    return counts

"""Decode step time at batch 1: the slowest rank's memory/compute time per layer plus collectives.

Per layer and rank: ``t = max(bytes / (BW·eff_mem), flops / (peak·eff_compute))``; the layer
ends when the busiest rank finishes (the one holding the most picked experts) and its
collectives complete. A step over ``n`` positions (1 for plain decode, k+1 for a speculative
verify) reads every non-expert weight once, the distinct experts the ``n`` positions picked,
and the KV cache once; it costs the same number of collectives with ``n``-times larger messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardwise.perf import collectives
from shardwise.perf.imbalance import distinct_experts, expected_max_load_tokens
from shardwise.plan import ParallelPlan, shard_shape
from shardwise.spec.model import EMBEDDING, LM_HEAD, NORM, LayerSpec, ModelSpec

ACTIVATION_BYTES = 2  # bf16 activations on the wire
_COLLECTIVE_NAMES = {"ring": "ring", "rd": "recursive_doubling", "oneshot": "one_shot", "tree": "tree"}


@dataclass(frozen=True)
class LayerCost:
    """Per-layer quantities on the busiest rank (bytes, elements)."""

    index: int
    kind: str
    dense_bytes: float  # non-expert weight bytes one rank reads
    dense_numel: int  # non-expert matmul weights one rank multiplies
    expert_bytes: float  # bytes of one routed expert's shard
    expert_numel: int
    kv_bytes_per_token: float  # cache bytes per context token one rank reads (0 for linear layers)
    state_bytes: float  # constant recurrent state one rank reads and writes (linear layers)
    window: int | None
    attn_flops_per_ctx: float  # attention FLOPs per position per context token on one rank
    attn_flops_const: float  # context-independent attention FLOPs per position (linear layers)
    latent: bool  # latent MoE: an extra all-gather and reduce-scatter of the latent


@dataclass(frozen=True)
class Hardware:
    """What the step model needs of a box and its link (SI units)."""

    mem_bandwidth_bytes_per_s: float
    peak_flops: float
    link_alpha_s: float
    link_beta_bytes_per_s: float
    network: bool = True  # a network link (tcp/rdma) rather than NVLink/PCIe inside one host
    ring_allreduce_s: Callable[[float], float] | None = None  # ring cost on a real topology (seconds for n bytes)


@dataclass(frozen=True)
class StepCost:
    """One decode or verify step on the busiest rank path (seconds, bytes, FLOPs)."""

    positions: int
    memory_s: float
    compute_s: float
    layers_s: float  # sum over layers of max(memory, compute)
    collective_s: float
    overhead_s: float
    bytes_busiest: float  # bytes the busiest rank reads in the step (all stages)
    flops_busiest: float
    experts_busiest: float  # picked experts on the busiest rank per MoE layer
    experts_average: float
    allreduce_algorithm: str
    allreduce_s: float  # one all-reduce of the step's activation message
    collectives_per_step: int
    per_layer_s: tuple[float, ...]

    @property
    def total_s(self) -> float:
        """Seconds per step."""
        return self.layers_s + self.collective_s + self.overhead_s


def layer_costs(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], kv_bytes: float) -> list[LayerCost]:
    """Per-layer byte and FLOP figures for tensor rank 0 (TP shards are equal across ranks)."""
    out = []
    for layer in model.layers:
        dense_bytes = 0.0
        dense_numel = 0
        expert_bytes = 0.0
        expert_numel = 0
        for t in layer.tensors:
            shape = shard_shape(t, plan, 0)
            numel = 1
            for s in shape:
                numel *= s
            bits = formats_bits[t.group]
            if t.is_routed:
                per_expert = numel if t.expert_dim is None else numel // shape[t.expert_dim]
                expert_bytes += per_expert * bits / 8
                if len(t.shape) - (t.expert_dim is not None) >= 2:  # matmul weight, not a bias
                    expert_numel += per_expert
            else:
                dense_bytes += numel * bits / 8
                if t.group != NORM and len(shape) >= 2 and shape[-1] > 1:
                    dense_numel += numel
        kv, state, ctx_flops, const_flops = attention_costs(model, plan, layer, kv_bytes)
        out.append(
            LayerCost(
                index=layer.index, kind=layer.attention, dense_bytes=dense_bytes, dense_numel=dense_numel,
                expert_bytes=expert_bytes, expert_numel=expert_numel, kv_bytes_per_token=kv, state_bytes=state,
                window=layer.window, attn_flops_per_ctx=ctx_flops, attn_flops_const=const_flops,
                latent=layer.mlp == "moe" and model.moe is not None and model.moe.latent_size is not None,
            )
        )
    return out


def attention_costs(model: ModelSpec, plan: ParallelPlan, layer: LayerSpec, kv_bytes: float) -> tuple[float, float, float, float]:
    """(cache bytes per context token, state bytes, FLOPs per context token, constant FLOPs) on one rank."""
    tp = plan.tp
    heads = model.num_heads / tp
    if layer.attention in ("gqa", "sliding", "gated_attention"):
        kv_heads = max(model.num_kv_heads // tp, 1)
        return 2 * kv_heads * model.head_dim * kv_bytes, 0.0, 4 * heads * model.head_dim, 0.0
    if layer.attention in ("mla", "gated_mla"):
        mla = model.mla
        assert mla is not None
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim  # replicated on every TP rank
        return latent * kv_bytes, 0.0, 2 * heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim), 0.0
    la = model.linear_attention
    assert la is not None
    v_heads = la.num_value_heads / tp
    state = v_heads * la.key_head_dim * la.value_head_dim * 4.0 * 2  # fp32 state read + written
    return 0.0, state, 0.0, 4 * v_heads * la.key_head_dim * la.value_head_dim


def global_bytes(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], positions: int) -> float:
    """Bytes of the embedding rows, final norm and LM-head shard read per step on one rank."""
    total = 0.0
    for t in model.globals:
        bits = formats_bits[t.group]
        if t.group == EMBEDDING:
            total += positions * model.hidden_size * bits / 8
        elif t.group == LM_HEAD:
            total += t.tp_shard_len(plan.tp) * model.hidden_size * bits / 8 if plan.tp > 1 else t.numel * bits / 8
        else:
            total += t.numel * bits / 8
    if model.tie_word_embeddings:
        vocab_rows = model.vocab_size // plan.tp if plan.tp > 1 else model.vocab_size
        total += vocab_rows * model.hidden_size * formats_bits[EMBEDDING] / 8
    return total


def allreduce_cost(n_bytes: float, p: int, hw: Hardware, algorithms: tuple[str, ...]) -> tuple[str, float]:
    """Cheapest all-reduce among ``algorithms`` (ring, rd, oneshot, tree) by the link's α-β: (name, seconds).

    With a cable graph (``hw.ring_allreduce_s``) the ring is costed on the topology in the
    searched rank order, congestion on shared uplinks included; the others use the flat link.
    """
    if p <= 1:
        return "none", 0.0
    best = ("none", float("inf"))
    for name in algorithms:
        if name == "ring" and hw.ring_allreduce_s is not None:
            cost = hw.ring_allreduce_s(n_bytes)
        else:
            fn = collectives.ALLREDUCE_ALGORITHMS[_COLLECTIVE_NAMES[name]]
            cost = float(fn(n_bytes, p, hw.link_alpha_s, hw.link_beta_bytes_per_s))
        if cost < best[1]:
            best = (name, cost)
    return best


@dataclass(frozen=True)
class StepTerms:
    """A step's parts at 100% efficiency and zero software overhead, so profiles can scale them.

    memory_s / compute_s: per layer (LM head last), seconds at peak bandwidth / FLOPS.
    collective_s: α-β time of all collectives; collectives: how many (each pays the profile's
    per-call software overhead on network links).
    """

    positions: int
    memory_s: np.ndarray
    compute_s: np.ndarray
    collective_s: float
    collectives: int
    bytes_busiest: float
    flops_busiest: float
    experts_busiest: float
    experts_average: float
    allreduce_algorithm: str
    allreduce_s: float


def step_terms(
    model: ModelSpec,
    plan: ParallelPlan,
    layers: list[LayerCost],
    formats_bits: dict[str, float],
    hw: Hardware,
    context_tokens: int,
    positions: int = 1,
    *,
    allreduce: tuple[str, ...] = ("ring", "rd", "oneshot", "tree"),
    busiest_experts: bool = True,
) -> StepTerms:
    """Per-layer memory and compute seconds and the collectives of one step over ``positions``."""
    moe = model.moe
    if moe is not None:
        distinct = distinct_experts(moe.num_experts, moe.top_k, positions)
        average = distinct / plan.ep
        busiest = expected_max_load_tokens(moe.num_experts, moe.top_k, plan.ep, positions) if busiest_experts else average
        uses_per_expert = positions * moe.top_k / distinct  # positions sharing one picked expert
    else:
        average = busiest = uses_per_expert = 0.0
    n = len(layers) + 1
    nbytes = np.empty(n)
    flops = np.empty(n)
    for i, lc in enumerate(layers):
        ctx = context_tokens if lc.window is None else min(context_tokens, lc.window)
        n_experts = busiest if lc.expert_bytes else 0.0
        nbytes[i] = lc.dense_bytes + n_experts * lc.expert_bytes + lc.kv_bytes_per_token * ctx + lc.state_bytes
        flops[i] = 2 * (positions * lc.dense_numel + n_experts * uses_per_expert * lc.expert_numel)
        flops[i] += positions * (lc.attn_flops_per_ctx * ctx + lc.attn_flops_const)
    nbytes[-1] = global_bytes(model, plan, formats_bits, positions)
    flops[-1] = 2 * positions * (model.vocab_size // plan.tp) * model.hidden_size
    # Collectives: 2 all-reduces per layer under TP (+ latent all-gather and reduce-scatter),
    # one (value, index) gather for greedy sampling, one point-to-point per pipeline boundary.
    msg = positions * model.hidden_size * ACTIVATION_BYTES
    name, ar_s = allreduce_cost(msg, plan.tp, hw, allreduce)
    alpha, beta = hw.link_alpha_s, hw.link_beta_bytes_per_s
    collective_s = 0.0
    count = 0
    if plan.tp > 1:
        latent_layers = sum(1 for lc in layers if lc.latent)
        collective_s += 2 * len(layers) * ar_s
        count += 2 * len(layers) + 2 * latent_layers
        if latent_layers:
            latent_msg = positions * model.moe.latent_size * ACTIVATION_BYTES
            pair = collectives.ring_allgather_s(latent_msg, plan.tp, alpha, beta)
            pair += collectives.ring_reduce_scatter_s(latent_msg, plan.tp, alpha, beta)
            collective_s += latent_layers * pair
        collective_s += collectives.ring_allgather_s(positions * 8 * plan.tp, plan.tp, alpha, beta)
        count += 1
    if plan.pp > 1:
        collective_s += (plan.pp - 1) * collectives.point_to_point_s(msg, alpha, beta)
        count += plan.pp - 1
    return StepTerms(
        positions=positions, memory_s=nbytes / hw.mem_bandwidth_bytes_per_s, compute_s=flops / hw.peak_flops,
        collective_s=collective_s, collectives=count, bytes_busiest=float(nbytes.sum()),
        flops_busiest=float(flops.sum()), experts_busiest=busiest, experts_average=average,
        allreduce_algorithm=name, allreduce_s=ar_s,
    )


def step_cost(
    model: ModelSpec,
    plan: ParallelPlan,
    layers: list[LayerCost],
    formats_bits: dict[str, float],
    hw: Hardware,
    context_tokens: int,
    positions: int = 1,
    *,
    mem_efficiency: float = 1.0,
    compute_efficiency: float = 1.0,
    step_overhead_s: float = 0.0,
    collective_overhead_s: float = 0.0,
    allreduce: tuple[str, ...] = ("ring", "rd", "oneshot", "tree"),
    busiest_experts: bool = True,
    include_compute: bool = True,
    include_network: bool = True,
) -> StepCost:
    """Time of one step over ``positions`` positions at ``context_tokens`` of context (seconds).

    ``collective_overhead_s`` is a software cost paid once per collective call on network
    links (tcp, rdma: NCCL proxy / gloo socket handling); device-side collectives over NVLink or
    PCIe inside one host do not pay it.
    """
    terms = step_terms(
        model, plan, layers, formats_bits, hw, context_tokens, positions,
        allreduce=allreduce, busiest_experts=busiest_experts,
    )
    return apply_profile(terms, mem_efficiency, compute_efficiency, step_overhead_s, collective_overhead_s, hw,
                         include_compute=include_compute, include_network=include_network)


def apply_profile(
    terms: StepTerms,
    mem_efficiency: float,
    compute_efficiency: float,
    step_overhead_s: float,
    collective_overhead_s: float,
    hw: Hardware,
    *,
    include_compute: bool = True,
    include_network: bool = True,
) -> StepCost:
    """Scale a step's terms by a profile's efficiencies and add its overheads."""
    mem = terms.memory_s / mem_efficiency
    comp = terms.compute_s / compute_efficiency if include_compute else np.zeros_like(mem)
    per_layer = np.maximum(mem, comp)
    collective_s = 0.0
    if include_network:
        per_call = collective_overhead_s if hw.network else 0.0
        collective_s = terms.collective_s + terms.collectives * per_call
    return StepCost(
        positions=terms.positions, memory_s=float(mem.sum()), compute_s=float(comp.sum()),
        layers_s=float(per_layer.sum()), collective_s=collective_s, overhead_s=step_overhead_s,
        bytes_busiest=terms.bytes_busiest, flops_busiest=terms.flops_busiest,
        experts_busiest=terms.experts_busiest, experts_average=terms.experts_average,
        allreduce_algorithm=terms.allreduce_algorithm, allreduce_s=terms.allreduce_s,
        collectives_per_step=terms.collectives if include_network else 0,
        per_layer_s=tuple(float(x) for x in per_layer[:-1]),
    )

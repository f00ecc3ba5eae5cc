"""One decode (or speculative verify) step of one layout: the cost core's row 0, in seconds.

``step_terms`` reads the step's per-layer bytes and FLOPs and its collectives from
``perf.core`` for a one-layout table (``layout_table``) and turns them into seconds at 100%
efficiency; ``apply_profile`` scales them by a runtime profile's efficiencies and adds its
overheads. Per layer and rank: ``t = max(bytes / (BW·eff_mem), flops / (peak·eff_compute))``;
the layer ends when the busiest rank (the one holding the most picked experts) finishes, and
the step adds its collectives, the host's per-step overhead and the per-layer launch overhead
(``overhead_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardwise.perf import collectives, core
from shardwise.perf.core import Hardware
from shardwise.plan import ParallelPlan
from shardwise.spec.model import ModelSpec

ALL_ALGORITHMS = tuple(collectives.ALLREDUCE_ALGORITHMS)  # every algorithm the cost model knows


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


def layout_table(model: ModelSpec, plan: ParallelPlan, formats_bits: dict[str, float], kv_bytes: float) -> core.LayoutTable:
    """The cost core's table for the single layout ``plan``."""
    return core.build_layout_table(model, [plan], formats_bits, kv_bytes)


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
    launch_layers: float  # decoder layers the step runs, as the per-layer overhead counts them (ModelSpec.launch_layers)


def step_terms(
    model: ModelSpec,
    table: core.LayoutTable,
    hw: Hardware,
    context_tokens: int,
    positions: int = 1,
    *,
    allreduce: tuple[str, ...] = ALL_ALGORITHMS,
    busiest_experts: bool = True,
    batch: int = 1,
) -> StepTerms:
    """Per-layer memory and compute seconds and the collectives of one step over ``positions``
    of each of ``batch`` sequences for the one layout of ``table``."""
    fig = core.step_figures(model, table, context_tokens, positions, busiest_experts, batch)
    coll = core.collective_figures(model, table.counts, 0, hw.link_alpha_s, hw.link_beta_bytes_per_s,
                                   batch * positions, allreduce, ring_s=hw.ring_allreduce_s)
    nbytes, flops = fig.nbytes[0], fig.flops[0]
    tp = int(table.counts.tp[0])
    return StepTerms(
        positions=positions, memory_s=nbytes / hw.mem_bandwidth_bytes_per_s, compute_s=flops / hw.peak_flops,
        collective_s=float(coll["seconds"]), collectives=int(coll["calls"]), bytes_busiest=float(nbytes.sum()),
        flops_busiest=float(flops.sum()), experts_busiest=float(fig.experts_busiest[0]),
        experts_average=float(fig.experts_average[0]),
        allreduce_algorithm=allreduce[int(coll["algorithm"])] if tp > 1 else "none",
        allreduce_s=float(coll["allreduce_s"]), launch_layers=model.launch_layers,
    )


def step_cost(
    model: ModelSpec,
    table: core.LayoutTable,
    hw: Hardware,
    context_tokens: int,
    positions: int = 1,
    *,
    mem_efficiency: float = 1.0,
    compute_efficiency: float = 1.0,
    step_overhead_s: float = 0.0,
    collective_overhead_s: float = 0.0,
    layer_overhead_s: float = 0.0,
    allreduce: tuple[str, ...] = ALL_ALGORITHMS,
    busiest_experts: bool = True,
    batch: int = 1,
) -> StepCost:
    """Time of one step over ``positions`` positions at ``context_tokens`` of context (seconds).

    ``collective_overhead_s`` is a software cost paid once per collective call on network
    links (tcp, rdma: NCCL proxy / gloo socket handling); device-side collectives over NVLink or
    PCIe inside one host do not pay it.
    """
    terms = step_terms(model, table, hw, context_tokens, positions, allreduce=allreduce,
                       busiest_experts=busiest_experts, batch=batch)
    return apply_profile(terms, mem_efficiency, compute_efficiency, step_overhead_s, collective_overhead_s, hw,
                         layer_overhead_s=layer_overhead_s)


def overhead_seconds(step_overhead_s, layer_overhead_s, layers):
    """Host and launch seconds of one step: ``step_overhead_s`` plus ``layer_overhead_s`` for each of
    the ``layers`` decoder layers it runs (``ModelSpec.launch_layers``; all stages': at batch 1 a
    pipeline runs them one after another). Scalars or numpy arrays (the sweep's grid)."""
    return step_overhead_s + layer_overhead_s * layers


def apply_profile(
    terms: StepTerms,
    mem_efficiency: float,
    compute_efficiency: float,
    step_overhead_s: float,
    collective_overhead_s: float,
    hw: Hardware,
    *,
    layer_overhead_s: float = 0.0,
    include_compute: bool = True,
    include_network: bool = True,
) -> StepCost:
    """Scale a step's terms by a profile's efficiencies and add its overheads: ``step_overhead_s``
    once and ``layer_overhead_s`` per decoder layer (``overhead_s``; see ``overhead_seconds``)
    (``include_compute`` / ``include_network`` False: leave that term out, for the waterfall)."""
    mem = terms.memory_s / mem_efficiency
    comp = terms.compute_s / compute_efficiency if include_compute else np.zeros_like(mem)
    per_layer = np.maximum(mem, comp)
    collective_s = 0.0
    if include_network:
        per_call = collective_overhead_s if hw.network else 0.0
        collective_s = terms.collective_s + terms.collectives * per_call
    return StepCost(
        positions=terms.positions, memory_s=float(mem.sum()), compute_s=float(comp.sum()),
        layers_s=float(per_layer.sum()), collective_s=collective_s,
        overhead_s=overhead_seconds(step_overhead_s, layer_overhead_s, terms.launch_layers),
        bytes_busiest=terms.bytes_busiest, flops_busiest=terms.flops_busiest,
        experts_busiest=terms.experts_busiest, experts_average=terms.experts_average,
        allreduce_algorithm=terms.allreduce_algorithm, allreduce_s=terms.allreduce_s,
        collectives_per_step=terms.collectives if include_network else 0,
        per_layer_s=tuple(float(x) for x in per_layer[:-1]),
    )

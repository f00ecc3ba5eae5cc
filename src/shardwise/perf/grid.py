"""Speed and fit of layouts on hardware: the cost core's figures (``perf.core``) priced on box
and link figures under a runtime profile, for one cluster or a grid of them.

The per-layer ``max(memory, compute)`` is exact, layer by layer: arrays get a trailing layer
axis, so pass grid-shaped inputs (layouts × boxes × links) rather than one flat row per
configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardwise.perf.core import Hardware, LayoutCounts, LayoutTable, collective_figures, fullest_rank_bytes, step_figures
from shardwise.perf.collectives import ALLREDUCE_ALGORITHMS
from shardwise.perf.decode import overhead_seconds
from shardwise.perf.profiles import RuntimeProfile
from shardwise.perf.speculative import tokens_per_step
from shardwise.spec.model import ModelSpec

BOTTLENECKS = ("memory bandwidth", "compute", "network latency", "host overhead", "drafting")
PREFILL_BOTTLENECKS = ("compute", "network bandwidth")
ROOFLINE = RuntimeProfile("roofline", "pure roofline: peak bandwidth and FLOPS, no software overhead", 1.0, 1.0, 0.0, 0.0,
                          tuple(ALLREDUCE_ALGORITHMS))


def _rates(hw: Hardware, profile: RuntimeProfile) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, FLOP/s) the profile's runtime reaches on these boxes."""
    return (np.asarray(hw.mem_bandwidth_bytes_per_s, dtype=float) * profile.mem_efficiency,
            np.asarray(hw.peak_flops, dtype=float) * profile.compute_efficiency)


def _collective_s(model, counts: LayoutCounts, layout, hw: Hardware, positions, profile: RuntimeProfile,
                  sampled_positions: int | None = None) -> np.ndarray:
    """α-β seconds of a step's collectives plus the profile's software cost per call on network links."""
    coll = collective_figures(model, counts, layout, hw.link_alpha_s, hw.link_beta_bytes_per_s, positions,
                              profile.allreduce, sampled_positions=sampled_positions)
    return coll["seconds"] + coll["calls"] * np.where(hw.network, profile.collective_overhead_s, 0.0)


def _layer_max(values_a: np.ndarray, rate_a, values_b: np.ndarray, rate_b, layout: np.ndarray) -> np.ndarray:
    """Σ over layers of max(a / rate_a, b / rate_b), exact per layer, on the broadcast shape of
    (layout, rate_a, rate_b)."""
    shape = np.broadcast_shapes(layout.shape, np.shape(rate_a), np.shape(rate_b))
    lay, ra, rb = (np.broadcast_to(x, shape)[..., None] for x in (layout, rate_a, rate_b))
    return np.sum(np.maximum(values_a[lay[..., 0]] / ra, values_b[lay[..., 0]] / rb), axis=-1)


def evaluate(
    model: ModelSpec,
    table: LayoutTable,
    layout: np.ndarray,
    hw: Hardware,
    box_bytes: np.ndarray,
    context_tokens: int,
    *,
    profile: RuntimeProfile = ROOFLINE,
    reserve_fraction: float = 0.10,
    spec_tokens: int = 0,
    acceptance: float = 0.0,
    drafting_s: np.ndarray | float = 0.0,
    replicated_bytes: float = 0.0,
    batch: int | Sequence[int] = 1,
) -> dict[str, np.ndarray]:
    """Decode tok/s, step-time terms and memory fit of ``batch`` sequences decoded together;
    arrays broadcast against each other. A sequence of batch sizes adds a leading batch axis to
    every array (the union of experts and the busiest rank differ per batch, so each size is
    priced over the whole grid in turn).

    ``layout`` indexes ``table``; the box and link figures of ``hw`` and ``box_bytes`` broadcast
    against it (collectives on network links pay the profile's per-call ``collective_overhead_s``);
    ``profile`` gives the runtime's efficiencies, overheads and all-reduce algorithms. With ``spec_tokens``
    k > 0 the step is a verify pass over k+1 positions yielding ``tokens_per_step(k, acceptance)``
    tokens; ``drafting_s`` (seconds per verify step a draft model takes, broadcast against the
    box figures) adds to it and ``replicated_bytes`` (the draft's weights and cache) to every
    box's memory. Returns arrays:
    tok_per_s (per sequence), aggregate_tok_per_s (all ``batch`` sequences), step_s (the verify or
    decode step, drafting not included), memory_s, compute_s, layers_s, collective_s, used_bytes,
    free_bytes, fits, bottleneck (index into ``BOTTLENECKS``).
    """
    if not np.isscalar(batch):
        each = [evaluate(model, table, layout, hw, box_bytes, context_tokens, profile=profile,
                         reserve_fraction=reserve_fraction, spec_tokens=spec_tokens, acceptance=acceptance,
                         drafting_s=drafting_s, replicated_bytes=replicated_bytes, batch=int(b)) for b in batch]
        return {k: np.stack([np.broadcast_to(e[k], np.broadcast_shapes(*(x[k].shape for x in each))) for e in each])
                for k in each[0]}
    positions = spec_tokens + 1 if spec_tokens else 1
    layout = np.asarray(layout)
    fig = step_figures(model, table, context_tokens, positions, batch=batch)
    bw, peak = _rates(hw, profile)
    layers_s = _layer_max(fig.nbytes, bw, fig.flops, peak, layout)
    memory_s = fig.nbytes.sum(axis=1)[layout] / bw
    compute_s = fig.flops.sum(axis=1)[layout] / peak
    collective_s = _collective_s(model, table.counts, layout, hw, batch * positions, profile)
    step_overhead_s = overhead_seconds(profile.step_overhead_s, profile.layer_overhead_s, model.launch_layers)
    step_s = layers_s + collective_s + step_overhead_s
    tokens = tokens_per_step(spec_tokens, acceptance) if spec_tokens else 1.0
    box_bytes = np.asarray(box_bytes, dtype=float)
    used = (fullest_rank_bytes(table, context_tokens, positions, batch) + table.counts.workspace_bytes)[layout]
    used = used + reserve_fraction * box_bytes
    used = used + replicated_bytes
    # The largest of (memory or compute, collectives, host overhead, drafting), first on ties, as estimate() names it.
    mem_first = memory_s >= compute_s
    layer_term = np.where(mem_first, memory_s, compute_s)
    bottleneck = np.where((layer_term >= collective_s) & (layer_term >= step_overhead_s), np.where(mem_first, 0, 1),
                          np.where(collective_s >= step_overhead_s, 2, 3))
    drafting_s = np.asarray(drafting_s, dtype=float)
    bottleneck = np.where(drafting_s > np.maximum(np.maximum(layer_term, collective_s), step_overhead_s), 4, bottleneck)
    tok_per_s = tokens / (step_s + drafting_s)
    return {
        "tok_per_s": tok_per_s,
        "aggregate_tok_per_s": batch * tok_per_s,
        "step_s": step_s,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "layers_s": layers_s,
        "collective_s": collective_s,
        "used_bytes": used,
        "free_bytes": box_bytes - used,
        "fits": used <= box_bytes,
        "bottleneck": bottleneck,
    }


def evaluate_prefill(
    model: ModelSpec,
    table: LayoutTable,
    layout: np.ndarray,
    hw: Hardware,
    prompt_tokens: int,
    *,
    profile: RuntimeProfile = ROOFLINE,
) -> dict[str, np.ndarray]:
    """Prefill of ``prompt_tokens`` in one pass, vectorized.

    Per layer ``max(FLOPs / peak, bytes / bandwidth)`` with every local expert read once and
    ``prompt · top_k / ep`` expert-token uses per rank, attention over half the prompt on
    average; the LM head's FLOPs at every position; the same collectives as a decode step
    (``collective_figures``) with prompt-sized messages, one sampled position; each collective
    on a network link pays the profile's ``collective_overhead_s``.
    Returns arrays: tok_per_s, compute_s, collective_s, bottleneck (index into ``PREFILL_BOTTLENECKS``).
    """
    c = table.counts
    p_tok = float(prompt_tokens)
    layout = np.asarray(layout)
    moe = table.expert_bytes > 0
    local = np.floor(model.moe.num_experts / c.ep if model.moe else np.zeros(len(c.ep)))[:, None]
    uses = (p_tok * model.moe.top_k / c.ep if model.moe else np.zeros(len(c.ep)))[:, None]
    ctx = np.minimum(p_tok, c.window_tokens)
    flops = 2 * p_tok * c.dense_matmul_numel + np.where(moe, 2 * uses * c.expert_matmul_numel, 0.0)
    flops = flops + p_tok * (c.attn_flops_per_ctx * ctx / 2 + c.attn_flops_const)
    nbytes = table.dense_bytes + np.where(moe, local * table.expert_bytes, 0.0)
    bw, peak = _rates(hw, profile)
    compute_s = _layer_max(flops, peak, nbytes, bw, layout)
    compute_s = compute_s + (2 * p_tok * model.hidden_size * c.vocab_rows)[layout] / peak
    comm = _collective_s(model, c, layout, hw, prompt_tokens, profile, sampled_positions=1)
    total = compute_s + comm + overhead_seconds(profile.step_overhead_s, profile.layer_overhead_s, model.launch_layers)
    return {
        "tok_per_s": p_tok / total,
        "compute_s": compute_s,
        "collective_s": comm,
        "bottleneck": (comm > compute_s).astype(np.int64),
    }

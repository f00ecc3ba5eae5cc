"""Vectorized sweep core: decode and prefill tok/s and memory fit for many configurations at once.

The scalar model (``perf.decode.step_cost``, ``perf.memory``, ``perf.estimate._prefill``) walks
tensors and layers; a sweep cannot afford that per configuration. The work is split in three:

1. ``count_layouts``: per layout (tp, ep, pp) and layer, element counts per tensor group, cache
   and attention figures. Layers with the same structure are counted once per (tp, ep), so a
   model with 93 layers of 3 kinds costs 3 walks per (tp, ep), not 93 per layout.
2. ``build_layout_table``: those counts at one quantization (bits per group) → bytes per layer.
3. ``evaluate`` / ``evaluate_prefill``: numpy over arrays that broadcast against each other
   (layout index, box figures, link figures). The per-layer ``max(memory, compute)`` is taken
   exactly, layer by layer, as the scalar model does: arrays get a trailing layer axis, so pass
   grid-shaped inputs (layouts × boxes × links) rather than one flat row per configuration.

Tests hold every figure equal to the scalar model (decode tok/s, prefill tok/s, fullest-rank
memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardwise.perf import collectives
from shardwise.perf.decode import ACTIVATION_BYTES, attention_costs
from shardwise.perf.imbalance import distinct_experts, expected_max_load_tokens
from shardwise.perf.memory import PREFILL_CHUNK_TOKENS
from shardwise.perf.speculative import tokens_per_step
from shardwise.plan import ParallelPlan, shard_shape
from shardwise.spec.model import EMBEDDING, NORM, TENSOR_GROUPS, LayerSpec, ModelSpec, TensorSpec

BOTTLENECKS = ("memory bandwidth", "compute", "network latency", "host overhead", "drafting")
PREFILL_BOTTLENECKS = ("compute", "network bandwidth")

_GROUP = {g: i for i, g in enumerate(TENSOR_GROUPS)}
_AR = {
    "ring": collectives.ring_allreduce_s,
    "rd": collectives.recursive_doubling_allreduce_s,
    "oneshot": collectives.one_shot_allreduce_s,
    "tree": collectives.tree_allreduce_s,
}


@dataclass(frozen=True)
class LayoutCounts:
    """Quantization-independent figures per layout (first axis) and layer (second axis).

    ``*_numel_g`` arrays have a trailing tensor-group axis (``TENSOR_GROUPS`` order): elements
    on tensor rank 0. Cache and attention figures are bytes / FLOPs at the given KV dtype.
    """

    plans: tuple[ParallelPlan, ...]
    dense_numel_g: np.ndarray  # (P, L, G) non-expert weights one rank reads
    expert_numel_g: np.ndarray  # (P, L, G) one picked expert's shard
    held_numel_g: np.ndarray  # (P, L, G) weights one rank holds (all its local experts)
    dense_matmul_numel: np.ndarray  # (P, L) non-expert matmul weights one rank multiplies
    expert_matmul_numel: np.ndarray  # (P, L) one expert's matmul weights
    kv_read_bytes_per_ctx: np.ndarray  # (P, L) cache bytes read per context token
    state_bytes: np.ndarray  # (P, L) linear-attention state read + written per step
    attn_flops_per_ctx: np.ndarray  # (P, L)
    attn_flops_const: np.ndarray  # (P, L)
    cache_bytes_per_ctx: np.ndarray  # (P, L) cache held per context token (memory fit)
    cache_bytes_const: np.ndarray  # (P, L) context-independent cache held (linear state, conv)
    window_tokens: np.ndarray  # (L,) sliding window, inf where the cache grows without bound
    latent: np.ndarray  # (L,) latent-MoE layer: one latent all-gather + reduce-scatter
    global_read_numel_g: np.ndarray  # (P, G) embedding row, final norm, LM-head shard read per step
    embedding_row_numel: np.ndarray  # (P,) extra embedding elements read per extra position
    global_first_numel_g: np.ndarray  # (P, G) globals held by stage 0 only (pp > 1)
    global_last_numel_g: np.ndarray  # (P, G) globals held by the last stage only (pp > 1)
    global_all_numel_g: np.ndarray  # (P, G) globals held by the single stage (pp == 1)
    stage_start: np.ndarray  # (P, S) first layer of each stage (S = max pp; padding start = stop = 0)
    stage_stop: np.ndarray  # (P, S)
    stage_valid: np.ndarray  # (P, S) bool
    workspace_bytes: np.ndarray  # (P,)
    tp: np.ndarray
    ep: np.ndarray
    pp: np.ndarray


@dataclass(frozen=True)
class LayoutTable:
    """``LayoutCounts`` at one quantization: bytes per layout and layer (see ``build_layout_table``)."""

    counts: LayoutCounts
    dense_bytes: np.ndarray  # (P, L)
    expert_bytes: np.ndarray  # (P, L) one picked expert's shard
    head_bytes: np.ndarray  # (P,) globals read at one position
    embedding_row_bytes: np.ndarray  # (P,)
    stage_weights_bytes: np.ndarray  # (P, S), -inf on padding stages
    bits_per_weight: float  # average over the whole model at these formats

    @property
    def plans(self) -> tuple[ParallelPlan, ...]:
        """The layouts, in table order."""
        return self.counts.plans


def _signature(layer: LayerSpec) -> tuple:
    return (layer.attention, layer.mlp, layer.window) + tuple(
        (t.group, t.shape, t.tp_dim, t.tp_unit, t.experts, t.expert_dim) for t in layer.tensors
    )


def _tensor_counts(tensors: tuple[TensorSpec, ...], plan: ParallelPlan) -> tuple[np.ndarray, ...]:
    """(dense_g, expert_g, held_g, dense matmul, expert matmul) for tensor rank 0, as
    ``decode.layer_costs`` and ``plan.rank_param_counts`` count them."""
    g = len(TENSOR_GROUPS)
    dense, expert, held = np.zeros(g), np.zeros(g), np.zeros(g)
    dense_mm = expert_mm = 0
    for t in tensors:
        shape = shard_shape(t, plan, 0)
        numel = math.prod(shape)
        gi = _GROUP[t.group]
        if t.is_routed:
            per_expert = numel if t.expert_dim is None else numel // shape[t.expert_dim]
            expert[gi] += per_expert
            held[gi] += numel * (t.experts // plan.ep) if t.expert_dim is None else numel
            if len(t.shape) - (t.expert_dim is not None) >= 2:
                expert_mm += per_expert
        else:
            dense[gi] += numel
            held[gi] += numel
            if t.group != NORM and len(shape) >= 2 and shape[-1] > 1:
                dense_mm += numel
    return dense, expert, held, dense_mm, expert_mm


def _cache_per_layer(model: ModelSpec, layer: LayerSpec, tp: int, kv_bytes: float) -> tuple[float, float]:
    """(bytes held per context token, constant bytes held) for one layer, as ``memory.rank_cache_bytes``."""
    if layer.attention in ("gqa", "sliding", "gated_attention"):
        return 2 * max(model.num_kv_heads // tp, 1) * model.head_dim * kv_bytes, 0.0
    if layer.attention in ("mla", "gated_mla"):
        return (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes, 0.0
    la = model.linear_attention
    state = la.num_value_heads * la.key_head_dim * la.value_head_dim
    conv = (la.conv_kernel - 1) * (2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim)
    return 0.0, (state + conv) * 4.0 / tp


def count_layouts(model: ModelSpec, plans: list[ParallelPlan], kv_bytes: float = 2.0) -> LayoutCounts:
    """Element counts, cache and attention figures per layout and layer (quantization-free)."""
    n_layers = model.num_layers
    sigs = [_signature(layer) for layer in model.layers]
    first_of: dict[tuple, LayerSpec] = {}
    for sig, layer in zip(sigs, model.layers):
        first_of.setdefault(sig, layer)
    max_pp = max((p.pp for p in plans), default=1)
    keys = sorted({(p.tp, p.ep) for p in plans})
    key_index = {k: i for i, k in enumerate(keys)}
    per_key = []
    for tp, ep in keys:
        flat = ParallelPlan(tp=tp, ep=ep)
        by_sig = {sig: _tensor_counts(layer.tensors, flat) for sig, layer in first_of.items()}
        attn = {sig: attention_costs(model, flat, layer, kv_bytes) for sig, layer in first_of.items()}
        cache = {sig: _cache_per_layer(model, layer, tp, kv_bytes) for sig, layer in first_of.items()}
        per_key.append(([by_sig[s] for s in sigs], np.array([attn[s] for s in sigs], dtype=float),
                        np.array([cache[s] for s in sigs], dtype=float), _global_counts(model, flat)))
    which = np.array([key_index[(p.tp, p.ep)] for p in plans], dtype=np.int64)

    def gather(make) -> np.ndarray:
        return np.stack([make(entry) for entry in per_key])[which] if plans else np.zeros((0,))

    arr = {name: gather(lambda e, j=j: np.stack([row[j] for row in e[0]])) for j, name in enumerate(
        ("dense_numel_g", "expert_numel_g", "held_numel_g"))}
    lay = {name: gather(lambda e, j=j: np.array([row[j] for row in e[0]], dtype=float)) for j, name in (
        (3, "dense_matmul_numel"), (4, "expert_matmul_numel"))}
    for j, name in enumerate(("kv_read_bytes_per_ctx", "state_bytes", "attn_flops_per_ctx", "attn_flops_const")):
        lay[name] = gather(lambda e, j=j: e[1][:, j])
    for j, name in enumerate(("cache_bytes_per_ctx", "cache_bytes_const")):
        lay[name] = gather(lambda e, j=j: e[2][:, j])
    glob = {name: gather(lambda e, j=j: e[3][j]) for j, name in (
        (0, "global_read_numel_g"), (2, "global_first_numel_g"), (3, "global_last_numel_g"), (4, "global_all_numel_g"))}
    emb_row = gather(lambda e: np.float64(e[3][1]))
    # plan.stage_layers, vectorized: earlier stages take the remainder.
    pp = np.array([p.pp for p in plans], dtype=np.int64)
    stage = np.arange(max_pp)[None, :]
    base, extra = (x[:, None] for x in np.divmod(n_layers, pp))
    valid = stage < pp[:, None]
    start = np.where(valid, stage * base + np.minimum(stage, extra), 0)
    stop = np.where(valid, start + base + (stage < extra), 0)
    tp = np.array([p.tp for p in plans], dtype=np.int64)
    workspace = PREFILL_CHUNK_TOKENS * (8 * model.hidden_size + model.vocab_size // tp) * 4.0
    windows = np.array([layer.window if layer.window else np.inf for layer in model.layers], dtype=float)
    latent = np.array([layer.mlp == "moe" and model.moe is not None and model.moe.latent_size is not None for layer in model.layers])
    return LayoutCounts(
        plans=tuple(plans), **arr, **lay, window_tokens=windows, latent=latent, **glob, embedding_row_numel=emb_row,
        stage_start=start, stage_stop=stop, stage_valid=valid, workspace_bytes=workspace,
        tp=tp, ep=np.array([p.ep for p in plans], dtype=np.int64), pp=pp,
    )


def _global_counts(model: ModelSpec, plan: ParallelPlan) -> tuple:
    """Globals per group: read per step at one position (``decode.global_bytes``), the extra
    embedding elements per extra position, and what stage 0 / the last stage / a single stage
    hold (``plan.rank_tensors``)."""
    g = len(TENSOR_GROUPS)
    read, first, last, whole = np.zeros(g), np.zeros(g), np.zeros(g), np.zeros(g)
    row = 0.0
    for t in model.globals:
        gi = _GROUP[t.group]
        if t.group == EMBEDDING:
            read[gi] += model.hidden_size
            row += model.hidden_size
        elif t.group == "lm_head":
            read[gi] += t.tp_shard_len(plan.tp) * model.hidden_size if plan.tp > 1 else t.numel
        else:
            read[gi] += t.numel
        held = math.prod(shard_shape(t, plan, 0))
        whole[gi] += held
        if t.group == EMBEDDING:
            first[gi] += held
            if model.tie_word_embeddings:
                last[gi] += held
        else:
            last[gi] += held
    if model.tie_word_embeddings:
        vocab_rows = model.vocab_size // plan.tp if plan.tp > 1 else model.vocab_size
        read[_GROUP[EMBEDDING]] += vocab_rows * model.hidden_size
    return read, row, first, last, whole


def build_layout_table(
    model: ModelSpec, plans: list[ParallelPlan] | LayoutCounts, formats_bits: dict[str, float], kv_bytes: float = 2.0
) -> LayoutTable:
    """Bytes per layout and layer at ``formats_bits`` (bits per weight per tensor group).

    ``plans`` may be a ``LayoutCounts`` already counted (``count_layouts``), to price several
    quantizations of the same layouts without counting again.
    """
    counts = plans if isinstance(plans, LayoutCounts) else count_layouts(model, plans, kv_bytes)
    byte_g = np.array([formats_bits[g] / 8 for g in TENSOR_GROUPS])
    held = counts.held_numel_g @ byte_g  # (P, L)
    cum = np.concatenate([np.zeros((held.shape[0], 1)), np.cumsum(held, axis=1)], axis=1)
    stage = np.take_along_axis(cum, counts.stage_stop, 1) - np.take_along_axis(cum, counts.stage_start, 1)
    single = counts.pp == 1
    first = np.where(single, counts.global_all_numel_g @ byte_g, counts.global_first_numel_g @ byte_g)
    last = np.where(single, 0.0, counts.global_last_numel_g @ byte_g)
    stage[:, 0] += first
    last_idx = counts.pp - 1
    stage[np.arange(len(counts.pp)), last_idx] += last
    stage = np.where(counts.stage_valid, stage, -np.inf)
    total_bits = sum(n * formats_bits[g] for g, n in model.params_by_group.items())
    return LayoutTable(
        counts=counts,
        dense_bytes=counts.dense_numel_g @ byte_g,
        expert_bytes=counts.expert_numel_g @ byte_g,
        head_bytes=counts.global_read_numel_g @ byte_g,
        embedding_row_bytes=counts.embedding_row_numel * byte_g[_GROUP[EMBEDDING]],
        stage_weights_bytes=stage,
        bits_per_weight=total_bits / model.total_params,
    )


def fullest_rank_bytes(table: LayoutTable, context_tokens: int) -> np.ndarray:
    """Weights + cache of each layout's fullest rank at ``context_tokens`` (bytes, per layout)."""
    c = table.counts
    per_layer = c.cache_bytes_per_ctx * np.minimum(float(context_tokens), c.window_tokens) + c.cache_bytes_const
    cum = np.concatenate([np.zeros((per_layer.shape[0], 1)), np.cumsum(per_layer, axis=1)], axis=1)
    cache = np.take_along_axis(cum, c.stage_stop, 1) - np.take_along_axis(cum, c.stage_start, 1)
    return np.max(table.stage_weights_bytes + cache, axis=1)


def _busiest_experts(model: ModelSpec, ep: np.ndarray, positions: int) -> tuple[np.ndarray, float]:
    """Expected picked experts on the busiest rank per layout, and positions sharing one expert."""
    if model.moe is None:
        return np.zeros(len(ep)), 0.0
    e, k = model.moe.num_experts, model.moe.top_k
    per_ep = {int(x): expected_max_load_tokens(e, k, int(x), positions) for x in np.unique(ep)}
    return np.array([per_ep[int(x)] for x in ep]), positions * k / distinct_experts(e, k, positions)


def _layer_figures(model: ModelSpec, table: LayoutTable, context_tokens: int, positions: int):
    """(bytes, FLOPs) per layout and layer, and (bytes, FLOPs) of the globals, for one step."""
    c = table.counts
    busiest, uses = _busiest_experts(model, c.ep, positions)
    moe = table.expert_bytes > 0
    n_exp = np.where(moe, busiest[:, None], 0.0)
    ctx = np.minimum(float(context_tokens), c.window_tokens)
    nbytes = table.dense_bytes + n_exp * table.expert_bytes + c.kv_read_bytes_per_ctx * ctx + c.state_bytes
    flops = 2 * (positions * c.dense_matmul_numel + n_exp * uses * c.expert_matmul_numel)
    flops = flops + positions * (c.attn_flops_per_ctx * ctx + c.attn_flops_const)
    head_bytes = table.head_bytes + (positions - 1) * table.embedding_row_bytes
    head_flops = 2.0 * positions * (model.vocab_size // c.tp) * model.hidden_size
    return nbytes, flops, head_bytes, head_flops


def _collectives(model, c: LayoutCounts, layout, alpha, beta, positions: int, allreduce) -> tuple[np.ndarray, np.ndarray]:
    """(α-β seconds, number of collective calls) per step, as ``decode.step_terms`` counts them:
    two all-reduces per layer under TP (cheapest of ``allreduce`` by the link's α-β), a latent
    all-gather + reduce-scatter per latent-MoE layer, one sampling all-gather, one
    point-to-point per pipeline boundary."""
    tp = c.tp[layout]
    pp = c.pp[layout]
    msg = positions * model.hidden_size * ACTIVATION_BYTES
    ar = np.min(np.stack(np.broadcast_arrays(*(_AR[a](msg, tp, alpha, beta) for a in allreduce))), axis=0)
    seconds = 2 * model.num_layers * ar
    calls = 2 * model.num_layers + 1
    if model.moe is not None and model.moe.latent_size:
        lmsg = positions * model.moe.latent_size * ACTIVATION_BYTES
        pair = collectives.ring_allgather_s(lmsg, tp, alpha, beta) + collectives.ring_reduce_scatter_s(lmsg, tp, alpha, beta)
        seconds = seconds + int(c.latent.sum()) * pair
        calls += 2 * int(c.latent.sum())
    seconds = seconds + collectives.ring_allgather_s(positions * 8 * tp, tp, alpha, beta)
    seconds = np.where(tp > 1, seconds, 0.0) + (pp - 1) * collectives.point_to_point_s(msg, alpha, beta)
    return seconds, np.where(tp > 1, calls, 0) + (pp - 1)


def evaluate(
    model: ModelSpec,
    table: LayoutTable,
    layout: np.ndarray,
    mem_bandwidth_bytes_per_s: np.ndarray,
    peak_flops: np.ndarray,
    box_bytes: np.ndarray,
    link_alpha_s: np.ndarray,
    link_beta_bytes_per_s: np.ndarray,
    context_tokens: int,
    *,
    link_network: np.ndarray | bool = True,
    mem_efficiency: float = 1.0,
    compute_efficiency: float = 1.0,
    step_overhead_s: float = 0.0,
    collective_overhead_s: float = 0.0,
    allreduce: tuple[str, ...] = ("ring", "rd", "oneshot", "tree"),
    reserve_fraction: float = 0.10,
    spec_tokens: int = 0,
    acceptance: float = 0.0,
    drafting_s: np.ndarray | float = 0.0,
    replicated_bytes: float = 0.0,
) -> dict[str, np.ndarray]:
    """Decode tok/s, step-time terms and memory fit; arrays broadcast against each other.

    ``layout`` indexes ``table``; box figures (bytes/s, FLOP/s, bytes) and link figures
    (seconds, bytes/s; ``link_network`` True for tcp/rdma links, whose collectives pay the
    profile's per-call ``collective_overhead_s``) broadcast against it. With ``spec_tokens``
    k > 0 the step is a verify pass over k+1 positions yielding ``tokens_per_step(k, acceptance)``
    tokens; ``drafting_s`` (seconds per verify step a draft model takes, broadcast against the
    box figures) adds to it and ``replicated_bytes`` (the draft's weights and cache) to every
    box's memory. Returns arrays:
    tok_per_s, step_s (the verify or decode step, drafting not included), memory_s, compute_s,
    layers_s, collective_s, used_bytes, free_bytes, fits, bottleneck (index into ``BOTTLENECKS``).
    """
    positions = spec_tokens + 1 if spec_tokens else 1
    layout = np.asarray(layout)
    nbytes, flops, head_bytes, head_flops = _layer_figures(model, table, context_tokens, positions)
    bw = np.asarray(mem_bandwidth_bytes_per_s, dtype=float) * mem_efficiency
    peak = np.asarray(peak_flops, dtype=float) * compute_efficiency
    # The exact per-layer max happens on the (layout, bandwidth, peak) broadcast shape only.
    shape = np.broadcast_shapes(layout.shape, bw.shape, peak.shape)
    lay, bwl, pkl = (np.broadcast_to(a, shape)[..., None] for a in (layout, bw, peak))
    layers_s = np.sum(np.maximum(nbytes[lay[..., 0]] / bwl, flops[lay[..., 0]] / pkl), axis=-1)
    layers_s = layers_s + np.maximum(head_bytes[layout] / bw, head_flops[layout] / peak)
    memory_s = (nbytes.sum(axis=1) + head_bytes)[layout] / bw
    compute_s = (flops.sum(axis=1) + head_flops)[layout] / peak
    raw_s, calls = _collectives(model, table.counts, layout, link_alpha_s, link_beta_bytes_per_s, positions, allreduce)
    collective_s = raw_s + calls * np.where(link_network, collective_overhead_s, 0.0)
    step_s = layers_s + collective_s + step_overhead_s
    tokens = tokens_per_step(spec_tokens, acceptance) if spec_tokens else 1.0
    box_bytes = np.asarray(box_bytes, dtype=float)
    used = (fullest_rank_bytes(table, context_tokens) + table.counts.workspace_bytes)[layout] + reserve_fraction * box_bytes
    used = used + replicated_bytes
    # The largest of (memory or compute, collectives, host overhead, drafting), first on ties, as estimate() names it.
    mem_first = memory_s >= compute_s
    layer_term = np.where(mem_first, memory_s, compute_s)
    bottleneck = np.where((layer_term >= collective_s) & (layer_term >= step_overhead_s), np.where(mem_first, 0, 1),
                          np.where(collective_s >= step_overhead_s, 2, 3))
    drafting_s = np.asarray(drafting_s, dtype=float)
    bottleneck = np.where(drafting_s > np.maximum(np.maximum(layer_term, collective_s), step_overhead_s), 4, bottleneck)
    return {
        "tok_per_s": tokens / (step_s + drafting_s),
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
    mem_bandwidth_bytes_per_s: np.ndarray,
    peak_flops: np.ndarray,
    link_alpha_s: np.ndarray,
    link_beta_bytes_per_s: np.ndarray,
    prompt_tokens: int,
    *,
    link_network: np.ndarray | bool = True,
    mem_efficiency: float = 1.0,
    compute_efficiency: float = 1.0,
    step_overhead_s: float = 0.0,
    collective_overhead_s: float = 0.0,
) -> dict[str, np.ndarray]:
    """Prefill of ``prompt_tokens`` as ``estimate._prefill`` models it, vectorized.

    Per layer ``max(FLOPs / peak, bytes / bandwidth)`` with every local expert read once and
    ``prompt · top_k / ep`` expert-token uses per rank; two ring all-reduces of
    ``prompt × hidden × 2`` bytes per layer under TP, one point-to-point per stage boundary;
    each collective on a network link (``link_network``) pays ``collective_overhead_s``.
    Returns arrays: tok_per_s, compute_s, collective_s, bottleneck (index into ``PREFILL_BOTTLENECKS``).
    """
    c = table.counts
    p_tok = float(prompt_tokens)
    layout = np.asarray(layout)
    moe = table.expert_bytes > 0
    local = (model.moe.num_experts / c.ep if model.moe else np.zeros(len(c.ep)))[:, None]
    local = np.floor(local)
    uses = (p_tok * model.moe.top_k / c.ep if model.moe else np.zeros(len(c.ep)))[:, None]
    ctx = np.minimum(p_tok, c.window_tokens)
    flops = 2 * p_tok * c.dense_matmul_numel + np.where(moe, 2 * uses * c.expert_matmul_numel, 0.0)
    flops = flops + p_tok * (c.attn_flops_per_ctx * ctx / 2 + c.attn_flops_const)
    nbytes = table.dense_bytes + np.where(moe, local * table.expert_bytes, 0.0)
    bw = np.asarray(mem_bandwidth_bytes_per_s, dtype=float) * mem_efficiency
    peak = np.asarray(peak_flops, dtype=float) * compute_efficiency
    shape = np.broadcast_shapes(layout.shape, bw.shape, peak.shape)
    lay, bwl, pkl = (np.broadcast_to(a, shape)[..., None] for a in (layout, bw, peak))
    compute_s = np.sum(np.maximum(flops[lay[..., 0]] / pkl, nbytes[lay[..., 0]] / bwl), axis=-1)
    compute_s = compute_s + (2 * p_tok * model.hidden_size * model.vocab_size / c.tp)[layout] / peak
    msg = p_tok * model.hidden_size * 2
    per_call = np.where(link_network, collective_overhead_s, 0.0)
    tp = c.tp[layout]
    ring = collectives.ring_allreduce_s(msg, tp, link_alpha_s, link_beta_bytes_per_s)
    comm = np.where(tp > 1, 2 * model.num_layers * (ring + per_call), 0.0)
    comm = comm + (c.pp[layout] - 1) * (collectives.point_to_point_s(msg, link_alpha_s, link_beta_bytes_per_s) + per_call)
    total = compute_s + comm + step_overhead_s
    return {
        "tok_per_s": p_tok / total,
        "compute_s": compute_s,
        "collective_s": comm,
        "bottleneck": (comm > compute_s).astype(np.int64),
    }

"""The cost core: bytes, FLOPs, collectives, memory and prefill for one layout or a million.

One code path serves ``shardwise plan`` (one layout: ``perf.decode``, ``perf.memory`` and
``perf.estimate`` read row 0) and ``shardwise sweep`` (every layout × box × link at once):

1. ``count_layouts``: per layout (tp, ep, pp) and layer, element counts per tensor group (the
   layout rules of ``shardwise.plan``: ``held_numel``, ``picked_expert_numel``, ``stage_globals``,
   ``stage_layers``) and the mixer table's cache, state and FLOP figures
   (``shardwise.spec.mixers``). Layers of equal structure are counted once per (tp, ep).
2. ``build_layout_table``: those counts at one quantization (bits per group) → bytes.
3. ``step_figures`` / ``collective_figures`` / ``stage_bytes`` / ``max_batch``: a step's bytes,
   FLOPs and collectives and the memory held, per layout; ``perf.grid`` prices them on hardware
   (``evaluate``, ``evaluate_prefill``): numpy over arrays that broadcast against each other
   (layout index, box figures, link figures).

A decode step over ``positions`` positions (1 plain, k+1 for a speculative verify) reads every
non-expert weight once, the distinct experts the positions picked (the busiest expert-parallel
rank's expected count), the cache once and the recurrent state twice (read, written). Under TP
each layer ends in the all-reduces its mixer and MLP declare (2: after attention, after the
MLP or MoE, routed and shared outputs fused); a latent-MoE layer's (Kimi K3) MoE all-reduce
carries the routed experts' latent output beside the shared experts' partial sum, one message of
latent + hidden width, before the replicated up-projection (vLLM's kimi_k3 model: "fuse the
latent and shared reductions into a single all-reduce"); the vocab-parallel embedding adds one
all-reduce and greedy
sampling one all-gather of (value, index) pairs; pipeline boundaries one point-to-point each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.perf import collectives
from shardwise.perf.imbalance import distinct_experts, expected_max_load_tokens
from shardwise.plan import ParallelPlan, held_numel, picked_expert_numel, stage_globals
from shardwise.spec.mixers import cache_positions, conv_channels, state_slots
from shardwise.spec.model import EMBEDDING, LM_HEAD, TENSOR_GROUPS, LayerSpec, ModelSpec, TensorSpec
from shardwise.spec.tensors import FLOAT32_BITS, unpacked_key

ACTIVATION_BYTES = 2  # bf16 activations on the wire
SAMPLE_BYTES = 8  # one (value, index) pair per rank and position for greedy sampling
PREFILL_CHUNK_TOKENS = 2048  # workspace: activations and logits of one prefill chunk ...
WORKSPACE_HIDDEN_BUFFERS = 8  # ... as this many hidden-wide buffers plus the logits row ...
WORKSPACE_ELEMENT_BYTES = 4.0  # ... in float32

_GROUP = {g: i for i, g in enumerate(TENSOR_GROUPS)}
_BLOCKS = 3  # per group: matmul weights, biases and 1-D parameters, ``keep_float32`` tensors
_COLUMNS = _BLOCKS * len(TENSOR_GROUPS)


def _column(t: TensorSpec) -> int:
    """A tensor's column in the ``*_numel_g`` arrays: its group's in the first block, in the
    second when it is not a matmul weight (those stay unpacked when the group is packed), in the
    third when it is ``keep_float32`` (float32 in any format): ``tensors.tensor_bits``."""
    block = 2 if t.keep_float32 else 0 if t.is_matmul else 1
    return _GROUP[t.group] + block * len(TENSOR_GROUPS)


def byte_vector(formats_bits: dict[str, float]) -> np.ndarray:
    """Bytes per element of each ``*_numel_g`` column at ``formats_bits`` (bits per weight per group)."""
    return np.array([formats_bits[g] / 8 for g in TENSOR_GROUPS]
                    + [formats_bits.get(unpacked_key(g), formats_bits[g]) / 8 for g in TENSOR_GROUPS]
                    + [FLOAT32_BITS / 8] * len(TENSOR_GROUPS))


@dataclass(frozen=True)
class Hardware:
    """What the cost core needs of the boxes and their link (SI units). Scalars for one cluster,
    or numpy arrays that broadcast against the layout index (a sweep's boxes × links grid)."""

    mem_bandwidth_bytes_per_s: Any
    peak_flops: Any
    link_alpha_s: Any
    link_beta_bytes_per_s: Any
    network: Any = True  # a network link (tcp/rdma: collectives pay the per-call software cost), not NVLink/PCIe
    ring_allreduce_s: Callable[[float], float] | None = None  # ring cost on a real topology (seconds for n bytes)


@dataclass(frozen=True)
class LayoutCounts:
    """Quantization-independent figures per layout (first axis) and layer (second axis).

    ``*_numel_g`` arrays have a trailing column axis: elements on one tensor rank per tensor group
    (``TENSOR_GROUPS`` order), matmul weights first, then the group's biases and 1-D parameters,
    then its ``keep_float32`` tensors (``byte_vector`` prices them). Cache figures are bytes at
    the given KV dtype.
    """

    plans: tuple[ParallelPlan, ...]
    dense_numel_g: np.ndarray  # (P, L, G) non-expert weights one rank reads
    expert_numel_g: np.ndarray  # (P, L, G) one picked expert's shard
    held_numel_g: np.ndarray  # (P, L, G) weights one rank holds (all its local experts)
    dense_matmul_numel: np.ndarray  # (P, L) non-expert matmul weights one rank multiplies
    expert_matmul_numel: np.ndarray  # (P, L) one expert's matmul weights
    cache_bytes_per_ctx: np.ndarray  # (P, L) cache held (and read per step) per context token
    snapshot_bytes: np.ndarray  # (P, L) one fp32 linear-attention state (read or written per position)
    conv_bytes_per_position: np.ndarray  # (P, L) one position of the short-convolution window
    attn_flops_per_ctx: np.ndarray  # (P, L) per position per context token
    attn_flops_const: np.ndarray  # (P, L) per position
    window_tokens: np.ndarray  # (L,) sliding window, inf where the cache grows without bound
    conv_window: np.ndarray  # (L,) positions of a linear-attention layer's conv window (kernel − 1), else 0
    allreduces: np.ndarray  # (L,) all-reduces each layer ends with under TP (mixer + MLP)
    latent: np.ndarray  # (L,) latent-MoE layer: its MoE all-reduce also carries the latent
    global_read_numel_g: np.ndarray  # (P, G) embedding row, final norm, LM-head shard read per step
    embedding_row_numel: np.ndarray  # (P,) extra embedding elements read per extra position
    stage_globals_numel_g: np.ndarray  # (P, S, G) embedding / norm / LM head each stage holds
    vocab_rows: np.ndarray  # (P,) LM-head rows one rank multiplies (vocabulary padded to tp)
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


def _layer_row(model: ModelSpec, layer: LayerSpec, plan: ParallelPlan, kv_bytes: float) -> tuple:
    """One layer on one tensor rank of ``plan``: (dense_g, expert_g, held_g, dense matmul, expert
    matmul, cache bytes per ctx, state held, state traffic, FLOPs per ctx, constant FLOPs)."""
    dense, expert, held = np.zeros(_COLUMNS), np.zeros(_COLUMNS), np.zeros(_COLUMNS)
    dense_mm = expert_mm = 0
    for t in layer.tensors:
        gi = _column(t)
        n = held_numel(t, plan)
        held[gi] += n
        if t.is_routed:
            one = picked_expert_numel(t, plan)
            expert[gi] += one
            expert_mm += one if t.is_matmul else 0
        else:
            dense[gi] += n
            dense_mm += n if t.is_matmul else 0
    mixer = layer.mixer
    conv = conv_channels(model, plan.tp) * kv_bytes if mixer.is_linear else 0.0
    figures = (mixer.cache_elems_per_token(model, plan.tp) * kv_bytes, mixer.snapshot_bytes(model, plan.tp), conv,
               mixer.flops_per_ctx(model, plan.tp), mixer.flops_const(model, plan.tp))
    return (dense, expert, held, dense_mm, expert_mm, *figures)


def _global_reads(model: ModelSpec, plan: ParallelPlan) -> tuple[np.ndarray, float, int]:
    """Globals read per step at one position per group, the extra embedding elements per extra
    position, and the LM-head rows one rank multiplies."""
    read = np.zeros(_COLUMNS)
    head = next((t for t in model.globals if t.group == LM_HEAD), None)
    embedding = next(t for t in model.globals if t.group == EMBEDDING)
    vocab_rows = (head or embedding).tp_shard_len(plan.tp) if plan.tp > 1 else model.vocab_size
    for t in model.globals:
        if t.group == EMBEDDING:
            read[_GROUP[EMBEDDING]] += model.hidden_size  # one looked-up row
        elif t.group == LM_HEAD:
            read[_GROUP[LM_HEAD]] += vocab_rows * model.hidden_size
        else:
            read[_column(t)] += t.numel
    if head is None:  # tied: the LM head multiplies the embedding's rows
        read[_GROUP[EMBEDDING]] += vocab_rows * model.hidden_size
    return read, float(model.hidden_size), vocab_rows


def count_layouts(model: ModelSpec, plans: list[ParallelPlan], kv_bytes: float = 2.0) -> LayoutCounts:
    """Element counts, cache and attention figures per layout and layer (quantization-free)."""
    sigs = model.layer_structure  # layers of one structure cost the same: count each once
    first_of: dict[int, LayerSpec] = {}
    for sig, layer in zip(sigs, model.layers):
        first_of.setdefault(sig, layer)
    keys = sorted({(p.tp, p.ep) for p in plans})
    per_key = []
    for tp, ep in keys:
        flat = ParallelPlan(tp=tp, ep=ep)
        rows = {sig: _layer_row(model, layer, flat, kv_bytes) for sig, layer in first_of.items()}
        per_key.append(([rows[s] for s in sigs], _global_reads(model, flat)))
    which = np.array([keys.index((p.tp, p.ep)) for p in plans], dtype=np.int64)

    def gather(make) -> np.ndarray:
        return np.stack([make(entry) for entry in per_key])[which] if plans else np.zeros((0,))

    names = ("dense_numel_g", "expert_numel_g", "held_numel_g", "dense_matmul_numel", "expert_matmul_numel",
             "cache_bytes_per_ctx", "snapshot_bytes", "conv_bytes_per_position", "attn_flops_per_ctx",
             "attn_flops_const")
    per_layer = {name: gather(lambda e, j=j: np.array([row[j] for row in e[0]], dtype=float))
                 for j, name in enumerate(names)}
    max_pp = max((p.pp for p in plans), default=1)
    start, stop = np.zeros((len(plans), max_pp), np.int64), np.zeros((len(plans), max_pp), np.int64)
    stage_globals_g = np.zeros((len(plans), max_pp, _COLUMNS))
    for i, plan in enumerate(plans):
        for s in range(plan.pp):
            layers = plan.stage_layers(model.num_layers, s)
            start[i, s], stop[i, s] = layers.start, layers.stop
            for t in stage_globals(model, plan, s):
                stage_globals_g[i, s, _column(t)] += held_numel(t, plan)
    tp = np.array([p.tp for p in plans], dtype=np.int64)
    vocab_rows = gather(lambda e: np.float64(e[1][2]))
    hidden_buffers = WORKSPACE_HIDDEN_BUFFERS * model.hidden_size
    return LayoutCounts(
        plans=tuple(plans), **per_layer,
        window_tokens=np.array([layer.window if layer.mixer.windowed and layer.window else np.inf
                                for layer in model.layers], dtype=float),
        conv_window=np.array([model.linear_attention.conv_kernel - 1 if layer.mixer.is_linear else 0
                              for layer in model.layers]),
        allreduces=np.array([layer.mixer.allreduces + (layer.mlp != "none") for layer in model.layers]),  # + the MLP's
        latent=np.array([layer.mlp == "moe" and model.moe is not None and model.moe.latent_size is not None
                         for layer in model.layers]),
        global_read_numel_g=gather(lambda e: e[1][0]), embedding_row_numel=gather(lambda e: np.float64(e[1][1])),
        stage_globals_numel_g=stage_globals_g, vocab_rows=vocab_rows,
        stage_start=start, stage_stop=stop, stage_valid=np.arange(max_pp)[None, :] < np.array([p.pp for p in plans])[:, None],
        workspace_bytes=PREFILL_CHUNK_TOKENS * (hidden_buffers + vocab_rows) * WORKSPACE_ELEMENT_BYTES,
        tp=tp, ep=np.array([p.ep for p in plans], dtype=np.int64), pp=np.array([p.pp for p in plans], dtype=np.int64),
    )


def _stage_sum(per_layer: np.ndarray, counts: LayoutCounts) -> np.ndarray:
    """(P, L) → (P, S): the sum over each stage's layers."""
    cum = np.concatenate([np.zeros((per_layer.shape[0], 1)), np.cumsum(per_layer, axis=1)], axis=1)
    return np.take_along_axis(cum, counts.stage_stop, 1) - np.take_along_axis(cum, counts.stage_start, 1)


def build_layout_table(
    model: ModelSpec, plans: list[ParallelPlan] | LayoutCounts, formats_bits: dict[str, float], kv_bytes: float = 2.0
) -> LayoutTable:
    """Bytes per layout and layer at ``formats_bits`` (bits per weight per tensor group).

    ``plans`` may be a ``LayoutCounts`` already counted (``count_layouts``), to price several
    quantizations of the same layouts without counting again.
    """
    counts = plans if isinstance(plans, LayoutCounts) else count_layouts(model, plans, kv_bytes)
    byte_g = byte_vector(formats_bits)
    stage = _stage_sum(counts.held_numel_g @ byte_g, counts) + counts.stage_globals_numel_g @ byte_g
    return LayoutTable(
        counts=counts,
        dense_bytes=counts.dense_numel_g @ byte_g,
        expert_bytes=counts.expert_numel_g @ byte_g,
        head_bytes=counts.global_read_numel_g @ byte_g,
        embedding_row_bytes=counts.embedding_row_numel * byte_g[_GROUP[EMBEDDING]],
        stage_weights_bytes=np.where(counts.stage_valid, stage, -np.inf),
        bits_per_weight=8 * model.weight_bytes(formats_bits) / model.total_params,
    )


def stage_group_bytes(table: LayoutTable, formats_bits: dict[str, float], layout: int = 0,
                      stage: int = 0) -> dict[str, float]:
    """Weight bytes per tensor group one rank of ``stage`` of ``layout`` holds (all of a group's
    column blocks together)."""
    c = table.counts
    layers = slice(int(c.stage_start[layout, stage]), int(c.stage_stop[layout, stage]))
    numel = (c.held_numel_g[layout, layers].sum(axis=0) + c.stage_globals_numel_g[layout, stage]).reshape(_BLOCKS, -1)
    priced = numel * byte_vector(formats_bits).reshape(_BLOCKS, -1)
    return {g: float(priced[:, i].sum()) for i, g in enumerate(TENSOR_GROUPS) if numel[:, i].any()}


def stage_bytes(table: LayoutTable, context_tokens: int, step_tokens: int = 1,
                batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(weights, cache of ``batch`` sequences) one rank of each stage holds at ``context_tokens``
    (bytes, (P, S); weights -inf on padding stages). A sliding-window layer holds its window plus
    the positions one step writes beyond the first (``step_tokens``: 1 plain, k+1 for a
    speculative verify), the runtime's ring buffer, never more than the context."""
    c = table.counts
    held = cache_positions(float(context_tokens), c.window_tokens, step_tokens)
    slots = state_slots(step_tokens)  # the mixer table's linear state: snapshots and conv window
    state = c.snapshot_bytes * slots + c.conv_bytes_per_position * np.maximum(c.conv_window - 1 + slots, 0)
    per_layer = c.cache_bytes_per_ctx * held + state
    return table.stage_weights_bytes, batch * _stage_sum(per_layer, c)


def fullest_rank_bytes(table: LayoutTable, context_tokens: int, step_tokens: int = 1, batch: int = 1) -> np.ndarray:
    """Weights + the caches of ``batch`` sequences on each layout's fullest rank at
    ``context_tokens`` (bytes, per layout)."""
    weights, cache = stage_bytes(table, context_tokens, step_tokens, batch)
    return np.max(weights + cache, axis=1)


def max_batch(table: LayoutTable, context_tokens: int, free_bytes, step_tokens: int = 1) -> np.ndarray:
    """Most sequences of ``context_tokens`` whose caches fit beside the weights on every stage's
    ranks, given ``free_bytes`` per box once workspace, reserve and replicated bytes are taken
    (per layout; 0 when the weights alone do not fit)."""
    weights, cache = stage_bytes(table, context_tokens, step_tokens)
    room = np.asarray(free_bytes, dtype=float)[..., None] - weights
    per_stage = np.where(cache > 0, np.floor(np.maximum(room, 0.0) / np.where(cache > 0, cache, 1.0)), np.inf)
    out = np.min(np.where(table.counts.stage_valid, per_stage, np.inf), axis=-1)
    return np.where(np.isfinite(out), out, np.iinfo(np.int64).max).astype(np.int64)


@dataclass(frozen=True)
class StepFigures:
    """Bytes and FLOPs of one step per layout: layers, then the globals as a last column."""

    nbytes: np.ndarray  # (P, L + 1) bytes the busiest rank reads
    flops: np.ndarray  # (P, L + 1)
    experts_busiest: np.ndarray  # (P,) picked experts per MoE layer on the busiest rank
    experts_average: np.ndarray  # (P,)


def step_figures(model: ModelSpec, table: LayoutTable, context_tokens: int, positions: int = 1,
                 busiest_experts: bool = True, batch: int = 1) -> StepFigures:
    """Bytes and FLOPs per layout and layer of a step over ``positions`` of each of ``batch``
    sequences at ``context_tokens`` (``busiest_experts`` False: picked experts spread evenly over
    the expert-parallel ranks). Weights are read once for the whole batch; each picked expert
    once for every token that picked it (the union of the tokens' experts: uniform routing);
    each sequence reads its own cache and state."""
    c = table.counts
    tokens = batch * positions
    if model.moe is not None:
        e, k = model.moe.num_experts, model.moe.top_k
        distinct = distinct_experts(e, k, tokens)
        average = distinct / c.ep
        per_ep = {int(x): expected_max_load_tokens(e, k, int(x), tokens) for x in np.unique(c.ep)}
        busiest = np.array([per_ep[int(x)] for x in c.ep]) if busiest_experts else average
        uses = tokens * k / distinct  # tokens sharing one picked expert
    else:
        average = busiest = np.zeros(len(c.ep))
        uses = 0.0
    n_exp = np.where(table.expert_bytes > 0, busiest[:, None], 0.0)
    ctx = np.minimum(float(context_tokens), c.window_tokens)
    per_sequence = c.cache_bytes_per_ctx * ctx + (1 + positions) * c.snapshot_bytes  # state read, one written per position
    nbytes = table.dense_bytes + n_exp * table.expert_bytes + batch * per_sequence
    flops = 2 * (tokens * c.dense_matmul_numel + n_exp * uses * c.expert_matmul_numel)
    flops = flops + tokens * (c.attn_flops_per_ctx * ctx + c.attn_flops_const)
    head_bytes = table.head_bytes + (tokens - 1) * table.embedding_row_bytes
    head_flops = 2.0 * tokens * c.vocab_rows * model.hidden_size
    return StepFigures(np.concatenate([nbytes, head_bytes[:, None]], axis=1),
                       np.concatenate([flops, head_flops[:, None]], axis=1), busiest, average)


def collective_figures(model: ModelSpec, counts: LayoutCounts, layout, alpha_s, beta_bytes_per_s, positions: int,
                       algorithms: tuple[str, ...], *, sampled_positions: int | None = None,
                       ring_s=None) -> dict[str, np.ndarray]:
    """α-β seconds and number of collective calls of one step over ``positions`` per layout.

    The activation all-reduces take the cheapest of ``algorithms`` (names of
    ``collectives.ALLREDUCE_ALGORITHMS``; ``ring_s(n_bytes)``: the ring's cost on a cable graph
    instead of the flat link). ``sampled_positions`` (default ``positions``): positions whose
    (value, index) pairs greedy sampling gathers. Returns arrays: seconds, calls, allreduce_s
    (one activation all-reduce), algorithm (index into ``algorithms``).
    """
    layout = np.asarray(layout)
    tp, pp = counts.tp[layout], counts.pp[layout]

    def cheapest(n_bytes: float) -> tuple[np.ndarray, np.ndarray]:
        each = [np.asarray(ring_s(n_bytes) if name == "ring" and ring_s is not None
                           else collectives.ALLREDUCE_ALGORITHMS[name](n_bytes, tp, alpha_s, beta_bytes_per_s), dtype=float)
                for name in algorithms]
        each = np.stack(np.broadcast_arrays(*each))
        pick = np.argmin(each, axis=0)
        return np.take_along_axis(each, pick[None, ...], axis=0)[0], pick

    msg = positions * model.hidden_size * ACTIVATION_BYTES
    allreduce_s, pick = cheapest(msg)
    activation_allreduces = int(counts.allreduces.sum()) + 1  # + the vocab-parallel embedding's
    latent_layers = int(counts.latent.sum())
    seconds = (activation_allreduces - latent_layers) * allreduce_s
    calls = activation_allreduces + 1  # + the sampling gather
    if latent_layers:  # their MoE all-reduce carries the routed latent beside the shared output
        seconds = seconds + latent_layers * cheapest(msg + positions * model.moe.latent_size * ACTIVATION_BYTES)[0]
    sampled = positions if sampled_positions is None else sampled_positions
    seconds = seconds + collectives.ring_allgather_s(sampled * SAMPLE_BYTES * tp, tp, alpha_s, beta_bytes_per_s)
    p2p = collectives.point_to_point_s(msg, alpha_s, beta_bytes_per_s)
    return {
        "seconds": np.where(tp > 1, seconds, 0.0) + (pp - 1) * p2p,
        "calls": np.where(tp > 1, calls, 0) + (pp - 1),
        "allreduce_s": np.where(tp > 1, allreduce_s, 0.0),
        "algorithm": pick,
    }
